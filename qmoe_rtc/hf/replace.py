""":func:`replace_moe_blocks`: every MoE block of a loaded transformers 5 model replaced by a qmoe_rtc layer read from
the model's quantized checkpoint (:mod:`qmoe_rtc.checkpoints`), in place, with a progress bar over the blocks.

How it goes, block by block (each block is either replaced whole or left as it was):

1. The blocks are found by class name (:data:`~qmoe_rtc.hf.families.FAMILIES`) at ``….layers.{L}.{mlp|…}``; a
   module there that holds ``experts`` but is of no known class is refused by name before anything changes, and a
   dense MLP in the same layer list (DeepSeek-V3's first ``first_k_dense_replace`` layers) is left as it is and
   listed in the report. The model's MoE layers must be the checkpoint's (:func:`~qmoe_rtc.checkpoints.moe_layers`);
   checkpoint layers past the model's (DeepSeek-V3's multi-token-prediction layer) are listed, not read.
2. Layer L is read with :func:`~qmoe_rtc.checkpoints.load_layer` and checked against the block
   (:func:`~qmoe_rtc.hf.families.check_against_model`: sizes, k, renormalisation, grouped routing, activation,
   shared MLP). Quantized tensors come from the checkpoint; the float tensors the model holds come from the model,
   which computes with them: the router's score-correction bias (DeepSeek-V3), the shared experts' sigmoid gate
   (Qwen2-MoE), and with ``router="layer"`` the router's weight and bias (as the model holds them: its dtype where
   that is the activation dtype or float32, else float32). 16-bit scales and biases of another dtype than the
   activation dtype become it where that is exact, else float32 (float16 GPTQ scales in a bfloat16 model: float32,
   with the codes tiled for the tensor-core engines all the same, ``prepack="on"``).
3. The layer is built on the block's device (the device of its router's weight), the block is swapped for a
   :class:`~qmoe_rtc.hf.block.QMoEBlock`, and the replaced block's experts and shared MLP are moved to the meta
   device, so their float weights are freed even where something still holds the old block (on a GPU, torch's
   cached blocks are then handed back to the driver, where the next layer's upload finds them).

An error part way (a layer the checks refuse, a GPU out of memory) leaves the blocks before it replaced and the
rest as they were.
"""

from __future__ import annotations

import logging
import re
import sys
from dataclasses import dataclass, field

import numpy as np
import torch

from .._arrays import dtype_name, np_dtype
from ..contract import QMoEAttributes
from ..errors import QMoEInputError, QMoEUnsupportedError
from .block import QMoEBlock
from .families import FAMILIES, check_against_model, supported_blocks

__all__ = ["DropInReport", "find_blocks", "replace_moe_blocks"]

log = logging.getLogger("qmoe_rtc")

#: where a decoder layer's MLP sits: ``{root}.{L}.{slot}``
_SLOT = re.compile(r"^(?P<root>(?:.*\.)?layers)\.(?P<L>\d+)\.(?P<slot>mlp|block_sparse_moe|moe|feed_forward)$")
_DTYPES = ("float16", "bfloat16", "float32")
#: QMoE() options replace_moe_blocks passes through (layer_kwargs)
LAYER_OPTIONS = ("decode_max_routes", "prepack", "validate_content", "expert_counts")


@dataclass
class DropInReport:
    """What :func:`replace_moe_blocks` did: ``replaced`` decoder layer -> the module path now a
    :class:`~qmoe_rtc.hf.block.QMoEBlock`, ``formats`` layer -> its experts' format; ``dense`` layer -> the path of
    a dense MLP left as it is (no experts, by design); ``checkpoint_only`` the checkpoint's MoE layers the model has
    no layer for (not read); ``freed_bytes`` the float weights of the replaced experts and shared MLPs."""

    families: list
    router: str
    backend: str
    dtype: str
    replaced: dict = field(default_factory=dict)
    formats: dict = field(default_factory=dict)
    dense: dict = field(default_factory=dict)
    checkpoint_only: list = field(default_factory=list)
    freed_bytes: int = 0

    def __str__(self) -> str:
        fams = ", ".join(self.families)
        text = (f"qmoe_rtc: replaced {len(self.replaced)} MoE block(s) of {fams} (layers {_ranges(self.replaced)}; "
                f"router in {self.router}; {self.dtype}; {self.backend}); "
                f"experts {', '.join(sorted(set(self.formats.values())))}; "
                f"freed {self.freed_bytes / 2**20:.1f} MiB of float expert weights")
        if self.dense:
            text += f"; dense MLPs left as they are: layers {_ranges(self.dense)}"
        if self.checkpoint_only:
            text += f"; checkpoint MoE layers not in the model (not read): {_ranges(self.checkpoint_only)}"
        return text


