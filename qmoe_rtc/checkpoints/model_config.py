"""What a model's ``config.json`` says about its MoE layers, by ``model_type``: the expert count, the
experts per token k, how the router scores, chooses and weighs its experts, and how many shared experts
and leading dense layers there are. Nothing is guessed: a field the model's routing needs and the file
lacks is a ``QMoEInputError`` naming it, and a router the contract does not compute is a
``QMoEUnsupportedError`` naming the model type or the setting. Multimodal configs (``glm4v_moe``,
``qwen3_vl_moe``) keep the text model's fields in ``text_config``: they are read there.

Per model type (the models' own routers, as transformers runs them; ``kimi_k2`` as the DeepSeek-V3 code
shipped with the model runs it)::

    mixtral                     softmax, top k, always renormalised (no ``norm_topk_prob`` in its config)
    gpt_oss                     softmax over the top k logits = softmax, top k, renormalised
    qwen2_moe, qwen3_moe,       softmax, top k, renormalised exactly when ``norm_topk_prob`` (required)
    qwen3_next, qwen3_vl_moe,
    olmoe
    deepseek_v2                 as above where ``topk_method`` is greedy, ``scoring_func`` softmax and
                                ``routed_scaling_factor`` 1 (DeepSeek-V2-Lite); else refused
                                (``group_limited_greedy`` scores a group by its best softmax probability,
                                not the contract's sum of two best biased sigmoid scores)
    deepseek_v3, glm4_moe,      the contract's grouped sigmoid routing [ext] (``noaux_tc``): sigmoid scores,
    glm4v_moe, dots1, kimi_k2   experts chosen by score + ``e_score_correction_bias`` (the layer's
                                ``router_score_bias``) inside the ``topk_group`` of ``n_group`` groups whose
                                two best biased scores sum highest, weighed by their unbiased scores,
                                divided by their sum when ``norm_topk_prob`` (kimi_k2: and k > 1), then
                                multiplied by ``routed_scaling_factor``. ``n_group``, ``topk_group``,
                                ``routed_scaling_factor`` and ``norm_topk_prob`` are required;
                                ``scoring_func`` / ``topk_method``, where present, must say sigmoid / noaux_tc
    phimoe                      Phi-3.5-MoE's sparse mixer (per-choice masked softmax): refused
    llama4                      a sigmoid of the top-1 logit: refused

Two differences from the models' code, neither reachable with their weights in practice: (1) transformers
divides by ``sum + 1e-20``; in float32 that sum is unchanged by 1e-20 unless it is below ~1.7e-13 (all k
chosen logits below about −29), and a zero sum gives zero weights both ways. (2) transformers fills the
dropped groups' choice scores with 0.0 where the contract (and DeepSeek-V3's own inference code) leaves them
out: the choice differs only when fewer than k experts of the kept groups have a positive biased score
(a bias below −sigmoid(logit)); with one group (GLM-4.5, Kimi-K2) nothing is dropped.

A config without a known ``model_type`` is read by its fields alone: ``norm_topk_prob`` and
``num_experts_per_tok`` are then required, and its router must be softmax top-k.
"""

from __future__ import annotations

import math
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
#: model types whose routing fields transformers keeps in ``text_config``
TEXT_CONFIG = frozenset({"glm4v_moe", "qwen3_vl_moe"})
#: model types whose router is DeepSeek-V3's ``noaux_tc``: the contract's grouped sigmoid routing [ext]
GROUPED_SIGMOID = {
    "deepseek_v3": "DeepSeek-V3 (transformers' DeepseekV3TopkRouter)",
    "kimi_k2": "Kimi-K2 (the MoEGate of DeepSeek-V3's modeling_deepseek.py, shipped with the model)",
    "glm4_moe": "GLM-4.5 (transformers' Glm4MoeTopkRouter, DeepSeek-V3's)",
    "glm4v_moe": "GLM-4.5V (transformers' Glm4vMoe text router, DeepSeek-V3's)",
    "dots1": "dots.llm1 (transformers' Dots1TopkRouter, DeepSeek-V3's)",
}
#: of those, the model types whose router renormalises only when k > 1 (``top_k > 1 and norm_topk_prob``)
NORM_ABOVE_ONE = frozenset({"kimi_k2"})
#: model types whose routing the contract cannot express, with the reason
REFUSED = {
    "phimoe": "Phi-3.5-MoE routes by its sparse mixer (a masked softmax per choice), not softmax top-k",
    "llama4": "Llama 4 routes by a sigmoid of the top-1 logit",
}
#: settings of the softmax routing, by key: another value routes otherwise (refused for the softmax model types)
ROUTING = {"scoring_func": ("softmax",), "topk_method": ("greedy",), "n_group": (None, 1), "topk_group": (None, 1),
           "routed_scaling_factor": (None, 1, 1.0)}
