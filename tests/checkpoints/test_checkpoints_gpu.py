"""Layers loaded from the public quantizers' own files (tests/data/checkpoints) run right on the GPU:
each loaded layer as QMoE(...) against the float64 reference at 1, 8 and 300 rows (float16 layers from
GPTQModel's float16 scales, bfloat16 from llm-compressor's and AWQ's), outputs poisoned first, graph
replay equal to the eager call bit for bit; and with the router linear inside the layer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from qmoe_rtc.contract.random_layer import random_inputs
from qmoe_rtc.contract.reference import qmoe as reference

from support.gpu_checks import TOL, rel_err

pytest.importorskip("safetensors")
pytestmark = pytest.mark.gpu

DATA = Path(__file__).resolve().parents[1] / "data" / "checkpoints"
REAL = sorted(p for p in DATA.iterdir() if (p / "model.safetensors").is_file())


@pytest.mark.parametrize("path", REAL, ids=[p.name for p in REAL])
def test_loaded_layers_match_the_reference_and_replay_bitwise(rng, path):
    import cupy as cp

    from qmoe_rtc.checkpoints import load_layer
    from qmoe_rtc.executor import QMoE

    layer = load_layer(path, 0)
    w, a = layer.weights, layer.attributes
    dtype = str(w["fc1_scales"].dtype)
    E, H = w["fc1_experts_weights"].shape[0], w["fc2_experts_weights"].shape[1]
    moe = QMoE(**w, **a)
    for rows in (1, 8, 300):
        x, lg, _ = random_inputs(rng, rows, H, E, dtype)
        want = reference(x, lg, **w, **a)
        xd, ld = cp.asarray(x), cp.asarray(lg)
        out = cp.full(x.shape, cp.nan, dtype=xd.dtype)
        got = moe(xd, ld, out=out)
        e = rel_err(cp.asnumpy(got), want)
        assert e <= TOL[dtype], f"{path.name} rows={rows}: rel err {e:.3e} ({moe.plan(rows, dtype).engine})"
        graph_out = cp.full(x.shape, cp.nan, dtype=xd.dtype)
        graph = moe.capture(xd, ld, out=graph_out)
        x2, l2, _ = random_inputs(rng, rows, H, E, dtype)
        xd[...], ld[...] = cp.asarray(x2), cp.asarray(l2)
        graph.replay()
        eager = moe(xd, ld)
        cp.cuda.Device().synchronize()
        assert cp.array_equal(graph_out.view(cp.uint16), eager.view(cp.uint16)), f"{path.name} rows={rows}"
        assert rel_err(cp.asnumpy(eager), reference(x2, l2, **w, **a)) <= TOL[dtype]


@pytest.mark.parametrize("name", ["llmc_mixtral_w4a16_asym_g32", "gptqmodel_qwen3_moe_gptq_b8_g32_sym"])
def test_loaded_layers_with_their_router_inside(rng, name):
    """The checkpoint's router linear as ``router_weight`` (cast to the layer's dtype), logits computed in
    the layer: the same as the reference fed the router's logits."""
    import cupy as cp

    from qmoe_rtc._arrays import np_dtype
    from qmoe_rtc.checkpoints import load_layer
    from qmoe_rtc.executor import QMoE

    layer = load_layer(DATA / name, 0)
    w, a = layer.weights, layer.attributes
    dtype = str(w["fc1_scales"].dtype)
    rw = layer.router_weight.astype(np.float32).astype(np_dtype(dtype))
    moe = QMoE(**w, **a, router_weight=rw)
    H = w["fc2_experts_weights"].shape[1]
    for rows in (1, 300):
        x = random_inputs(rng, rows, H, rw.shape[0], dtype)[0]
        want = reference(x, None, **w, **a, router_weight=rw)
        got = moe(cp.asarray(x), None)
        assert rel_err(cp.asnumpy(got), want) <= TOL[dtype], f"{name} rows={rows}"


def _run_loaded(rng, layer, dtype, label):
    """``layer`` as QMoE(...) at 1, 8 and 300 rows of ``dtype``: the reference with the output poisoned
    first, and a graph replay equal to an eager call bit for bit."""
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    w, a = layer.weights, layer.attributes
    E, H = w["fc1_experts_weights"].shape[0], w["fc2_experts_weights"].shape[1]
    moe = QMoE(**w, **a)
    for rows in (1, 8, 300):
        x, lg, _ = random_inputs(rng, rows, H, E, dtype)
        xd, ld = cp.asarray(x), cp.asarray(lg)
        got = moe(xd, ld, out=cp.full(x.shape, cp.nan, dtype=xd.dtype))
        e = rel_err(cp.asnumpy(got), reference(x, lg, **w, **a))
        assert e <= TOL[dtype], f"{label} {dtype} rows={rows}: rel err {e:.3e} ({moe.plan(rows, dtype).engine})"
        graph = moe.capture(xd, ld, out=cp.full(x.shape, cp.nan, dtype=xd.dtype))
        graph.replay()
        eager = moe(xd, ld)
        cp.cuda.Device().synchronize()
        assert cp.array_equal(graph.output.view(cp.uint16), eager.view(cp.uint16)), f"{label} {dtype} rows={rows}"


@pytest.mark.parametrize("fmt, dtype", [("fp8-float32", "bfloat16"), ("fp8-e8m0", "bfloat16"), ("nvfp4", "float16"),
                                        ("nvfp4", "bfloat16"), ("nvfp4-shared", "bfloat16")])
def test_fp8_and_nvfp4_checkpoints_run_as_loaded(tmp_path, rng, fmt, dtype):
    """FP8 block checkpoints (float32 and e8m0 block scales) and ModelOpt NVFP4 ones, written with each
    format's own storage (tests/test_checkpoints*.py), loaded and run on both paths (FP8 in bfloat16: its
    random e4m3 codes up to 448 overflow float16's outputs)."""
    from test_checkpoints import _write_fp8
    from test_checkpoints_fp4 import _write_nvfp4

    from qmoe_rtc.checkpoints import load_layer

    if fmt.startswith("fp8"):
        _write_fp8(tmp_path, rng, scales=fmt.split("-")[1])
    else:
        _write_nvfp4(tmp_path, rng, shared=2 if fmt.endswith("shared") else 0)
    _run_loaded(rng, load_layer(tmp_path, 1), dtype, fmt)


def test_gpt_oss_mxfp4_checkpoints_run_as_loaded(tmp_path, rng):
    """gpt-oss's fused MXFP4 experts with bfloat16 biases, loaded and run on every path."""
    import ml_dtypes
    from test_checkpoints_fp4 import _write_gpt_oss

    from qmoe_rtc.checkpoints import load_layer

    _write_gpt_oss(tmp_path, rng, dtype=ml_dtypes.bfloat16)
    _run_loaded(rng, load_layer(tmp_path, 2), "bfloat16", "gpt-oss")