def _ranges(layers) -> str:
    xs, out = sorted(layers), []
    for x in xs:
        if out and out[-1][1] == x - 1:
            out[-1][1] = x
        else:
            out.append([x, x])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out) or "none"


def find_blocks(model) -> tuple[list, dict]:
    """``(blocks, dense)`` of ``model``: ``blocks`` a list of ``(layer, path, block, family)`` for every MoE block of a
    known class, ``dense`` layer -> path of the dense MLPs in the same layer lists. Raises ``QMoEUnsupportedError``
    naming any module at an MLP's place that holds ``experts`` but is of no known class (nothing is skipped
    silently), and ``QMoEInputError`` when the model has no MoE block at all."""
    blocks, candidates, unknown = [], {}, []
    for name, module in model.named_modules():
        m, cls = _SLOT.match(name), type(module).__name__
        family = FAMILIES.get(cls)
        if family is not None:
            if m is None:
                raise QMoEUnsupportedError(f"{name or type(model).__name__}: a {cls} outside a decoder layer list "
                                           "(….layers.N.mlp), whose layer index names its checkpoint layer")
            blocks.append((int(m["L"]), name, module, family, m["root"]))
        elif m is not None:
            if hasattr(module, "experts"):
                unknown.append(f"{name} ({cls})")
            else:
                candidates[(m["root"], int(m["L"]))] = name
    if unknown:
        raise QMoEUnsupportedError(f"MoE blocks qmoe_rtc.hf does not replace: {', '.join(unknown)}; it replaces "
                                   f"{supported_blocks()}")
    if not blocks:
        raise QMoEInputError("model", f"a transformers model with MoE blocks ({supported_blocks()})",
                             f"{type(model).__name__} with none")
    seen: dict = {}
    for L, name, *_ in blocks:
        if L in seen:
            raise QMoEUnsupportedError(f"two MoE blocks of layer {L} ({seen[L]}, {name}): the layer index names one "
                                       "checkpoint layer")
        seen[L] = name
    roots = {b[4] for b in blocks}
    dense = {L: n for (root, L), n in candidates.items() if root in roots}
    return [b[:4] for b in sorted(blocks, key=lambda b: b[0])], dict(sorted(dense.items()))


def _check_transformers() -> None:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(f"qmoe_rtc.hf replaces blocks of transformers models: pip install qmoe_rtc[hf] ({exc})") from exc
    major = str(getattr(transformers, "__version__", "0")).split(".")[0]
    if not major.isdigit() or int(major) < 5:
        raise QMoEUnsupportedError(f"transformers {transformers.__version__}: the MoE blocks of transformers 5 are "
                                   "replaced (4.x blocks hold per-expert modules and return router logits)")


def _dtype(model, dtype) -> str:
    if dtype is None:
        dtype = getattr(model, "dtype", None)
        if dtype is None:
            dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise QMoEInputError("dtype", f"one of {_DTYPES} (the activations' dtype; None: the model's)", repr(dtype))
    return name


def _device(block, family, path: str, backend: str):
    """The device index the block's layer goes to (None for the reference backend)."""
    router = getattr(block, family.router)
    weight = next(iter(router.parameters()), None)
    device = weight.device if weight is not None else torch.device("cpu")
    if backend == "reference":
        if device.type != "cpu":
            raise QMoEInputError("backend", "'gpu' for a model on a GPU ('reference' is a float64 check on the CPU)",
                                 f"'reference' with {path} on {device}")
        return None
    if device.type != "cuda":
        raise QMoEInputError("model", "a model on a CUDA device (the layers run on NVIDIA GPUs; backend='reference' "
                             "checks one on the CPU)", f"{path}.{family.router} on {device}")
    return device.index if device.index is not None else torch.cuda.current_device()


def _numpy(t, dtype: str) -> np.ndarray:
    """A model tensor as a host NumPy array of ``dtype`` (exact for a 16-bit tensor into float32)."""
    return t.detach().to("cpu", torch.float32).numpy().astype(np_dtype(dtype))


def _exact(a: np.ndarray, dtype: str) -> bool:
    return bool(np.array_equal(a.astype(np_dtype(dtype)).astype(np.float64), a.astype(np.float64)))