#: why a softmax model type's setting is refused, by key (the default reason: another router than softmax top-k)
ROUTING_WHY = {
    "topk_method": "DeepSeek-V2's group_limited_greedy keeps the topk_group groups whose best softmax probability is "
                   "largest, while the contract's grouped routing [ext] scores a group by the sum of its two best "
                   "biased sigmoid scores",
    "routed_scaling_factor": "the GPU routing scales sigmoid-scored weights only (and DeepSeek-V2's own code scales "
                             "softmax weights only where it does not renormalise them)",
}


@dataclass(frozen=True)
class MoeConfig:
    """A model's MoE routing as the contract's attributes: ``E`` routed experts, ``k`` per token,
    ``normalize`` (``normalize_routing_weights``), ``model_type`` as config.json names it (or None); the
    grouped sigmoid routing [ext] (``scoring_func`` 'sigmoid', ``n_group``, ``topk_group``,
    ``routed_scaling_factor``, and ``score_bias``: the router has an ``e_score_correction_bias``);
    ``shared`` config.json's ``n_shared_experts`` and ``first_dense`` its ``first_k_dense_replace`` (None
    where absent)."""

    E: int
    k: int
    normalize: int
    model_type: str | None
    scoring_func: str = "softmax"
    n_group: int = 0
    topk_group: int = 0
    routed_scaling_factor: float = 1.0
    score_bias: bool = False
    shared: int | None = None
    first_dense: int | None = None

    @property
    def routing(self) -> dict:
        """The grouped sigmoid routing attributes [ext] of the layer ({} for softmax routing)."""
        if self.scoring_func == "softmax":
            return {}
        return dict(scoring_func=self.scoring_func, n_group=self.n_group, topk_group=self.topk_group,
                    routed_scaling_factor=self.routed_scaling_factor)


class _Fields:
    """config.json's routing fields (``text_config``'s for the multimodal model types), named in errors as
    ``config.json key`` / ``config.json text_config.key``."""

    def __init__(self, cfg: dict, model_type: str | None):
        text = cfg.get("text_config")
        self.nested = model_type in TEXT_CONFIG and isinstance(text, dict)
        self.cfg = text if self.nested else cfg
        self.prefix = "config.json text_config." if self.nested else "config.json "

    def get(self, key: str):
        return self.cfg.get(key)

    def name(self, key: str) -> str:
        return self.prefix + key

    def count(self, keys: tuple, what: str, least: int = 1) -> int:
        """The one integer ≥ ``least`` that the present keys of ``keys`` hold (an error naming the first key
        when none is there, or a key whose value is not such an integer, or two keys that disagree)."""
        found = {k: self.cfg[k] for k in keys if self.cfg.get(k) is not None}
        if not found:
            raise QMoEInputError(self.name(keys[0]), f"the {what} (one of {', '.join(keys)})" if len(keys) > 1 else
                                 f"the {what}", "missing")
        values = set()
        for key, v in found.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise QMoEInputError(self.name(key), f"an integer ≥ {least} ({what})", repr(v))
            values.add(v)
        if len(values) > 1:
            raise QMoEInputError(self.prefix + "/".join(found), f"one {what}", f"{found}")
        return values.pop()

    def optional_count(self, key: str, what: str) -> int | None:
        return None if self.cfg.get(key) is None else self.count((key,), what, least=0)

    def flag(self, key: str, what: str, known: str = "") -> bool:
        v = self.cfg.get(key)
        if not isinstance(v, bool):
            raise QMoEInputError(self.name(key), f"true or false: {what}{known}", "missing" if v is None else repr(v))
        return v


