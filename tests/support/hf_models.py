"""Tiny random transformers 5 models of the MoE families :mod:`qmoe_rtc.hf` replaces, their quantized checkpoints
written here in the real tools' storage, and inputs whose routing is clear of ties (for
``tests/checkpoints/test_transformers_dropin*.py``).

:func:`make_case` builds a model from its transformers config class (``AutoModelForCausalLM.from_config``), gives its
experts random weights of a useful size, quantizes them with :func:`qmoe_rtc.formats.quantize.quantize` in the
family's checkpoint format, writes the checkpoint (the quantized experts and shared MLPs under the names the tools
write, every other tensor of the model as it is, ``config.json`` = the model's config + ``quantization_config``) and
puts the dequantized weights back into the model, so that transformers computes the function the checkpoint holds::

    family        checkpoint format (the tool that writes it)              names
    mixtral       GPTQ v1, 4-bit, groups of 32, symmetric, float16 scales  block_sparse_moe.experts.{e}.w1/w3/w2
    qwen2_moe     compressed-tensors pack-quantized, 4-bit, groups of 32,  mlp.experts.{e}.gate_proj …, shared_expert,
                  asymmetric, bfloat16 scales (llm-compressor)             shared_expert_gate
    qwen3_moe     AWQ GEMM, 4-bit, groups of 32, float16 scales            mlp.experts.{e}.gate_proj …
    gpt_oss       MXFP4 (gpt-oss's own)                                    mlp.experts.gate_up_proj_blocks …, mlp.router
    deepseek_v3   FP8 e4m3, 32 x 32 block scales in float32 (DeepSeek's)   mlp.experts.{e}.gate_proj …, shared_experts,
                                                                           gate.e_score_correction_bias; layer 0 dense
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

H, I, E, VOCAB = 64, 32, 8, 128  # noqa: E741
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v3")
METHOD = {"mixtral": "gptq", "qwen2_moe": "compressed-tensors", "qwen3_moe": "awq", "gpt_oss": "mxfp4",
          "deepseek_v3": "fp8"}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
QUANT = {
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False,
             "checkpoint_format": "gptq"},
    "compressed-tensors": {"quant_method": "compressed-tensors", "format": "pack-quantized", "version": "0.14.0",
                           "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                               "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
                               "group_size": 32}}}, "ignore": ["lm_head", "re:.*mlp.gate$"]},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True},
    "mxfp4": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                 "model.embed_tokens", "lm_head"]},
    "fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 32]},
}


def config(family: str, **change):
    """The family's transformers config: H = 64, E = 8 experts of I = 32, 2 decoder layers (DeepSeek-V3: 3, the
    first dense), vocabulary 128."""
    import transformers as tf

    common = dict(hidden_size=H, vocab_size=VOCAB, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, initializer_range=0.05)
    if family == "mixtral":
        c = tf.MixtralConfig(intermediate_size=I, num_local_experts=E, num_experts_per_tok=2, **common)
    elif family == "qwen2_moe":
        c = tf.Qwen2MoeConfig(intermediate_size=2 * I, moe_intermediate_size=I, shared_expert_intermediate_size=2 * I,
                              num_experts=E, num_experts_per_tok=2, norm_topk_prob=False, **common)
    elif family == "qwen3_moe":
        c = tf.Qwen3MoeConfig(intermediate_size=2 * I, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=2,
                              norm_topk_prob=True, head_dim=16, **common)
    elif family == "gpt_oss":
        c = tf.GptOssConfig(intermediate_size=I, num_local_experts=E, num_experts_per_tok=4, head_dim=16,
                            **{**common, "max_position_embeddings": 131072})  # YaRN: 32 x its 4096
    elif family == "deepseek_v3":
        c = tf.DeepseekV3Config(intermediate_size=2 * I, moe_intermediate_size=I, n_routed_experts=E,
                                num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                                first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                                kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                                **{**common, "num_hidden_layers": 3, "num_key_value_heads": 4})
    else:
        raise ValueError(family)
    for key, value in change.items():
        setattr(c, key, value)
    return c


@dataclass
class Case:
    """A built case: ``model`` (transformers, the dequantized weights in it), the checkpoint folder ``path``, its
    family, the MoE layers and the token ids ``ids`` [2, 8]."""

    family: str
    model: object
    path: Path
    moe_layers: list
    ids: object


def pack_along(codes: np.ndarray, bits: int, axis: int, order=None) -> np.ndarray:
    """int32 words of ``codes`` packed along ``axis``, 32/bits per word, the code of position order[i] at bits·i."""
    per = 32 // bits
    c = np.moveaxis(np.asarray(codes).astype(np.uint32), axis, -1)
    c = c.reshape(*c.shape[:-1], -1, per)
    if order is not None:
        c = c[..., list(order)]
    words = np.zeros(c.shape[:-1], dtype=np.uint32)
    for i in range(per):
        words |= c[..., i] << np.uint32(bits * i)
    return np.ascontiguousarray(np.moveaxis(words, -1, axis)).view(np.int32)


def _quantize(method: str, w: np.ndarray):
    """float [E, N, K] -> (storage per expert: list of {suffix: array}, the dequantized float32 [E, N, K])."""
    from ml_dtypes import bfloat16, float8_e4m3fn

    from qmoe_rtc.formats.fp4 import dequantize_fp4
    from qmoe_rtc.formats.fp8 import dequantize_fp8
    from qmoe_rtc.formats.quantize import dequantize, quantize, unpack_codes, unpack_zero_points

    n, N, K = w.shape
    if method == "fp8":
        q = quantize(w, format="fp8_e4m3", block_size=32)
        store = [{"weight": q.packed[e].view(float8_e4m3fn), "weight_scale_inv": q.scales[e]} for e in range(n)]
        return store, dequantize_fp8(q.packed, q.scales, 32)
    if method == "mxfp4":
        q = quantize(w, format="mxfp4")
        return [{"blocks": q.packed.reshape(n, N, K // 32, 16), "scales": q.scales}], dequantize_fp4("mxfp4", q.packed,
                                                                                                     q.scales)
    sym = method == "gptq"
    sdt = {"gptq": np.float16, "awq": np.float16, "compressed-tensors": bfloat16}[method]
    q = quantize(w, bits=4, block_size=32, symmetric=sym, scale_dtype=sdt)
    codes, nb = unpack_codes(q.packed, 4, K), K // 32
    zeros = np.full((n, N, nb), 8) if sym else unpack_zero_points(q.zero_points, 4, N, nb, True)
    store = []
    for e in range(n):
        c, z, s = codes[e], zeros[e].astype(np.int64), q.scales[e]
        if method == "gptq":
            store.append({"qweight": pack_along(c.T, 4, 0), "qzeros": pack_along((z - 1).T, 4, 1),
                          "scales": np.ascontiguousarray(s.T), "g_idx": (np.arange(K) // 32).astype(np.int32)})
        elif method == "awq":
            store.append({"qweight": pack_along(c.T, 4, 1, AWQ_ORDER), "qzeros": pack_along(z.T, 4, 1, AWQ_ORDER),
                          "scales": np.ascontiguousarray(s.T)})
        else:
            store.append({"weight_packed": pack_along(c, 4, 1), "weight_scale": np.ascontiguousarray(s),
                          "weight_shape": np.array([N, K], dtype=np.int32),
                          "weight_zero_point": pack_along(z, 4, 0)})
    return store, dequantize(q.packed, q.scales, 4, 32, q.zero_points, K=K)


def _to_torch(a):
    import torch

    a = np.ascontiguousarray(a)
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    if a.dtype.name == "float8_e4m3fn":
        return torch.from_numpy(a.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    return torch.from_numpy(a.copy())


def _np(t) -> np.ndarray:
    return t.detach().to("cpu").float().numpy().astype(np.float64)


def _moe_blocks(model):
    return {L: layer.mlp for L, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")}


def _fill_block(family: str, method: str, block, L: int, rng, tensors: dict) -> None:
    """Random experts (and shared MLP) for ``block`` of layer ``L``, quantized into ``tensors`` under the checkpoint's
    names and dequantized back into the block's parameters; random router weights (and biases) in the model."""
    import torch

    ex = block.experts
    w1 = rng.standard_normal((E, 2 * I, H)) / np.sqrt(H)  # FC1 [E, 2I, H]: gate rows then up (gpt-oss: interleaved)
    w2 = rng.standard_normal((E, H, I)) / np.sqrt(I)  # unit-size activations through each projection
    (s1, d1), (s2, d2) = _quantize(method, w1), _quantize(method, w2)
    router = block.router if family == "gpt_oss" else block.gate
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(rng.standard_normal((E, H)) * 0.25))  # logits of about unit size
        if family == "gpt_oss":
            ex.gate_up_proj.copy_(torch.from_numpy(d1.transpose(0, 2, 1)))  # [E, H, 2I]
            ex.down_proj.copy_(torch.from_numpy(d2.transpose(0, 2, 1)))  # [E, I, H]
            ex.gate_up_proj_bias.copy_(torch.from_numpy(rng.standard_normal((E, 2 * I)) * 0.1))
            ex.down_proj_bias.copy_(torch.from_numpy(rng.standard_normal((E, H)) * 0.1))
            router.bias.copy_(torch.from_numpy(rng.standard_normal(E) * 0.1))
        else:
            ex.gate_up_proj.copy_(torch.from_numpy(d1))
            ex.down_proj.copy_(torch.from_numpy(d2))
        if family == "deepseek_v3":
            router.e_score_correction_bias.copy_(torch.from_numpy(rng.standard_normal(E) * 0.05))
        if family == "qwen2_moe":
            block.shared_expert_gate.weight.copy_(torch.from_numpy(rng.standard_normal((1, H)) * 0.25))
    base = _base(family, L)
    if method == "mxfp4":
        for proj, st in (("gate_up_proj", s1[0]), ("down_proj", s2[0])):
            tensors[f"{base}.experts.{proj}_blocks"], tensors[f"{base}.experts.{proj}_scales"] = st["blocks"], st["scales"]
    else:
        names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        for e in range(E):
            for name, st in ((names[0], _rows(s1[e], method, 0, I)), (names[1], _rows(s1[e], method, I, I)),
                             (names[2], s2[e])):
                tensors.update({f"{base}.experts.{e}.{name}.{k}": v for k, v in st.items()})
    shared = SHARED.get(family)
    if shared is not None:
        _fill_shared(method, getattr(block, shared), f"{base}.{shared}", rng, tensors)