def _in_dtype(weights: dict, dtype: str) -> dict:
    """16-bit float arrays of another dtype than the activations': into it where every one converts exactly, else
    all into float32 (exact)."""
    half = {n: a for n, a in weights.items() if dtype_name(a) in ("float16", "bfloat16") and dtype_name(a) != dtype}
    if not half:
        return weights
    to = dtype if dtype != "float32" and all(_exact(a, dtype) for a in half.values()) else "float32"
    return {**weights, **{n: np.ascontiguousarray(a.astype(np_dtype(to))) for n, a in half.items()}}


def _model_inputs(family, block, weights: dict, dtype: str, router_in_layer: bool) -> dict:
    """The layer's inputs the model holds: the score-correction bias, the shared gate, the router's linear."""
    router = getattr(block, family.router)
    out = dict(weights)
    if family.grouped:
        out["router_score_bias"] = _numpy(router.e_score_correction_bias, "float32")
    if family.shared_gate is not None:
        out["shared_gate_weight"] = _numpy(getattr(block, family.shared_gate).weight.reshape(-1), "float32")
    out = _in_dtype(out, dtype)
    if router_in_layer:
        for name, t in (("router_weight", router.weight), ("router_bias", getattr(router, "bias", None))):
            if t is not None:
                held = str(t.dtype).removeprefix("torch.")
                out[name] = _numpy(t, held if held in (dtype, "float32") else "float32")
    return out


def _prepack(weights: dict, attributes: dict, dtype: str):
    """'on' where the codes can be tiled for the tensor-core engines and the activations are 16-bit (a layer whose
    scales are float32 would otherwise stay untiled for float32 calls it never gets), else None (QMoE's default)."""
    from ..runtime.check import check_layer

    if dtype == "float32":
        return None
    try:
        check_layer(weights, QMoEAttributes.from_kwargs(**attributes), prepack="on")
    except QMoEUnsupportedError:
        return None
    return "on"


def _build(weights: dict, attributes: dict, backend: str, device, dtype: str, options: dict):
    if backend == "reference":
        from .reference import ReferenceLayer

        return ReferenceLayer(weights, attributes)
    from ..executor import QMoE

    kw = dict(options)
    if "prepack" not in kw:
        kw["prepack"] = _prepack(weights, attributes, dtype)
    return QMoE(**weights, **attributes, device=device, **kw)


def _free(block, family) -> int:
    """Move the replaced block's children but its router to the meta device; the bytes freed."""
    freed, on_gpu = 0, False
    for name, child in block.named_children():
        if name == family.router:
            continue
        for t in (*child.parameters(), *child.buffers()):
            if t.device.type != "meta":
                freed += t.numel() * t.element_size()
                on_gpu |= t.device.type == "cuda"
        child.to("meta")
    if on_gpu:
        torch.cuda.empty_cache()
    return freed


def _describe(attributes: dict) -> str:
    qt = attributes.get("quant_type") or "int"
    bits = attributes.get("expert_weight_bits", 4)
    name = f"int{bits}" if qt == "int" else qt
    bs = attributes.get("block_size", 0)
    return f"{name} {'block ' + str(bs) if bs else 'per row'}"


