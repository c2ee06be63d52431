"""Where a layer's MoE tensors are in a checkpoint: the names the public tools write, found from the
tensor names themselves (``{root}`` the decoder's layer list, ``{L}`` the layer, ``{e}`` an expert)::

    {root}.{L}.{block}.experts.{e}.{gate}/{up}/{down}.<tensor>   per-expert projections
        root   model.layers, model.language_model.layers, language_model.model.layers, …
        block  block_sparse_moe (Mixtral, Phi-3.5-MoE; llm-compressor keeps it), mlp (Qwen2/3-MoE,
               Qwen3-Next, OLMoE, DeepSeek, and Mixtral as transformers 5 names it), moe, feed_forward
        names  w1 / w3 / w2 (Mixtral as transformers 4 saved it) or gate_proj / up_proj / down_proj
    {root}.{L}.{block}.gate.weight or .router.weight              the router's linear [E, H]
    {root}.{L}.{block}.shared_expert / shared_experts             a shared MLP (Qwen2-MoE / Qwen3-Next,
                                                                  DeepSeek), with the same names
    {root}.{L}.{block}.shared_expert_gate.weight                  its sigmoid gate [1, H]
    {root}.{L}.{block}.gate.e_score_correction_bias               a sigmoid router's score-correction bias [E]
                                                                  (DeepSeek-V3, Kimi-K2, GLM-4.5, dots.llm1)
    {root}.{L}.mlp.experts.gate_up_proj_blocks                    gpt-oss: every expert in one tensor

A layer whose MLP is dense (``{root}.{L}.mlp.gate_proj`` …, no experts: DeepSeek's, GLM-4.5's and
dots.llm1's first ``first_k_dense_replace`` layers) is no MoE layer: :func:`moe_layers` leaves it out and
:func:`find_names` refuses it by name.

``--scheme`` (``scheme=``) picks the projection names where a checkpoint holds both: ``mixtral``
(w1/w3/w2), ``moe_mlp`` (gate_proj/up_proj/down_proj) or ``gpt_oss`` (fused).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import QMoEInputError

__all__ = ["SCHEMES", "MoeNames", "find_names", "moe_layers"]

#: scheme -> the (gate, up, down) projection names; gpt_oss: fused experts (None)
SCHEMES = {"mixtral": ("w1", "w3", "w2"), "moe_mlp": ("gate_proj", "up_proj", "down_proj"), "gpt_oss": None}
_BLOCKS = "block_sparse_moe|mlp|moe|feed_forward"
_PROJ = "w1|w2|w3|gate_proj|up_proj|down_proj"
_EXPERT = re.compile(rf"^(?P<root>(?:[\w.]*\.)?layers)\.(?P<L>\d+)\.(?P<block>{_BLOCKS})\.experts\.(?P<e>\d+)\."
                     rf"(?P<proj>{_PROJ})\.")
_FUSED = re.compile(r"^(?P<root>(?:[\w.]*\.)?layers)\.(?P<L>\d+)\.(?P<block>mlp)\.experts\.gate_up_proj_blocks$")
_DENSE = re.compile(rf"^(?P<root>(?:[\w.]*\.)?layers)\.(?P<L>\d+)\.mlp\.(?P<proj>{_PROJ})\.")


@dataclass(frozen=True)
class MoeNames:
    """One layer's tensor names: ``expert(e, proj)`` the prefix of expert e's projection ``proj`` (0 gate,
    1 up, 2 down); ``block`` the MoE block's prefix (``{root}.{L}.{block}``); ``scheme`` which names."""

    scheme: str
    block: str
    projections: tuple | None  # (gate, up, down) names; None: gpt-oss's fused experts

    def expert(self, e, proj: int) -> str:
        return f"{self.block}.experts.{e}.{self.projections[proj]}"

    @property
    def routers(self) -> tuple:
        """The router's linear, by the names the models use (first present wins)."""
        return f"{self.block}.gate", f"{self.block}.router"

    @property
    def shared(self) -> tuple:
        return f"{self.block}.shared_expert", f"{self.block}.shared_experts"

    @property
    def shared_gate(self) -> str:
        return f"{self.block}.shared_expert_gate"

    @property
    def score_bias(self) -> str:
        """A sigmoid router's score-correction bias [E] (DeepSeek-V3's ``e_score_correction_bias``)."""
        return f"{self.block}.gate.e_score_correction_bias"


