"""MoE layer shapes of well-known models (warm tool, benchmarks).

A :class:`Preset` is shapes + routing + the model's natural activation, with int4 and a block size of
128 (32 for gpt-oss, whose 2880 is no multiple of 128) as the default quantization; choices (bits,
block size, zero points, dtype) are given when building a :class:`~qmoe_rtc.specialize.ModelConfig`
with :meth:`Preset.config`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import QMoEAttributeError

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

    def config(self, *, bits: int | None = None, fc1_bits: int | None = None, fc2_bits: int | None = None,
               fc3_bits: int | None = None, block_size: int | None = None, zero_points: str = "none",
               dtype: str = "float16", scale_dtype: str = "", activation: str | None = None,
               swiglu_fusion: int | None = None, has_fc3: bool | None = None):
        """A ModelConfig for this preset; unspecified choices take the preset's defaults."""
        from .specialize import Layout, ModelConfig

        b = self.bits if bits is None else bits
        act = self.activation if activation is None else activation
        fusion = self.swiglu_fusion if swiglu_fusion is None else swiglu_fusion
        fc3 = self.has_fc3 if has_fc3 is None else has_fc3
        if activation is not None and swiglu_fusion is None and has_fc3 is None and act != self.activation:
            # switching e.g. mixtral silu+fc3 -> swiglu: use fused FC1 [g | l] unless told otherwise
            gated = act in ("swiglu", "geglu")
            fusion = 2 if gated else 0
            fc3 = False if gated else self.has_fc3
        layout = Layout(
            dtype=dtype, scale_dtype=scale_dtype,
            fc1_bits=b if fc1_bits is None else fc1_bits,
            fc2_bits=b if fc2_bits is None else fc2_bits,
            fc3_bits=((b if fc3_bits is None else fc3_bits) if fc3 else 0),
            block_size=self.block_size if block_size is None else block_size,
            fc1_zp=zero_points, fc2_zp=zero_points, fc3_zp=zero_points if fc3 else "none",
            activation=act, swiglu_fusion=fusion, has_fc3=fc3,
        )
        return ModelConfig(hidden=self.hidden, inter=self.inter, experts=self.experts, k=self.k, layout=layout,
                           use_sparse_mixer=self.use_sparse_mixer,
                           normalize_routing_weights=self.normalize_routing_weights, name=self.name)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("qwen3-30b-a3b", 2048, 768, 128, 8, "swiglu", swiglu_fusion=1, block_size=128),
        Preset("mixtral-8x7b", 4096, 14336, 8, 2, "silu", has_fc3=True, block_size=128,
               note="w1/w3 as FC1/FC3 (silu-gated); --activation swiglu gives the fused-FC1 form"),
        Preset("gpt-oss-20b", 2880, 2880, 32, 4, "swiglu", swiglu_fusion=1, block_size=32),
        Preset("gpt-oss-120b", 2880, 2880, 128, 4, "swiglu", swiglu_fusion=1, block_size=32),
        Preset("deepseek-v3", 7168, 2048, 256, 8, "swiglu", swiglu_fusion=1, block_size=128),
        Preset("phi-3.5-moe", 4096, 6400, 16, 2, "silu", has_fc3=True, use_sparse_mixer=True, block_size=128,
               normalize_routing_weights=False, note="sparse mixer routing"),
    )
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise QMoEAttributeError("preset", f"one of {sorted(PRESETS)}", repr(name)) from None
