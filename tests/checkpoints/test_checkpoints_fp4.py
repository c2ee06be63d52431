"""FP4 checkpoint loading (CPU): tiny gpt-oss MXFP4 and ModelOpt NVFP4 checkpoints written here in each
format's own storage (tensor names, dtypes, shapes, nibble order), loaded into the contract's MXFP4 /
NVFP4 experts, and checked against this file's own float64 decode of the checkpoint tensors (e2m1
table, e8m0 by ldexp, e4m3 through ml_dtypes) and, for gpt-oss, against a float64 gpt-oss MoE forward
written from the model's definition. The refusals name the tensor or the setting."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from qmoe_rtc.checkpoints import load_layer, moe_layers
from qmoe_rtc.contract import QMoEAttributes, describe_layer
from qmoe_rtc.contract.reference import qmoe as reference
from qmoe_rtc.errors import QMoEInputError, QMoEUnsupportedError
from qmoe_rtc.formats.fp4 import dequantize_fp4

#: every test writes a checkpoint: safetensors (the [test] / [checkpoints] extra) or skip
save_file = pytest.importorskip("safetensors.numpy").save_file

E, H, I = 4, 64, 32
EG = 8  # gpt-oss's routed experts: k = 4 of 8, so the top-k softmax differs from the softmax over all
#: e2m1 magnitudes by the code's low three bits; bit 3 is the sign
LUT = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _e2m1(codes: np.ndarray) -> np.ndarray:
    return np.where(codes & 8, -1.0, 1.0) * LUT[codes & 7]


def _pack(codes: np.ndarray) -> np.ndarray:
    """uint8 [..., K/2]: element 2i in the low nibble of byte i, 2i + 1 in the high nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def _save(tmp_path, tensors: dict, cfg: dict, extra=None, drop=()) -> None:
    tensors.update(extra or {})
    save_file({n: a for n, a in tensors.items() if n not in drop}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))


# --------------------------------------------------------------------------------------------- gpt-oss