def _check_softmax_routing(f: _Fields, model_type: str | None) -> None:
    if model_type in REFUSED:
        raise QMoEUnsupportedError(f"config.json model_type {model_type!r}: {REFUSED[model_type]}; the layer "
                                   "would compute another function than this model's router")
    for key, ok in ROUTING.items():
        v = f.get(key)
        if v is not None and v not in ok:
            known = ", ".join(GROUPED_SIGMOID)
            raise QMoEUnsupportedError(
                f"{f.name(key)} = {v!r}: the layer routes model type {model_type!r} by softmax over the experts and "
                f"top k ({key} {' or '.join(repr(o) for o in ok if o is not None)}), so it would compute another "
                f"function than this model's router; {ROUTING_WHY.get(key, 'the grouped sigmoid routing [ext] is read')}"
                f" (grouped sigmoid routing is read for the model types whose router code it follows: {known})")


def _grouped(f: _Fields, model_type: str, E: int, k: int) -> dict:
    """The grouped sigmoid routing [ext] of a DeepSeek-V3-style router (module docstring): every field is
    required, and each is checked against the others as the contract checks its attributes."""
    who = GROUPED_SIGMOID[model_type]
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        v = f.get(key)
        if v is not None and v != want:
            raise QMoEUnsupportedError(f"{f.name(key)} = {v!r} with model_type {model_type!r}: {who} routes by "
                                       f"{key} {want!r} (sigmoid scores, a correction bias, grouped top-k); another "
                                       "router is not this model type's")
    G = f.count(("n_group",), "number of expert groups")
    g = f.count(("topk_group",), "number of groups each token keeps")
    if g > G:
        raise QMoEInputError(f.name("topk_group"), f"at most n_group = {G}", str(g))
    if E % G or (G > 1 and E // G < 2):
        raise QMoEInputError(f.name("n_group"), f"a divisor of the {E} experts leaving at least 2 per group (the "
                             "router sums each group's two best scores)", str(G))
    if k > g * (E // G):
        raise QMoEInputError(f.name("num_experts_per_tok"), f"at most the {g * (E // G)} experts of the topk_group = "
                             f"{g} groups kept (of {E // G} experts each)", str(k))
    rsf = f.get("routed_scaling_factor")
    if rsf is None or isinstance(rsf, bool) or not isinstance(rsf, (int, float)) or not math.isfinite(rsf) or rsf <= 0:
        raise QMoEInputError(f.name("routed_scaling_factor"), "a finite number > 0 (the routing weights' factor)",
                             "missing" if rsf is None else repr(rsf))
    norm = f.flag("norm_topk_prob", "whether the router renormalises its top k weights")
    return dict(scoring_func="sigmoid", n_group=G, topk_group=g, routed_scaling_factor=float(rsf),
                normalize=int(norm and (k > 1 or model_type not in NORM_ABOVE_ONE)), score_bias=True)


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
    f = _Fields(cfg, model_type)
    if model_type in TEXT_CONFIG and not f.nested and not any(f.get(key) is not None for key in EXPERT_KEYS):
        raise QMoEInputError("config.json text_config", f"the text model's config (model_type {model_type!r} keeps "
                             "the expert count, k and the routing there)", "missing")
    grouped = model_type in GROUPED_SIGMOID
    if not grouped:
        _check_softmax_routing(f, model_type)
    E = f.count(EXPERT_KEYS, "routed expert count")
    k = f.count(K_KEYS, "experts per token")
    if k > E:
        raise QMoEInputError(f.name(next(key for key in K_KEYS if f.get(key) is not None)),
                             f"at most the {E} experts", str(k))
    extra = dict(shared=f.optional_count("n_shared_experts", "number of shared experts"),
                 first_dense=f.optional_count("first_k_dense_replace", "number of leading dense layers"))
    if grouped:
        return MoeConfig(E=E, k=k, model_type=model_type, **_grouped(f, model_type, E, k), **extra)
    if model_type in ALWAYS_NORMALISED:
        normalize = 1
    else:
        known = "" if model_type in NORM_TOPK_PROB else f" (model_type {model_type!r} is not one this loader knows)"
        normalize = int(f.flag("norm_topk_prob", "whether the router renormalises its top k weights", known))
    return MoeConfig(E=E, k=k, normalize=normalize, model_type=model_type, **extra)