class _Progress:
    """A tqdm bar over the blocks where tqdm is installed, else one stderr line per block; nothing when disabled."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.done, self.bar = total, enabled, 0, None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total, desc="qmoe_rtc: MoE blocks", unit="block", file=sys.stderr)

    def step(self, what: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(what, refresh=False)
            self.bar.update(1)
        elif self.enabled:
            print(f"qmoe_rtc: MoE block {self.done}/{self.total}: {what}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _check_args(model, router, progress, backend, layer_kwargs) -> dict:
    if not isinstance(model, torch.nn.Module):
        raise QMoEInputError("model", "a transformers model (a torch.nn.Module)", type(model).__name__)
    if router not in ("torch", "layer"):
        raise QMoEInputError("router", "'torch' (the model's router computes the logits) or 'layer' (the layer's "
                             "router GEMM)", repr(router))
    if backend not in ("gpu", "reference"):
        raise QMoEInputError("backend", "'gpu', or 'reference' (the float64 CPU reference: a slow check, "
                             "explicitly asked for)", repr(backend))
    if not isinstance(progress, bool):
        raise QMoEInputError("progress", "True or False", repr(progress))
    options = dict(layer_kwargs or {})
    bad = sorted(set(options) - set(LAYER_OPTIONS))
    if bad:
        raise QMoEInputError(f"layer_kwargs[{bad[0]!r}]", f"one of {LAYER_OPTIONS} (the rest comes from the "
                             "checkpoint and the model)", repr(options[bad[0]]))
    if backend == "reference" and options:
        raise QMoEInputError("layer_kwargs", "none with backend='reference'", repr(options))
    return options


def _plan(blocks, dense: dict, ck_layers: list) -> list:
    """The checkpoint's MoE layers that no model layer has (after checking the others against the model's)."""
    have = set(ck_layers)
    missing = [(L, path) for L, path, *_ in blocks if L not in have]
    if missing:
        L, path = missing[0]
        raise QMoEInputError(f"layer {L}", f"MoE experts of layer {L} in the checkpoint (the model's {path} is an MoE "
                             "block)", f"none; the checkpoint's MoE layers: {_ranges(ck_layers)}")
    stray = sorted(have & set(dense))
    if stray:
        raise QMoEInputError(f"layer {stray[0]}", f"a dense MLP in the checkpoint too (the model's {dense[stray[0]]} "
                             "has no experts)", "MoE experts")
    last = max([L for L, *_ in blocks] + list(dense))
    return sorted(L for L in have if L > last)


def replace_moe_blocks(model, checkpoint, *, router: str = "torch", progress: bool = True, dtype=None,
                       backend: str = "gpu", layer_kwargs: dict | None = None) -> DropInReport:
    """Replace every MoE block of ``model`` (a loaded transformers 5 model: Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss,
    DeepSeek-V3; :data:`~qmoe_rtc.hf.families.FAMILIES`) with a qmoe_rtc layer read from ``checkpoint`` (the
    model's quantized checkpoint: a folder with ``config.json``, a ``.safetensors`` file or an open
    :class:`~qmoe_rtc.checkpoints.Checkpoint`; every format :func:`~qmoe_rtc.checkpoints.load_layer` reads), in
    place; returns a :class:`DropInReport` (its ``str`` is a one-line summary).

    ``router``: 'torch' (default) keeps the model's router module computing the logits (exactly as the model
    does; the layer routes from them), 'layer' moves the router's linear into the layer's router GEMM [ext] (one
    launch; the router module is no longer called). ``dtype``: the activations' dtype (default: the model's).
    ``progress``: a bar over the blocks on stderr (tqdm where installed, else a line per block). ``layer_kwargs``:
    options passed to :class:`~qmoe_rtc.QMoE` (``decode_max_routes``, ``prepack``, ``validate_content``,
    ``expert_counts``). ``backend='reference'``: every block runs the float64 CPU reference instead of a GPU layer,
    for a model on the CPU only: a slow correctness check, asked for explicitly and logged as a WARNING, never a
    way to serve. The replaced model is for inference (the op has no backward) and compiles with
    ``torch.compile(fullgraph=True)`` where the model's own code does.

    Raises ``QMoEUnsupportedError`` naming an MoE block of another class (before anything changes) or transformers
    older than 5, and ``QMoEInputError`` naming what differs between the model and the checkpoint (module docstring)."""
    options = _check_args(model, router, progress, backend, layer_kwargs)
    _check_transformers()
    blocks, dense = find_blocks(model)
    T = _dtype(model, dtype)
    devices = [_device(b, f, p, backend) for _, p, b, f in blocks]  # every block's device, before any change
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden_act = getattr(text, "hidden_act", None)
    if backend == "reference":
        log.warning("qmoe_rtc.hf: backend='reference': each replaced MoE block runs the float64 CPU reference, a slow "
                    "correctness check, not a way to serve a model")
    from ..checkpoints import Checkpoint, load_layer, moe_layers

    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)
    report = DropInReport(sorted({f.name for *_, f in blocks}), router, backend, T, dense=dense)
    bar = _Progress(len(blocks), progress)
    try:
        report.checkpoint_only = _plan(blocks, dense, moe_layers(ckpt))
        for (L, path, block, family), device in zip(blocks, devices):
            loaded = load_layer(ckpt, L)
            check_against_model(family, block, path, loaded.weights, loaded.attributes, hidden_act)
            weights = _model_inputs(family, block, loaded.weights, T, router == "layer")
            layer = _build(weights, loaded.attributes, backend, device, T, options)
            new = QMoEBlock(layer, family, getattr(block, family.router), router_in_layer=router == "layer",
                            layer_index=L, dtype=T)
            parent, _, name = path.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, name, new)
            report.freed_bytes += _free(block, family)
            report.replaced[L], report.formats[L] = path, _describe(loaded.attributes)
            bar.step(f"layer {L}: {report.formats[L]}")
    finally:
        bar.close()
        if ckpt is not checkpoint:
            ckpt.close()
    return report
