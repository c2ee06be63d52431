"""What a model's ``config.json`` says about its MoE layers, by ``model_type``: the expert count, the
experts per token k and how the router's top-k weights are normalised. Nothing is guessed: a field the
model's routing needs and the file lacks is a ``QMoEInputError`` naming it, and a router the contract's
softmax top-k does not compute is a ``QMoEUnsupportedError`` naming the model type or the setting.

The contract routes by softmax over all E logits, then the top k, renormalised to sum 1 when
``normalize_routing_weights`` = 1. Per model type (the models' own routers, as transformers runs them):

    mixtral                     softmax, top k, always renormalised (no ``norm_topk_prob`` in its config)
    gpt_oss                     softmax over the top k logits = softmax, top k, renormalised
    qwen2_moe, qwen3_moe,       softmax, top k, renormalised exactly when ``norm_topk_prob`` (required)
    qwen3_next, qwen3_vl_moe,
    olmoe
    deepseek_v2                 as above where ``topk_method`` is greedy, ``scoring_func`` softmax and
                                ``routed_scaling_factor`` 1 (DeepSeek-V2-Lite); else refused
    deepseek_v3, kimi_k2,       sigmoid scores with a correction bias and grouped top-k: refused
    glm4_moe, …
    phimoe                      Phi-3.5-MoE's sparse mixer (per-choice masked softmax): refused

A config without a known ``model_type`` is read by its fields alone: ``norm_topk_prob`` and
``num_experts_per_tok`` are then required.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import QMoEInputError, QMoEUnsupportedError

__all__ = ["MoeConfig", "moe_config"]

#: config.json keys that hold the routed expert count (transformers' spellings across model types)
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
#: config.json keys that hold k
K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "experts_per_token")
#: model types whose router always renormalises the top k weights
ALWAYS_NORMALISED = frozenset({"mixtral", "gpt_oss"})
#: model types whose router renormalises exactly when ``norm_topk_prob`` is true
NORM_TOPK_PROB = frozenset({"qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_vl_moe", "olmoe", "deepseek_v2"})
#: model types whose routing the contract cannot express, with the reason
REFUSED = {
    "phimoe": "Phi-3.5-MoE routes by its sparse mixer (a masked softmax per choice), not softmax top-k",
    "deepseek_v3": "DeepSeek-V3 routes by sigmoid scores with a correction bias and grouped top-k",
    "kimi_k2": "Kimi-K2 routes as DeepSeek-V3 (sigmoid scores, correction bias, grouped top-k)",
    "glm4_moe": "GLM-4.5 routes by sigmoid scores with a correction bias and grouped top-k",
    "glm4v_moe": "GLM-4.5V routes by sigmoid scores with a correction bias and grouped top-k",
    "dots1": "dots.llm1 routes by sigmoid scores with a correction bias and grouped top-k",
    "llama4": "Llama 4 routes by a sigmoid of the top-1 logit",
}
#: model types whose router the contract's grouped sigmoid routing [ext] describes (reference only for now)
GROUPED_SIGMOID = frozenset({"deepseek_v3", "kimi_k2", "glm4_moe", "glm4v_moe", "dots1"})
#: what the refusal of a grouped sigmoid router adds
GROUPED_SIGMOID_HINT = ("; the contract's scoring_func='sigmoid', n_group, topk_group, routed_scaling_factor and "
                        "router_score_bias [ext] describe such routing and the float64 reference computes it, but "
                        "the GPU routing for it is not built yet, so the loader does not produce such layers")
#: settings the contract's routing computes, by key: another value routes differently
ROUTING = {"scoring_func": ("softmax",), "topk_method": ("greedy",), "n_group": (None, 1), "topk_group": (None, 1),
           "routed_scaling_factor": (None, 1, 1.0)}


@dataclass(frozen=True)
class MoeConfig:
    """A model's MoE routing as the contract's attributes: ``E`` routed experts, ``k`` per token,
    ``normalize`` (``normalize_routing_weights``), ``model_type`` as config.json names it (or None)."""

    E: int
    k: int
    normalize: int
    model_type: str | None


def _int_field(cfg: dict, keys: tuple, what: str) -> int:
    found = {k: cfg[k] for k in keys if cfg.get(k) is not None}
    if not found:
        raise QMoEInputError(f"config.json {keys[0]}", f"the {what} (one of {', '.join(keys)})", "missing")
    values = set()
    for key, v in found.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise QMoEInputError(f"config.json {key}", f"a positive integer ({what})", repr(v))
        values.add(v)
    if len(values) > 1:
        raise QMoEInputError(f"config.json {'/'.join(found)}", f"one {what}", f"{found}")
    return values.pop()


def _check_routing(cfg: dict, model_type: str | None) -> None:
    if model_type in REFUSED:
        raise QMoEUnsupportedError(f"config.json model_type {model_type!r}: {REFUSED[model_type]}; the layer "
                                   "routes by softmax over the experts and top k, so it would compute another "
                                   "function than this model's router"
                                   + (GROUPED_SIGMOID_HINT if model_type in GROUPED_SIGMOID else ""))
    for key, ok in ROUTING.items():
        v = cfg.get(key)
        if v is not None and v not in ok:
            raise QMoEUnsupportedError(f"config.json {key} = {v!r}: the layer routes by softmax over the experts and "
                                       f"top k ({key} {' or '.join(repr(o) for o in ok if o is not None)}), so it "
                                       "would compute another function than this model's router"
                                       + (GROUPED_SIGMOID_HINT if key != "topk_method" else ""))


def moe_config(cfg: dict, *, where: str = "config.json") -> MoeConfig:
    """The MoE routing of the model whose parsed ``config.json`` is ``cfg`` (module docstring). Raises
    ``QMoEInputError`` naming a missing or malformed field, ``QMoEUnsupportedError`` for a router the
    contract does not compute."""
    if not isinstance(cfg, dict):
        raise QMoEInputError(where, "a JSON object", type(cfg).__name__)
    if not cfg:
        raise QMoEInputError(where, "the model's config (model_type, the expert count, num_experts_per_tok, ...) "
                             "beside the checkpoint", "missing or empty")
    model_type = cfg.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise QMoEInputError("config.json model_type", "a string", repr(model_type))
    _check_routing(cfg, model_type)
    E = _int_field(cfg, EXPERT_KEYS, "routed expert count")
    k = _int_field(cfg, K_KEYS, "experts per token")
    if k > E:
        raise QMoEInputError(f"config.json {next(key for key in K_KEYS if key in cfg)}", f"at most the {E} experts",
                             str(k))
    if model_type in ALWAYS_NORMALISED:
        normalize = 1
    else:
        v = cfg.get("norm_topk_prob")
        if not isinstance(v, bool):
            known = "" if model_type in NORM_TOPK_PROB else f" (model_type {model_type!r} is not one this loader knows)"
            raise QMoEInputError("config.json norm_topk_prob", "true or false: whether the router renormalises its "
                                 f"top k weights{known}", "missing" if v is None else repr(v))
        normalize = int(v)
    return MoeConfig(E=E, k=k, normalize=normalize, model_type=model_type)
