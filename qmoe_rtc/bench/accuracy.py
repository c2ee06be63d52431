"""How much FP8 activations [ext] cost in accuracy, against the float64 reference; GPU-free.

    python -m qmoe_rtc bench accuracy --preset qwen3-30b-a3b,mixtral-8x7b,gpt-oss-120b,ort-2048 --tokens 16

For each bench shape: a random layer of int4 experts (the shape's block size, swiglu with gate and linear halves
[g | l]; E reduced to k, so every token routes to every expert: a route's error depends on H, I and the data, not on
E), bfloat16 input rows from a standard normal (``--input outliers``: 1 % of the channels, the same in every row,
30 times larger, as real models' activations have), softmax routing from random logits. Every expert is dequantized once
(float32, the format's own dequantization) and each route computed in float64 four ways:

- ``reference``: the contract's float64 layer (activations as given);
- ``a16``: FC2's input rounded to bfloat16, as the W4A16 tensor-core engines do;
- ``fp8-row``: both GEMMs' inputs rounded to e4m3fn with a scale a row (``activation_quant_group=0``);
- ``fp8-g128``: the same with a scale per 128 values along K (DeepSeek's groups).

Printed per shape and form: ‖out − ref‖₂ / ‖ref‖₂ (the contract's accuracy measure: 1e-2 in bfloat16) and
max |out − ref| / max |ref|, both before the output's final rounding to the activation dtype.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

__all__ = ["FORMS", "errors_of", "main"]

FORMS = ("a16", "fp8-row", "fp8-g128")
DEFAULT_PRESETS = "qwen3-30b-a3b,mixtral-8x7b,gpt-oss-120b,ort-2048"


def _forms(v: np.ndarray) -> dict[str, np.ndarray]:
    """A GEMM input ``v`` [n, K] float64 as each form multiplies it (the reference's: ``v``)."""
    import ml_dtypes

    from ..formats.activations import fake_quantize

    return {"reference": v, "a16": v.astype(ml_dtypes.bfloat16).astype(np.float64),
            "fp8-row": fake_quantize(v, 0), "fp8-g128": fake_quantize(v, 128)}


def errors_of(weights: dict, attrs: dict, x: np.ndarray, logits: np.ndarray) -> dict[str, tuple[float, float]]:
    """{form: (relative L2 error, max error over max |ref|)} of one layer's output on rows ``x`` [rows, H]."""
    from ..contract import QMoEAttributes, describe_layer
    from ..contract import reference as ref

    a = QMoEAttributes.from_kwargs(**attrs)
    layer = describe_layer(weights, a)
    x64 = np.asarray(x).astype(np.float64)
    experts, route_w = ref.route(logits, a)  # [rows, k]
    out = {f: np.zeros_like(x64) for f in ("reference", *FORMS)}
    for e in np.unique(experts):
        r, j = np.nonzero(experts == e)
        w1, w2 = (ref._dequantized(weights, p, a, int(e)) for p in (layer.fc1, layer.fc2))  # [F·I, H], [H, I]
        xin = _forms(x64[r])
        for f in out:
            x_f = x64[r] if f == "a16" else xin[f]  # a16: only FC2's input is rounded
            act = ref.activate(x_f @ w1.T, a, layer.F)  # [n, I]
            a_f = act if f == "reference" else _forms(act)[f]
            np.add.at(out[f], r, route_w[r, j][:, None] * (a_f @ w2.T))
    want = out["reference"]
    scale, peak = np.linalg.norm(want), np.abs(want).max()
    return {f: (float(np.linalg.norm(out[f] - want) / scale), float(np.abs(out[f] - want).max() / peak))
            for f in FORMS}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m qmoe_rtc bench accuracy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default=DEFAULT_PRESETS, help=f"comma list of bench shapes (default {DEFAULT_PRESETS})")
    p.add_argument("--tokens", type=int, default=16, help="input rows (default 16)")
    p.add_argument("--input", choices=("normal", "outliers"), default="normal",
                   help="input rows: a standard normal, or with 1%% of the channels 30 times larger")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from ..contract.random_layer import random_inputs, random_layer
    from .report import BENCH_SHAPES

    names = [n.strip() for n in args.preset.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCH_SHAPES]
    if unknown:
        print(f"unknown bench shape(s) {unknown}: expected names from {sorted(BENCH_SHAPES)}", file=sys.stderr)
        return 2
    print(f"# errors against the float64 reference, {args.tokens} bfloat16 rows ({args.input}), int4 experts, "
          f"seed {args.seed}")
    print("| shape | H | I | block | " + " | ".join(f"{f} L2 / max" for f in FORMS) + " |")
    print("|---|---:|---:|---:|" + "---|" * len(FORMS))
    for name in names:
        s = BENCH_SHAPES[name]
        rng = np.random.default_rng(args.seed)
        w, a = random_layer(rng, E=s.k, H=s.H, I=s.I, k=s.k, bits=4, block_size=s.block_size, dtype="bfloat16",
                            activation_type="swiglu", swiglu_fusion=2)
        x, logits, _ = random_inputs(rng, args.tokens, s.H, s.k, dtype="bfloat16")
        if args.input == "outliers":
            loud = rng.choice(s.H, max(1, s.H // 100), replace=False)
            x[:, loud] = (x[:, loud].astype(np.float32) * 30).astype(x.dtype)
        errs = errors_of(w, a, x, logits)
        cells = " | ".join(f"{errs[f][0]:.2e} / {errs[f][1]:.2e}" for f in FORMS)
        print(f"| {name} | {s.H} | {s.I} | {s.block_size} | {cells} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
