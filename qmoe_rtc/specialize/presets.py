"""MoE layer shapes of well-known models (warm tool, benchmarks).

A :class:`Preset` is shapes + routing + the model's natural activation, with int4 and a block size of
128 (32 for gpt-oss, whose 2880 is no multiple of 128) as the default quantization; choices (weight
format, bits, block size, zero points, dtype) are given when building a
:class:`~qmoe_rtc.specialize.ModelConfig` with :meth:`Preset.config`.

[ext] ``shared`` shared experts (the routed layout and intermediate size), ``shared_gate`` (their sum
scaled by sigmoid(x·g), Qwen-style) and ``router_gemm`` (the layer computes its logits from
``router_weight``, in the activation dtype unless told otherwise): docs/contract.md, "Shared experts"
and "Router GEMM"; ``scoring_func`` / ``n_group``: grouped sigmoid routing (DeepSeek-V3's: docs/contract.md,
"Grouped sigmoid routing"), which needs its own routing module, so warming for such a model names it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import QMoEAttributeError
from ..formats.axis import INT, weight_format

__all__ = ["Preset", "PRESETS", "get_preset"]


@dataclass(frozen=True)
class Preset:
    name: str
    hidden: int
    inter: int
    experts: int
    k: int
    activation: str
    swiglu_fusion: int = 0
    has_fc3: bool = False
    block_size: int = 0
    bits: int = 4
    use_sparse_mixer: bool = False
    normalize_routing_weights: bool = True
    note: str = ""
    shared: int = 0  #: [ext] shared experts (intermediate size ``inter``)
    shared_gate: bool = False  #: [ext] the shared sum is scaled by sigmoid(x·shared_gate_weight)
    router_gemm: bool = False  #: [ext] the layer computes its logits (router_weight [E, H])
    scoring_func: str = "softmax"  #: [ext] 'sigmoid': grouped sigmoid routing
    n_group: int = 0  #: [ext] its expert groups (0: none)

    def config(self, *, bits: int | None = None, fc1_bits: int | None = None, fc2_bits: int | None = None,
               fc3_bits: int | None = None, block_size: int | None = None, zero_points: str = "none",
               dtype: str = "float16", scale_dtype: str = "", activation: str | None = None,
               swiglu_fusion: int | None = None, has_fc3: bool | None = None, format: str = "int",
               shared: int | None = None, shared_gate: bool | None = None, router_gemm: str | None = None,
               scoring_func: str | None = None, n_group: int | None = None, expert_counts: bool = False):
        """A ModelConfig for this preset; unspecified choices take the preset's defaults.

        ``router_gemm``: router_weight's dtype, '' for none (default: ``dtype`` when the preset has a
        router GEMM). ``format`` (:mod:`qmoe_rtc.formats`): 'int' (b-bit codes, ``bits`` and ``zero_points``
        apply), or a float format, which fixes the code width of every projection and has no zero points
        (``bits`` and ``zero_points`` do not apply): 'fp8_e4m3' (e4m3fn codes, float32 scales unless
        ``scale_dtype`` says otherwise, block size 0 = one global scale per expert, the preset's shared experts
        FP8 too, no FC3), 'mxfp4' / 'nvfp4' (e2m1 codes, float32 scales in blocks of 32 / 16; NVFP4 has no FC3).
        ``scoring_func`` / ``n_group`` (default: the preset's routing) and ``expert_counts`` (expert statistics
        [ext]) choose the routing module.
        """
        from . import Layout, ModelConfig

        fmt = weight_format(format)
        fixed = fmt is not INT  # a float format fixes the width, the zero points (and an FP4 one the block)
        b = fmt.bits[0] if fixed else self.bits if bits is None else bits
        act = self.activation if activation is None else activation
        fusion = self.swiglu_fusion if swiglu_fusion is None else swiglu_fusion
        fc3 = self.has_fc3 if has_fc3 is None else has_fc3
        if activation is not None and swiglu_fusion is None and has_fc3 is None and act != self.activation:
            # switching e.g. mixtral silu+fc3 -> swiglu: use fused FC1 [g | l] unless told otherwise
            gated = act in ("swiglu", "geglu")
            fusion = 2 if gated else 0
            fc3 = False if gated else self.has_fc3
        if fixed:
            if fc3 and fmt.scale.global_scale:  # FP8 and NVFP4: no FC3 global scale input
                raise QMoEAttributeError("has_fc3", f"False with {fmt.name} experts (there is no FC3 global scale "
                                         "input; a gated layer takes activation='swiglu', fused FC1)", "True")
            fc1_bits = fc2_bits = fc3_bits = None
            zero_points, scale_dtype = "none", fmt.scale.device or scale_dtype or "float32"
            block_size = fmt.scale.block or block_size
        layout = Layout(
            dtype=dtype, scale_dtype=scale_dtype,
            fc1_bits=b if fc1_bits is None else fc1_bits,
            fc2_bits=b if fc2_bits is None else fc2_bits,
            fc3_bits=((b if fc3_bits is None else fc3_bits) if fc3 else 0),
            block_size=self.block_size if block_size is None else block_size,
            fc1_zp=zero_points, fc2_zp=zero_points, fc3_zp=zero_points if fc3 else "none",
            fc1_format=fmt.name, fc2_format=fmt.name, fc3_format=fmt.name if fc3 else "int",
            activation=act, swiglu_fusion=fusion, has_fc3=fc3,
        )
        S = self.shared if shared is None else shared  # FP8 layers have FP8 shared experts
        gate = bool(S) and (self.shared_gate if shared_gate is None else shared_gate)
        router = (dtype if self.router_gemm else "") if router_gemm is None else router_gemm
        return ModelConfig(hidden=self.hidden, inter=self.inter, experts=self.experts, k=self.k, layout=layout,
                           use_sparse_mixer=self.use_sparse_mixer,
                           normalize_routing_weights=self.normalize_routing_weights, name=self.name,
                           shared=S, shared_gate=gate, router_gemm=router,
                           scoring_func=self.scoring_func if scoring_func is None else scoring_func,
                           n_group=self.n_group if n_group is None else n_group, expert_counts=expert_counts)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("qwen3-30b-a3b", 2048, 768, 128, 8, "swiglu", swiglu_fusion=1, block_size=128),
        Preset("mixtral-8x7b", 4096, 14336, 8, 2, "silu", has_fc3=True, block_size=128,
               note="w1/w3 as FC1/FC3 (silu-gated); --activation swiglu gives the fused-FC1 form"),
        Preset("gpt-oss-20b", 2880, 2880, 32, 4, "swiglu", swiglu_fusion=1, block_size=32),
        Preset("gpt-oss-120b", 2880, 2880, 128, 4, "swiglu", swiglu_fusion=1, block_size=32),
        Preset("deepseek-v3", 7168, 2048, 256, 8, "swiglu", swiglu_fusion=1, block_size=128, scoring_func="sigmoid",
               n_group=8, note="grouped sigmoid routing (8 groups), as the model"),
        Preset("phi-3.5-moe", 4096, 6400, 16, 2, "silu", has_fc3=True, use_sparse_mixer=True, block_size=128,
               normalize_routing_weights=False, note="sparse mixer routing"),
        Preset("qwen3-next-80b-a3b", 2048, 512, 512, 10, "swiglu", swiglu_fusion=1, block_size=128,
               shared=1, shared_gate=True, router_gemm=True,
               note="one shared expert (I 512) with a sigmoid gate; router GEMM in the layer"),
        Preset("deepseek-v3-tp8", 7168, 256, 256, 8, "swiglu", swiglu_fusion=1, block_size=128,
               shared=1, router_gemm=True, scoring_func="sigmoid", n_group=8,
               note="DeepSeek-V3 at tensor parallel 8 (I 2048/8); one shared expert, no gate; router GEMM in the "
                    "layer; grouped sigmoid routing (8 groups), as the model (the benchmark's shape of this name "
                    "routes by softmax top-k)"),
    )
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise QMoEAttributeError("preset", f"one of {sorted(PRESETS)}", repr(name)) from None
