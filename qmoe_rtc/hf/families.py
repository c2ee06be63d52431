"""The MoE blocks of transformers 5 that :func:`~qmoe_rtc.hf.replace_moe_blocks` replaces, by class name, and the checks
that a checkpoint's layer computes the block's function (GPU-free; reads module attributes and array shapes only).

What each block is in transformers 5 (``transformers/models/<model>/modeling_<model>.py``; the same in 5.17 and 5.25)::

    class (model)                      router (attr)          experts (3-D parameters)          shared MLP      returns
    MixtralSparseMoeBlock (mixtral)    gate: MixtralTopKRouter  gate_up_proj [E, 2I, H] (gate      -               hidden
                                       softmax, top k, /sum      rows, then up), down_proj [E, H, I]
    Qwen2MoeSparseMoeBlock (qwen2_moe) gate: Qwen2MoeTopKRouter  as Mixtral                         shared_expert,  hidden
                                       /sum if norm_topk_prob                                      sigmoid gate
                                                                                                   shared_expert_gate
    Qwen3MoeSparseMoeBlock (qwen3_moe) gate: Qwen3MoeTopKRouter  as Mixtral                         -               hidden
    GptOssMLP (gpt_oss)                router: GptOssTopKRouter  gate_up_proj [E, H, 2I] (gate      -               (hidden,
                                       (with a bias) top k of    and linear columns interleaved),                  router_scores)
                                       the logits, softmax       biases, clamped swiglu
    DeepseekV3MoE (deepseek_v3)        gate: DeepseekV3TopkRouter as Mixtral                        shared_experts  hidden
                                       float32 logits, sigmoid,
                                       e_score_correction_bias,
                                       grouped top k

Every router's forward takes the block's rows ``[T, H]`` and returns ``(router_logits [T, E], weights [T, k],
indices [T, k])``; the logits are the block input's dtype (Mixtral, Qwen, gpt-oss: with the router's bias) or
float32 (DeepSeek-V3), which the layer takes as they are. A decoder layer whose MLP is dense (DeepSeek-V3's first
``first_k_dense_replace`` layers, Qwen2-MoE's ``mlp_only_layers``) has no block here and is left as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import QMoEInputError

__all__ = ["FAMILIES", "Family", "check_against_model", "supported_blocks"]


@dataclass(frozen=True)
class Family:
    """One MoE block class of transformers 5: ``router`` the attribute of its router module, ``shared`` of its shared
    MLP (and ``shared_gate`` of that MLP's sigmoid gate), ``scores``: its forward returns ``(hidden, router_scores)``
    (gpt-oss) rather than the hidden states alone; ``normalize``: the router attribute that says whether the top k
    weights are renormalised (None: always); ``grouped``: DeepSeek-V3's grouped sigmoid routing; ``activation``:
    'silu' (SwiGLU) or 'gpt_oss' (gpt-oss's clamped SwiGLU, with the experts' ``alpha`` and ``limit``);
    ``float32_logits``: the router computes its logits in float32 (else in the block input's dtype)."""

    name: str
    router: str = "gate"
    shared: str | None = None
    shared_gate: str | None = None
    scores: bool = False
    normalize: str | None = None
    grouped: bool = False
    activation: str = "silu"
    float32_logits: bool = False


#: MoE block class name (transformers 5) -> its family
FAMILIES = {
    "MixtralSparseMoeBlock": Family("mixtral"),
    "Qwen2MoeSparseMoeBlock": Family("qwen2_moe", shared="shared_expert", shared_gate="shared_expert_gate",
                                     normalize="norm_topk_prob"),
    "Qwen3MoeSparseMoeBlock": Family("qwen3_moe", normalize="norm_topk_prob"),
    "GptOssMLP": Family("gpt_oss", router="router", scores=True, activation="gpt_oss"),
    "DeepseekV3MoE": Family("deepseek_v3", shared="shared_experts", normalize="norm_topk_prob", grouped=True,
                            float32_logits=True),
}


def supported_blocks() -> str:
    """The block classes replaced, with their model types, for messages."""
    return ", ".join(f"{cls} ({f.name})" for cls, f in FAMILIES.items())


def _attr(module, names: tuple, what: str, where: str):
    for n in names:
        v = getattr(module, n, None)
        if v is not None:
            return v
    raise QMoEInputError(f"{where}.{names[0]}", f"the {what} (a transformers 5 module attribute)",
                         f"missing from {type(module).__name__}")


def _mismatch(name: str, model_value, model_where: str, ck_value) -> QMoEInputError:
    return QMoEInputError(name, f"{model_value} (the model's {model_where})", f"{ck_value} (the checkpoint's layer)")


def _same_float(a, b) -> bool:
    return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=0.0)


def check_against_model(family: Family, block, path: str, weights: dict, attributes: dict, hidden_act) -> None:
    """Refuse a checkpoint layer (``weights``, ``attributes``: a :class:`~qmoe_rtc.checkpoints.LoadedLayer`'s) that
    would not compute what ``block`` (at ``path`` in the model) computes: a ``QMoEInputError`` naming the setting,
    the model's value and the checkpoint's. Compares the sizes (E, H, I, the shared MLP's), k, the renormalisation,
    the grouped routing's settings (DeepSeek-V3) and the activation (``hidden_act``: the model config's)."""
    experts, router = block.experts, getattr(block, family.router)
    where = f"{path}.experts"
    E = _attr(experts, ("num_experts",), "expert count", where)
    H = _attr(experts, ("hidden_dim", "hidden_size"), "hidden size", where)
    I = _attr(experts, ("intermediate_dim", "intermediate_size"), "experts' intermediate size", where)
    w1, w2 = weights["fc1_experts_weights"], weights["fc2_experts_weights"]
    got = {"E": int(w1.shape[0]), "H": int(w2.shape[1]), "I": int(w1.shape[1]) // 2}
    for name, want in (("E", E), ("H", H), ("I", I)):
        if got[name] != int(want):
            raise _mismatch(f"{path} {name}", want, f"{where} size", got[name])
    rpath = f"{path}.{family.router}"
    k = _attr(router, ("top_k",), "experts per token", rpath)
    if attributes.get("k") != int(k):
        raise _mismatch(f"{path} k", k, f"{rpath}.top_k", attributes.get("k"))
    norm = 1 if family.normalize is None else int(bool(_attr(router, (family.normalize,), "renormalisation flag", rpath)))
    if int(attributes.get("normalize_routing_weights", 0)) != norm:
        src = "router (always renormalises)" if family.normalize is None else f"{rpath}.{family.normalize}"
        raise _mismatch(f"{path} normalize_routing_weights", norm, src, attributes.get("normalize_routing_weights", 0))
    _check_routing(family, router, rpath, path, attributes)
    _check_activation(family, experts, where, path, attributes, hidden_act)
    _check_shared(family, block, path, weights, int(I))


def _check_routing(family: Family, router, rpath: str, path: str, attributes: dict) -> None:
    scoring = attributes.get("scoring_func", "softmax")
    if not family.grouped:
        if scoring != "softmax":
            raise _mismatch(f"{path} scoring_func", "'softmax'", f"{type(router).__name__}", repr(scoring))
        return
    if scoring != "sigmoid":
        raise _mismatch(f"{path} scoring_func", "'sigmoid' (grouped sigmoid routing)", type(router).__name__,
                        repr(scoring))
    for attr, names in (("n_group", ("num_group", "n_group")), ("topk_group", ("topk_group",))):
        want = int(_attr(router, names, attr, rpath))
        if int(attributes.get(attr, 0)) != want:
            raise _mismatch(f"{path} {attr}", want, f"{rpath}.{names[0]}", attributes.get(attr))
    rsf = _attr(router, ("routed_scaling_factor",), "routed scaling factor", rpath)
    if not _same_float(attributes.get("routed_scaling_factor", 1.0), rsf):
        raise _mismatch(f"{path} routed_scaling_factor", rsf, f"{rpath}.routed_scaling_factor",
                        attributes.get("routed_scaling_factor"))


def _check_activation(family: Family, experts, where: str, path: str, attributes: dict, hidden_act) -> None:
    if attributes.get("activation_type") != "swiglu":
        raise _mismatch(f"{path} activation_type", "'swiglu'", "experts", repr(attributes.get("activation_type")))
    if family.activation == "gpt_oss":  # glu · sigmoid(alpha · glu) · (linear + 1), clamped at limit
        for attr, name in (("alpha", "activation_alpha"), ("limit", "swiglu_limit")):
            want = _attr(experts, (attr,), f"clamped SwiGLU's {attr}", where)
            if not _same_float(attributes.get(name, math.nan), want):
                raise _mismatch(f"{path} {name}", want, f"{where}.{attr}", attributes.get(name))
        if not _same_float(attributes.get("activation_beta", math.nan), 1.0):
            raise _mismatch(f"{path} activation_beta", 1.0, "experts ((linear + 1))", attributes.get("activation_beta"))
        return
    if hidden_act not in ("silu", "swish"):
        raise _mismatch(f"{path} activation", "'silu' (the layer's SwiGLU gates by SiLU)", "config hidden_act",
                        repr(hidden_act))
    for name, neutral in (("activation_alpha", 1.0), ("activation_beta", 0.0)):
        if name in attributes and not _same_float(attributes[name], neutral):
            raise _mismatch(f"{path} {name}", neutral, "SwiGLU", attributes[name])


def _check_shared(family: Family, block, path: str, weights: dict, I: int) -> None:
    have = weights.get("shared_fc1_experts_weights")
    if family.shared is None:
        if have is not None:
            raise _mismatch(f"{path} shared experts", "none", f"{type(block).__name__}", "shared experts")
        return
    mlp = getattr(block, family.shared, None)
    spath = f"{path}.{family.shared}"
    if mlp is None:
        raise QMoEInputError(spath, f"the shared MLP of a {type(block).__name__}", "missing from the model")
    if have is None:
        raise _mismatch(f"{path} shared experts", f"a shared MLP ({spath})", type(block).__name__, "none")
    size = int(_attr(mlp, ("intermediate_size",), "shared MLP's intermediate size", spath))
    S, n = int(have.shape[0]), int(have.shape[1]) // 2
    if S * n != size:
        raise _mismatch(f"{path} shared intermediate size", size, f"{spath}.intermediate_size", f"{S} x {n}")
    if family.shared_gate is not None and getattr(block, family.shared_gate, None) is None:
        raise QMoEInputError(f"{path}.{family.shared_gate}", "the shared MLP's sigmoid gate", "missing from the model")