def _mxfp4(rng, N, K):
    """(blocks [E, N, K/32, 16] u8, scales [E, N, K/32] u8, float64 [E, N, K]), E = EG."""
    codes = rng.integers(0, 16, size=(EG, N, K)).astype(np.uint8)
    scales = rng.integers(121, 126, size=(EG, N, K // 32)).astype(np.uint8)
    dense = _e2m1(codes) * np.repeat(np.ldexp(1.0, scales.astype(np.int64) - 127), 32, axis=-1)
    return _pack(codes).reshape(EG, N, K // 32, 16), scales, dense


def _write_gpt_oss(tmp_path, rng, layers=(0, 2), dtype=np.float32, scale_dtype=np.uint8, extra=None, drop=(),
                   quant=None):
    """A gpt-oss MXFP4 checkpoint of ``layers``; the float64 decode of the last one (w1 [E, 2I, H], b1, w2, b2,
    router weight and bias)."""
    tensors = {}
    for L in layers:
        p = f"model.layers.{L}.mlp"
        b1, s1, w1 = _mxfp4(rng, 2 * I, H)  # rows 0, 2, 4 …: gate (glu); 1, 3, 5 …: linear
        b2, s2, w2 = _mxfp4(rng, H, I)
        d = dict(w1=w1, w2=w2, b1=(rng.standard_normal((EG, 2 * I)) * 0.5).astype(dtype),
                 b2=(rng.standard_normal((EG, H)) * 0.5).astype(dtype),
                 rw=(rng.standard_normal((EG, H)) * 0.2).astype(dtype), rb=(rng.standard_normal(EG) * 0.1).astype(dtype))
        tensors.update({f"{p}.experts.gate_up_proj_blocks": b1, f"{p}.experts.gate_up_proj_scales": s1.view(scale_dtype),
                        f"{p}.experts.gate_up_proj_bias": d["b1"], f"{p}.experts.down_proj_blocks": b2,
                        f"{p}.experts.down_proj_scales": s2.view(scale_dtype), f"{p}.experts.down_proj_bias": d["b2"],
                        f"{p}.router.weight": d["rw"], f"{p}.router.bias": d["rb"],
                        f"model.layers.{L}.self_attn.sinks": np.zeros(8, np.float32)})
    qc = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"]}
    cfg = {"model_type": "gpt_oss", "num_local_experts": EG, "num_experts_per_tok": 4, "experts_per_token": 4,
           "swiglu_limit": 7.0, "quantization_config": quant or qc}
    _save(tmp_path, tensors, cfg, extra, drop)
    return {n: a.astype(np.float64) for n, a in d.items()}


def _gpt_oss_forward(x: np.ndarray, d: dict, k: int = 4, limit: float = 7.0):
    """gpt-oss's MoE in float64: router logits, softmax over the top k, per expert h = W1·x + b1, glu and
    linear from the even and odd rows, clamped, glu·sigmoid(1.702·glu)·(linear + 1), W2·a + b2, weighted
    sum. Returns (out [T, H], how many pre-activations the clamps changed)."""
    logits = x @ d["rw"].T + d["rb"]
    out, clamped = np.zeros_like(x), 0
    for t in range(x.shape[0]):
        top = np.argsort(-logits[t], kind="stable")[:k]
        p = np.exp(logits[t, top] - logits[t, top].max())
        for e, pe in zip(top, p / p.sum()):
            h = d["w1"][e] @ x[t] + d["b1"][e]
            glu, lin = h[0::2], h[1::2]
            clamped += int((glu > limit).sum() + (np.abs(lin) > limit).sum())
            glu, lin = np.minimum(glu, limit), np.clip(lin, -limit, limit)
            a = glu / (1.0 + np.exp(-1.702 * glu)) * (lin + 1.0)
            out[t] += pe * (d["w2"][e] @ a + d["b2"][e])
    return out, clamped


@pytest.mark.parametrize("dtype, scale_dtype", [(np.float32, np.uint8), (ml_dtypes.bfloat16, ml_dtypes.float8_e8m0fnu)])
def test_gpt_oss_mxfp4_layers_load_losslessly(tmp_path, rng, dtype, scale_dtype):
    d = _write_gpt_oss(tmp_path, rng, dtype=dtype, scale_dtype=scale_dtype)
    assert moe_layers(tmp_path) == [0, 2]
    layer = load_layer(tmp_path, 2)
    w, a = layer.weights, layer.attributes
    assert a == dict(k=4, quant_type="mxfp4", block_size=32, expert_weight_bits=4, activation_type="swiglu",
                     swiglu_fusion=1, activation_alpha=1.702, activation_beta=1.0, swiglu_limit=7.0,
                     normalize_routing_weights=1)
    spec = describe_layer(w, QMoEAttributes.from_kwargs(**a))  # the contract accepts them
    assert (spec.E, spec.H, spec.I, spec.F) == (EG, H, I, 2)
    assert w["fc1_experts_weights"].shape == (EG, 2 * I, H // 2) and w["fc1_scales"].dtype == np.uint8
    fc1 = dequantize_fp4("mxfp4", w["fc1_experts_weights"], w["fc1_scales"]).astype(np.float64)
    np.testing.assert_array_equal(fc1, d["w1"])
    np.testing.assert_array_equal(fc1[:, 0::2], d["w1"][:, 0::2])  # swiglu_fusion=1: the even rows are the gate
    np.testing.assert_array_equal(dequantize_fp4("mxfp4", w["fc2_experts_weights"], w["fc2_scales"]), d["w2"])
    for n, want in (("fc1_experts_bias", "b1"), ("fc2_experts_bias", "b2")):
        assert w[n].dtype == dtype
        np.testing.assert_array_equal(w[n].astype(np.float64), d[want])
    np.testing.assert_array_equal(layer.router_weight.astype(np.float64), d["rw"])
    np.testing.assert_array_equal(layer.router_bias.astype(np.float64), d["rb"])
    assert layer.source["fc1_experts_weights"] == "model.layers.2.mlp.experts.gate_up_proj_blocks"


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_gpt_oss_layer_computes_the_gpt_oss_moe(tmp_path, rng, dtype):
    d = _write_gpt_oss(tmp_path, rng, layers=(1,), dtype=dtype)
    layer = load_layer(tmp_path, 1)
    f32 = {n: (v.astype(np.float32) if n.endswith("bias") else v) for n, v in layer.weights.items()}  # exact
    x = (rng.standard_normal((6, H)) * 3.0).astype(np.float32)
    want, clamped = _gpt_oss_forward(x.astype(np.float64), d)
    assert clamped > 0  # the clamps are exercised
    logits = (x.astype(np.float64) @ d["rw"].T + d["rb"]).astype(np.float32)
    tol = dict(rtol=1e-5, atol=1e-5 * np.abs(want).max())
    np.testing.assert_allclose(reference(x, logits, **f32, **layer.attributes), want, **tol)
    rw, rb = layer.router_weight.astype(np.float32), layer.router_bias.astype(np.float32)
    got = reference(x, None, **f32, **layer.attributes, router_weight=rw, router_bias=rb)  # the router in the layer
    np.testing.assert_allclose(got, want, **tol)


def test_gpt_oss_refusals_name_the_tensor(tmp_path, rng):
    p = "model.layers.0.mlp.experts"
    bad_scales = np.full((EG, 2 * I, H // 32), 124, np.uint8)
    bad_scales[1, 3, 0] = 255
    cases = {
        "shape": (dict(extra={f"{p}.gate_up_proj_blocks": np.zeros((EG, 2 * I, H // 32, 8), np.uint8)}),
                  QMoEInputError, f"{p}.gate_up_proj_blocks"),
        "down": (dict(extra={f"{p}.down_proj_blocks": np.zeros((EG, H + 1, I // 32, 16), np.uint8)}),
                 QMoEInputError, f"{p}.down_proj_blocks"),
        "missing": (dict(drop={f"{p}.down_proj_scales"}), QMoEInputError, f"{p}.down_proj_scales"),
        "nan": (dict(extra={f"{p}.gate_up_proj_scales": bad_scales}), QMoEInputError, f"{p}.gate_up_proj_scales.*0xff"),
        "bias": (dict(extra={f"{p}.down_proj_bias": np.zeros((EG, H), np.int32)}), QMoEInputError, f"{p}.down_proj_bias"),
        "router": (dict(extra={"model.layers.0.mlp.router.weight": np.zeros((EG + 1, H), np.float32)}), QMoEInputError,
                   "mlp.router.weight"),
        "method": (dict(quant={"quant_method": "fp8"}), QMoEUnsupportedError, "quant_method 'fp8'"),
    }
    for tag, (kw, exc, match) in cases.items():
        sub = tmp_path / tag
        sub.mkdir()
        _write_gpt_oss(sub, np.random.default_rng(1), layers=(0,), **kw)
        with pytest.raises(exc, match=match):
            load_layer(sub, 0)


def test_the_checkpoint_command_reads_gpt_oss(tmp_path, rng, capsys):
    from qmoe_rtc.__main__ import main

    _write_gpt_oss(tmp_path, rng)
    assert main(["checkpoint", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"layer 0: gpt_oss: E={EG} H={H} I={I} k=4 top-k renormalised, mxfp4 block 32 (uint8 scales), " \
           "router [E, H] + bias [E]" in out and "layer 2:" in out


# --------------------------------------------------------------------------------------------- NVFP4

def _nvfp4(rng, N, K, g):
    """ModelOpt tensors of one [N, K] Linear with global scale ``g`` and its float64 decode."""
    codes = rng.integers(0, 16, size=(N, K)).astype(np.uint8)
    s = rng.integers(0x20, 0x50, size=(N, K // 16)).astype(np.uint8).view(ml_dtypes.float8_e4m3fn)
    dense = _e2m1(codes) * np.repeat(s.astype(np.float64), 16, axis=-1) * float(g)
    return {"weight": _pack(codes), "weight_scale": s, "weight_scale_2": np.array(g, np.float32),
            "input_scale": np.array(0.02, np.float32)}, dense


def _global(rng) -> np.float32:
    """A global scale of 16 significant bits: e2m1 · e4m3 · g is then exact in float32, so the contract's
    float32 dequantization equals the float64 decode bit for bit."""
    return np.float32(rng.integers(1 << 15, 1 << 16) * 2.0**-26)


def _write_nvfp4(tmp_path, rng, scheme="moe_mlp", same=True, g_shape=(), shared=0, hf_quant=False, qc=None,
                 extra=None, drop=()):
    """A ModelOpt NVFP4 checkpoint of layer 1; the float64 decode {name: [E, N, K]}, global scales and
    scale bytes (``shared``: S, a shared MLP of S·I under ``shared_<name>``, with its sigmoid gate)."""
    names = ("gate_proj", "up_proj", "down_proj") if scheme == "moe_mlp" else ("w1", "w3", "w2")
    base = "model.layers.1.mlp.experts" if scheme == "moe_mlp" else "model.layers.1.block_sparse_moe.experts"
    mlps = [(f"{base}.{e}", I, "") for e in range(E)]
    mlps += [("model.layers.1.mlp.shared_expert", shared * I, "shared_")] if shared else []
    tensors, dense, gs, sb = {}, {}, {}, {}
    for mlp, inter, tag in mlps:
        g_gate = _global(rng)
        for n, (N, K) in zip(names, ((inter, H), (inter, H), (H, inter))):
            g = g_gate if n == names[0] or (n == names[1] and same) else _global(rng)
            t, dq = _nvfp4(rng, N, K, g)
            t["weight_scale_2"] = t["weight_scale_2"].reshape(g_shape)
            tensors.update({f"{mlp}.{n}.{k}": v for k, v in t.items()})
            dense.setdefault(tag + n, []).append(dq)
            gs.setdefault(tag + n, []).append(g)
            sb.setdefault(tag + n, []).append(t["weight_scale"].view(np.uint8))
    if shared:
        tensors["model.layers.1.mlp.shared_expert_gate.weight"] = (rng.integers(-64, 64, (1, H)) / 64).astype(
            ml_dtypes.bfloat16)
    gate = "model.layers.1.mlp.gate.weight" if scheme == "moe_mlp" else "model.layers.1.block_sparse_moe.gate.weight"
    tensors[gate] = rng.standard_normal((E, H)).astype(ml_dtypes.bfloat16)
    q = qc or {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": ["lm_head"]}
    cfg = {"num_experts": E, "num_experts_per_tok": 2, "norm_topk_prob": True}
    if hf_quant:  # older ModelOpt exports: the quantization beside config.json
        (tmp_path / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": {
            "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}}))
    else:
        cfg["quantization_config"] = q
    _save(tmp_path, tensors, cfg, extra, drop)
    return ({n: np.stack(v) for n, v in dense.items()}, {n: np.array(v, np.float32) for n, v in gs.items()},
            {n: np.stack(v) for n, v in sb.items()}, names)


@pytest.mark.parametrize("scheme, g_shape, hf_quant", [("moe_mlp", (), False), ("mixtral", (1,), False),
                                                       ("moe_mlp", (), True)])
def test_nvfp4_layers_load_losslessly(tmp_path, rng, scheme, g_shape, hf_quant):
    dense, gs, sb, (gate, up, down) = _write_nvfp4(tmp_path, rng, scheme, g_shape=g_shape, hf_quant=hf_quant)
    layer = load_layer(tmp_path, 1)
    w, a = layer.weights, layer.attributes
    assert a["quant_type"] == "nvfp4" and a["block_size"] == 16 and a["swiglu_fusion"] == 2
    describe_layer(w, QMoEAttributes.from_kwargs(**a))
    assert w["fc1_global_scale"].shape == (E,) and w["fc2_global_scale"].shape == (E,)  # gate and up share one
    np.testing.assert_array_equal(w["fc1_global_scale"], gs[gate])
    np.testing.assert_array_equal(w["fc2_global_scale"], gs[down])
    np.testing.assert_array_equal(w["fc1_scales"].view(np.uint8), np.concatenate([sb[gate], sb[up]], axis=1))
    fc1 = np.concatenate([dense[gate], dense[up]], axis=1)  # the I gate rows, then the I up rows
    for p, want in (("fc1", fc1), ("fc2", dense[down])):
        got = dequantize_fp4("nvfp4", w[f"{p}_experts_weights"], w[f"{p}_scales"], w[f"{p}_global_scale"])
        np.testing.assert_array_equal(got.astype(np.float64), want)
    # the layer computes silu(gate) · up experts, softmax top-2 renormalised
    x = rng.standard_normal((5, H)).astype(np.float32)
    logits = rng.standard_normal((5, E)).astype(np.float32)
    want = np.zeros((5, H))
    for t in range(5):
        top = np.argsort(-logits[t], kind="stable")[:2]
        p = np.exp(logits[t, top].astype(np.float64))
        for e, pe in zip(top, p / p.sum()):
            g, u = fc1[e] @ x[t], dense[up][e] @ x[t]
            want[t] += pe * (dense[down][e] @ (g[:I] / (1 + np.exp(-g[:I])) * u))
    np.testing.assert_allclose(reference(x, logits, **w, **a), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_nvfp4_gate_and_up_with_their_own_global_scales_give_one_per_row(tmp_path, rng):
    dense, gs, _, (gate, up, down) = _write_nvfp4(tmp_path, rng, same=False)
    w = load_layer(tmp_path, 1).weights
    g1 = w["fc1_global_scale"]
    assert g1.shape == (E, 2 * I) and g1.dtype == np.float32 and w["fc2_global_scale"].shape == (E,)
    np.testing.assert_array_equal(g1[:, :I], np.repeat(gs[gate][:, None], I, 1))
    np.testing.assert_array_equal(g1[:, I:], np.repeat(gs[up][:, None], I, 1))
    got = dequantize_fp4("nvfp4", w["fc1_experts_weights"], w["fc1_scales"], g1)
    np.testing.assert_array_equal(got.astype(np.float64), np.concatenate([dense[gate], dense[up]], axis=1))


def test_an_nvfp4_shared_mlp_carries_its_global_scale(tmp_path, rng):
    dense, gs, _, (gate, up, down) = _write_nvfp4(tmp_path, rng, shared=2)
    layer = load_layer(tmp_path, 1)
    w, a = layer.weights, layer.attributes
    assert w["shared_fc1_global_scale"].shape == (2,) and w["shared_gate_weight"].dtype == np.float32
    np.testing.assert_array_equal(w["shared_fc1_global_scale"], np.repeat(gs[f"shared_{gate}"], 2))
    np.testing.assert_array_equal(w["shared_fc2_global_scale"], np.repeat(gs[f"shared_{down}"], 2))
    g, u, d = (dense[f"shared_{n}"][0] for n in (gate, up, down))
    fc1 = dequantize_fp4("nvfp4", w["shared_fc1_experts_weights"], w["shared_fc1_scales"], w["shared_fc1_global_scale"])
    fc2 = dequantize_fp4("nvfp4", w["shared_fc2_experts_weights"], w["shared_fc2_scales"], w["shared_fc2_global_scale"])
    for s in range(2):
        rows = slice(s * I, (s + 1) * I)
        np.testing.assert_array_equal(fc1[s].astype(np.float64), np.concatenate([g[rows], u[rows]]))
        np.testing.assert_array_equal(fc2[s].astype(np.float64), d[:, rows])
    x = rng.standard_normal((3, H)).astype(np.float32)
    assert reference(x, rng.standard_normal((3, E)).astype(np.float32), **w, **a).shape == (3, H)  # accepted


def test_nvfp4_refusals_name_the_tensor_or_setting(tmp_path, rng):
    p = "model.layers.1.mlp.experts.0"
    nan = np.full((I, H // 16), 0x38, np.uint8)
    nan[2, 1] = 0x7F
    cases = {
        "missing": (dict(drop={f"{p}.up_proj.weight_scale_2"}), QMoEInputError, f"{p}.up_proj.weight_scale_2"),
        "shape": (dict(extra={f"{p}.gate_proj.weight": np.zeros((I, H), np.uint8)}), QMoEInputError,
                  f"{p}.gate_proj.weight"),
        "nan": (dict(extra={f"{p}.up_proj.weight_scale": nan.view(ml_dtypes.float8_e4m3fn)}), QMoEInputError,
                f"{p}.up_proj.weight_scale"),
        "zero": (dict(extra={f"{p}.down_proj.weight_scale_2": np.array(0.0, np.float32)}), QMoEInputError,
                 f"{p}.down_proj.weight_scale_2"),
        "two": (dict(extra={f"{p}.down_proj.weight_scale_2": np.ones(2, np.float32)}), QMoEInputError,
                f"{p}.down_proj.weight_scale_2"),
        "algo": (dict(qc={"quant_method": "modelopt", "quant_algo": "FP8"}), QMoEUnsupportedError, "quant_algo 'FP8'"),
        "group": (dict(qc={"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32}), QMoEUnsupportedError,
                  "group_size 32"),
        "mxfp4": (dict(qc={"quant_method": "mxfp4"}), QMoEUnsupportedError, "per-expert projections"),
    }
    for tag, (kw, exc, match) in cases.items():
        sub = tmp_path / tag
        sub.mkdir()
        _write_nvfp4(sub, np.random.default_rng(1), **kw)
        with pytest.raises(exc, match=match):
            load_layer(sub, 1)
