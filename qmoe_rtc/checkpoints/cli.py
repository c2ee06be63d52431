"""``python -m qmoe_rtc checkpoint PATH``: read every MoE layer of a checkpoint (or those of
``--layers``) into contract inputs, as :func:`qmoe_rtc.checkpoints.load_layer` does, check each with the
very function ``QMoE()`` validates with (:func:`qmoe_rtc.runtime.check.check_layer`, contents included),
and print what each holds: model type, format, bits, group, k, routing (softmax or grouped sigmoid top-k,
normalisation, scaling), experts, shared experts, router. A progress bar over the layers goes to stderr on
a terminal. Exits 1 when any layer is refused (each refusal printed on its own line, naming the layer), 2
on an error before any layer (no such file, an unknown ``--scheme``). For an ``.onnx`` model, its QMoE
nodes. Nothing goes to a GPU: it checks a checkpoint before deployment."""

from __future__ import annotations

import argparse
import sys

from ..cli.args import csv
from ..errors import QMoEError
from ..formats.axis import format_of_quant_type


class _Bar:
    """``[#####.....] 3/8 layers`` on stderr, redrawn in place; silent when stderr is not a terminal."""

    def __init__(self, total: int):
        self.total, self.tty = total, sys.stderr.isatty()

    def show(self, done: int, what: str = "") -> None:
        if not self.tty or not self.total:
            return
        n = 30 * done // self.total
        sys.stderr.write(f"\r[{'#' * n}{'.' * (30 - n)}] {done}/{self.total} layers {what:<24}")
        sys.stderr.write("\n" if done == self.total else "")
        sys.stderr.flush()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m qmoe_rtc checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("path", help="a .safetensors file, or a folder of them with config.json; or an .onnx model")
    p.add_argument("--layers", type=csv(int), default=None, help="comma list of layer indices (default: every MoE layer)")
    p.add_argument("--scheme", default=None, help="mixtral, moe_mlp or gpt_oss: the projection names to read where "
                   "a layer holds two kinds (default: found from the names)")
    p.add_argument("--int-layout", default="auto", choices=("auto", "raw", "cuda"),
                   help=".onnx only: how 4/8-bit QMoE nodes without weights_prepacked store their codes "
                        "(default: from their shapes)")
    a = p.parse_args(argv)
    if str(a.path).endswith(".onnx"):
        return _onnx(a.path, a.int_layout)
    from .layer import load_layer, moe_layers
    from .source import Checkpoint

    with Checkpoint(a.path) as ckpt:  # each file's header parsed once for every layer
        return _layers(ckpt, a, load_layer, moe_layers)


def describe(got) -> str:
    """One line of what a loaded layer holds (:class:`~qmoe_rtc.checkpoints.layer.LoadedLayer`)."""
    w, at = got.weights, got.attributes
    E, N1 = w["fc1_experts_weights"].shape[:2]
    H = w["fc2_experts_weights"].shape[1]
    nbytes = sum(v.nbytes for v in w.values())
    router = "router [E, H]" if got.router_weight is not None else "no router"
    if got.router_bias is not None:
        router += " + bias [E]"
    fmt = format_of_quant_type(at.get("quant_type", "int"))
    codes = f"int{at['expert_weight_bits']}" if fmt.name == "int" else fmt.name  # float formats: no zero points
    zp = "" if fmt.name != "int" else " zero points" if "fc1_zero_points" in w or "fc2_zero_points" in w else " symmetric"
    shared = w.get("shared_fc1_experts_weights")
    extra = f", {shared.shape[0]} shared expert{'s' if shared.shape[0] > 1 else ''}" if shared is not None else ""
    if "shared_gate_weight" in w:
        extra += " (sigmoid gate)"
    norm = "renormalised" if at.get("normalize_routing_weights") else "not renormalised"
    route = "top-k"
    if at.get("scoring_func", "softmax") != "softmax":  # grouped sigmoid routing [ext]
        G, g = at.get("n_group", 0), at.get("topk_group", 0)
        route = "sigmoid top-k" + (f" in {g or G} of {G} groups" if G > 1 else "")
        route += " with score bias" if "router_score_bias" in w else ""
    rsf = at.get("routed_scaling_factor", 1.0)
    norm += f" x{rsf:g}" if rsf != 1.0 else ""
    return (f"{got.model_type or 'model'}: E={E} H={H} I={N1 // 2} k={at['k']} {route} {norm}, {codes} "
            f"block {at['block_size'] or 'row-wise'}{zp} ({w['fc1_scales'].dtype} scales){extra}, {router}, "
            f"{nbytes / 2**20:.1f} MiB")


def _layers(ckpt, a, load_layer, moe_layers) -> int:
    from ..contract.checks import QMoEAttributes
    from ..runtime.check import check_layer

    layers = a.layers if a.layers is not None else moe_layers(ckpt, a.scheme)
    if not layers:
        print(f"{a.path}: no MoE expert tensors found", file=sys.stderr)
        return 1
    bar, refused = _Bar(len(layers)), 0
    for i, L in enumerate(layers):
        bar.show(i, f"(reading layer {L})")
        try:
            got = load_layer(ckpt, L, scheme=a.scheme)
            check_layer(got.weights, QMoEAttributes.from_kwargs(**got.attributes), validate_content=True)
        except QMoEError as exc:  # what QMoE() would refuse: say so, go on with the other layers
            text = str(exc).splitlines()[0] if str(exc) else ""
            print(f"layer {L}: refused: {type(exc).__name__}: {text}")
            refused += 1
            continue
        print(f"layer {L}: {describe(got)}")
    bar.show(len(layers))
    if refused:
        print(f"{refused} of {len(layers)} layers refused", file=sys.stderr)
    return 1 if refused else 0


def _onnx(path, int_layout: str = "auto") -> int:
    from ..contract.checks import QMoEAttributes
    from ..runtime.check import check_layer
    from .onnx_nodes import qmoe_nodes

    nodes = qmoe_nodes(path, int_layout=int_layout)
    if not nodes:
        print(f"{path}: no com.microsoft::QMoE nodes", file=sys.stderr)
        return 1
    refused = 0
    for node in nodes:
        try:  # the check QMoE() runs on the node's layer
            attrs = QMoEAttributes.from_kwargs(**node.attributes)
            layer = check_layer(node.weights, attrs, validate_content=True).gpu.layer
        except QMoEError as exc:
            print(f"{node.name}: refused: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            refused += 1
            continue
        nbytes = sum(v.nbytes for v in node.weights.values())
        print(f"{node.name}: E={layer.E} H={layer.H} I={layer.I} k={layer.attrs.k} {layer.attrs.activation_type}, "
              f"{layer.attrs.quant_type} ({node.layout}), inputs {node.inputs}, {nbytes / 2**20:.1f} MiB")
    return 1 if refused else 0