def _base(family: str, L: int) -> str:
    """The MoE block's prefix in the checkpoint (Mixtral's hub checkpoints: block_sparse_moe)."""
    return f"model.layers.{L}.{'block_sparse_moe' if family == 'mixtral' else 'mlp'}"


#: the shared MLP's attribute (and checkpoint name) by family
SHARED = {"qwen2_moe": "shared_expert", "deepseek_v3": "shared_experts"}


def _rows(store: dict, method: str, start: int, n: int) -> dict:
    """Output rows [start, start + n) of one expert's FC1 storage (its gate or its up projection)."""
    out = {}
    for k, v in store.items():
        if k == "weight_shape":
            out[k] = np.array([n, v[1]], dtype=np.int32)
        elif method in ("gptq", "awq") and k in ("qweight", "qzeros", "scales"):  # [.., N] along the last axis
            per = 1 if k == "scales" or (method == "gptq" and k == "qweight") else 8
            out[k] = np.ascontiguousarray(v[:, start // per:(start + n) // per])
        elif k == "weight_zero_point":  # packed along N: 8 codes a word
            out[k] = np.ascontiguousarray(v[start // 8:(start + n) // 8])
        elif k == "weight_scale_inv":  # 32 x 32 blocks of rows
            out[k] = np.ascontiguousarray(v[start // 32:(start + n) // 32])
        elif k == "g_idx":
            out[k] = v
        else:
            out[k] = np.ascontiguousarray(v[start:start + n])
    return out


def _fill_shared(method: str, mlp, prefix: str, rng, tensors: dict) -> None:
    import torch

    Is = mlp.gate_proj.weight.shape[0]
    w1 = rng.standard_normal((1, 2 * Is, H)) / np.sqrt(H)
    w2 = rng.standard_normal((1, H, Is)) / np.sqrt(Is)
    (s1, d1), (s2, d2) = _quantize(method, w1), _quantize(method, w2)
    with torch.no_grad():
        mlp.gate_proj.weight.copy_(torch.from_numpy(d1[0, :Is]))
        mlp.up_proj.weight.copy_(torch.from_numpy(d1[0, Is:]))
        mlp.down_proj.weight.copy_(torch.from_numpy(d2[0]))
    for name, st in (("gate_proj", _rows(s1[0], method, 0, Is)), ("up_proj", _rows(s1[0], method, Is, Is)),
                     ("down_proj", s2[0])):
        tensors.update({f"{prefix}.{name}.{k}": v for k, v in st.items()})


def make_case(family: str, path: Path, *, seed: int = 0, dtype=None, device: str = "cpu", **change) -> Case:
    """Build, quantize and save a case (module docstring) at ``path``: the model in ``dtype`` (default float32) on
    ``device``; ``change``: config fields changed before the model is built. The checkpoint's float tensors are the
    model's in ``dtype`` (as a checkpoint of a model in that dtype holds them); the model holds the dequantized
    experts rounded to ``dtype``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = AutoModelForCausalLM.from_config(config(family, **change)).float().eval()
    method, tensors = METHOD[family], {}
    blocks = _moe_blocks(model)
    for L, block in blocks.items():
        _fill_block(family, method, block, L, rng, tensors)
    model = model.to(dtype=dtype or torch.float32)
    quantized = tuple(f"model.layers.{L}.mlp.{p}" for L in blocks for p in ("experts.gate_up_proj", "experts.down_proj",
                                                                            f"{SHARED.get(family, '-')}."))
    for name, t in model.state_dict().items():
        if name.startswith(quantized) and not name.endswith("_bias"):
            continue
        for L in blocks:
            name = name.replace(f"model.layers.{L}.mlp.", f"{_base(family, L)}.")
        tensors[name] = t.detach().clone()
    path.mkdir(parents=True, exist_ok=True)
    save_file({n: (v if isinstance(v, torch.Tensor) else _to_torch(v)).contiguous() for n, v in tensors.items()},
              str(path / "model.safetensors"))
    cfg = json.loads(model.config.to_json_string())
    cfg["quantization_config"] = QUANT[method]
    (path / "config.json").write_text(json.dumps(cfg))
    ids = torch.from_numpy(rng.integers(0, VOCAB, size=(2, 8))).to(device)
    return Case(family, model.to(device), path, sorted(blocks), ids)


def routers(model) -> dict:
    """{layer: the router module} of the model's MoE blocks (replaced or not: the replacement keeps the router)."""
    out = {}
    for L, layer in enumerate(model.model.layers):
        r = getattr(layer.mlp, "router", None) or getattr(layer.mlp, "gate", None)
        if r is not None and hasattr(r, "top_k"):
            out[L] = r
    return out


def router_logits(model, ids) -> dict:
    """{layer: float64 logits [T, E]} the model's routers compute on ``ids``, and the model's logits."""
    import torch

    caught, rs = {}, routers(model)
    hooks = [r.register_forward_hook(lambda m, a, o, L=L: caught.__setitem__(L, o[0].detach().double().cpu().numpy()))
             for L, r in rs.items()]
    try:
        with torch.no_grad():
            logits = model(ids, use_cache=False).logits
    finally:
        for h in hooks:
            h.remove()
    return caught, logits


def clearance(family: str, logits: np.ndarray, router) -> float:
    """How far the routing decisions on ``logits`` [T, E] are from a tie, the smallest over the rows: for the softmax
    families the k-th largest logit less the next, less 2^-6 of its size (two bfloat16 roundings, which the
    implementations may take differently: the router GEMM in float32 or not); for DeepSeek-V3 the same of the
    choice scores (sigmoid + bias) and of the group scores at the topk_group-th group. Negative: a tie within
    rounding, where two correct implementations may choose different experts."""
    k = router.top_k
    if family != "deepseek_v3":
        s = -np.sort(-logits, axis=-1)
        return float((s[:, k - 1] - s[:, k] - 2.0**-5 * np.abs(s[:, k - 1])).min())
    G, g = router.num_group, router.topk_group
    c = 1.0 / (1.0 + np.exp(-logits)) + _np(router.e_score_correction_bias)
    group = np.sort(c.reshape(len(c), G, -1), axis=-1)[..., -2:].sum(-1)  # [T, G]
    order = np.argsort(-group, axis=-1, kind="stable")
    ranked = np.take_along_axis(group, order, axis=-1)
    margin = float((ranked[:, g - 1] - ranked[:, g]).min()) if g < G else np.inf
    for t in range(len(c)):
        cs = -np.sort(-np.concatenate([c[t].reshape(G, -1)[j] for j in order[t, :g]]))
        if k < len(cs):
            margin = min(margin, float(cs[k - 1] - cs[k]))
    return margin


def pick_ids(model, family: str, need: float, count: int = 1, tries: int = 64, seed: int = 0) -> list:
    """``count`` batches of token ids [2, 8] on whose every MoE layer the model's routing clears ``need``
    (:func:`clearance`): inputs where two correct implementations route alike. Refuses after ``tries`` batches."""
    import torch

    rng, out, seen = np.random.default_rng(seed), [], []
    device = next(model.parameters()).device
    for _ in range(tries):
        ids = torch.from_numpy(rng.integers(0, VOCAB, size=(2, 8))).to(device)
        caught, _ = router_logits(model, ids)
        rs = routers(model)
        worst = min(clearance(family, caught[L], rs[L]) for L in caught)
        seen.append(worst)
        if worst >= need:
            out.append(ids)
            if len(out) == count:
                return out
    raise AssertionError(f"{family}: no {count} of {tries} inputs route clear of ties by {need} (clearances {seen})")


def rel_err(got, want) -> float:
    """‖got − want‖ / ‖want‖ of two torch tensors, in float64."""
    g, w = got.double(), want.double()
    return float((g - w).norm() / w.norm())


def logits_of(model, ids):
    """``model(ids).logits`` without a cache or gradients."""
    import torch

    with torch.no_grad():
        return model(ids, use_cache=False).logits