def _scheme_of(proj: str) -> str:
    return "mixtral" if proj in SCHEMES["mixtral"] else "moe_mlp"


def _blocks(names, layer: int | None = None) -> dict:
    """{(layer, block prefix, scheme): {expert indices}} of every MoE block the tensor names hold."""
    found: dict = {}
    for n in names:
        if m := _EXPERT.match(n):
            key = (int(m["L"]), f"{m['root']}.{m['L']}.{m['block']}", _scheme_of(m["proj"]))
            found.setdefault(key, set()).add(int(m["e"]))
        elif m := _FUSED.match(n):
            found.setdefault((int(m["L"]), f"{m['root']}.{m['L']}.{m['block']}", "gpt_oss"), set())
    return {k: v for k, v in found.items() if layer is None or k[0] == layer}


def _check_scheme(scheme: str | None) -> None:
    if scheme is not None and scheme not in SCHEMES:
        raise QMoEInputError("scheme", f"one of {', '.join(SCHEMES)} (or none: found from the names)", repr(scheme))


def moe_layers(names, scheme: str | None = None) -> list[int]:
    """The layer indices whose MoE experts the tensor ``names`` hold (of ``scheme`` only, when given)."""
    _check_scheme(scheme)
    return sorted({L for (L, _, s) in _blocks(names) if scheme is None or s == scheme})


def find_names(names, layer: int, scheme: str | None = None, where: str = "checkpoint") -> MoeNames:
    """Layer ``layer``'s MoE tensor names among ``names``. Raises ``QMoEInputError`` when the layer has no
    experts, or holds two kinds of names and ``scheme`` does not pick one."""
    _check_scheme(scheme)
    blocks = [k for k in _blocks(names, layer) if scheme is None or k[2] == scheme]
    if not blocks and (dense := _dense_mlp(names, layer)) is not None:
        moe = moe_layers(names, scheme)
        listed = ", ".join(map(str, moe)) if len(moe) <= 8 else f"{moe[0]}, {moe[1]}, … {moe[-1]}"
        raise QMoEInputError(f"layer {layer}", f"an MoE layer (this checkpoint's: {listed or 'none'})",
                             f"a dense MLP ({dense}.gate_proj …, no experts: a model's first first_k_dense_replace "
                             "layers are dense)")
    if not blocks:
        want = f"{scheme} " if scheme else ""
        raise QMoEInputError(where, f"{want}MoE experts of layer {layer} (e.g. model.layers.{layer}.mlp.experts.0."
                             "gate_proj.*, model.layers.{L}.block_sparse_moe.experts.0.w1.*)", f"none in {where}")
    if len(blocks) > 1:
        raise QMoEInputError(f"layer {layer}", "one MoE block (pass scheme= / --scheme to pick one)",
                             ", ".join(f"{b} ({s})" for _, b, s in sorted(blocks)))
    _, block, s = blocks[0]
    return MoeNames(scheme=s, block=block, projections=SCHEMES[s])


def _dense_mlp(names, layer: int) -> str | None:
    """The prefix ``{root}.{L}.mlp`` of layer ``layer``'s dense MLP among ``names`` (None: it has none)."""
    for n in names:
        if (m := _DENSE.match(n)) and int(m["L"]) == layer:
            return f"{m['root']}.{m['L']}.mlp"
    return None


def expert_indices(names, found: MoeNames) -> set:
    """The expert indices with at least one tensor under ``found``'s per-expert names."""
    return next((v for (_, b, s), v in _blocks(names).items() if b == found.block and s == found.scheme), set())
