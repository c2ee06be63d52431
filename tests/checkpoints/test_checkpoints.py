"""Checkpoint loading (CPU): small GPTQ, AWQ and compressed-tensors checkpoints written here in each format's own storage
(names, dtypes, packing as the formats define them), loaded into contract inputs, and checked against
the dense float64 weights (q − zero) · scale the test quantized them from; the refusals name the
tensor or the setting."""

from __future__ import annotations

import json

import numpy as np
import pytest
from ml_dtypes import bfloat16

from qmoe_rtc.checkpoints import Checkpoint, load_layer, moe_layers
from qmoe_rtc.checkpoints.formats import AWQ_ORDER
from qmoe_rtc.contract import QMoEAttributes, describe_layer
from qmoe_rtc.errors import QMoEInputError, QMoEUnsupportedError
from qmoe_rtc.formats.quantize import dequantize, unpack_codes

from support.hf_models import pack_along

#: every test writes a checkpoint: safetensors (the [test] / [checkpoints] extra) or skip
save_file = pytest.importorskip("safetensors.numpy").save_file

H, I, E = 128, 64, 3


def _quantized(rng, N, K, bits, group, sym):
    """(codes [N, K], zeros [N, nb], scales f16 [N, nb], dense float64 [N, K])."""
    nb = K // group if group > 0 else 1
    q = rng.integers(0, 1 << bits, size=(N, K))
    z = np.full((N, nb), 1 << (bits - 1)) if sym else rng.integers(1, 1 << bits, size=(N, nb))
    s = (rng.random((N, nb)) * 0.02 + 0.001).astype(np.float16)
    bs = group if group > 0 else K
    dense = (q.reshape(N, nb, bs) - z[..., None]) * s.astype(np.float64)[..., None]
    return q, z, s, dense.reshape(N, K)


def _write(tmp_path, method, rng, *, bits=4, group=32, sym=False, version=1, scheme="moe_mlp", extra=None, shared=0):
    """A one-layer checkpoint (layer 1) in ``method``'s storage; returns the dense experts {name: [E, N, K]}
    (with ``shared`` = S, a shared MLP of S·I under ``shared_<name>`` [1, N, K] and its sigmoid gate)."""
    names = ("gate_proj", "up_proj", "down_proj") if scheme == "moe_mlp" else ("w1", "w3", "w2")
    base = "model.layers.1.mlp.experts" if scheme == "moe_mlp" else "model.layers.1.block_sparse_moe.experts"
    tensors, dense = {}, {n: [] for n in names}
    mlps = [(f"{base}.{e}", I, "") for e in range(E)] + ([("model.layers.1.mlp.shared_expert", shared * I, "shared_")]
                                                         if shared else [])
    for mlp, inter, tag in mlps:
        for n, (N, K) in zip(names, ((inter, H), (inter, H), (H, inter))):
            q, z, s, d = _quantized(rng, N, K, bits, group, sym)
            dense.setdefault(tag + n, []).append(d)
            p = f"{mlp}.{n}"
            if method == "compressed-tensors":
                tensors[f"{p}.weight_packed"] = pack_along(q, bits, 1)  # [N, K·b/32], signed + 2^(b-1)
                tensors[f"{p}.weight_scale"] = s  # [N, nb]
                tensors[f"{p}.weight_shape"] = np.array([N, K], dtype=np.int32)
                if not sym:
                    tensors[f"{p}.weight_zero_point"] = pack_along(z, bits, 0)  # [N·b/32, nb]
                continue
            if method == "gptq":
                tensors[f"{p}.qweight"] = pack_along(q.T, bits, 0)  # [K·b/32, N]
                tensors[f"{p}.qzeros"] = pack_along((z - (1 if version == 1 else 0)).T, bits, 1)  # [nb, N·b/32]
                tensors[f"{p}.g_idx"] = (np.arange(K) // (group if group > 0 else K)).astype(np.int32)
            else:
                tensors[f"{p}.qweight"] = pack_along(q.T, 4, 1, AWQ_ORDER)  # [K, N/8]
                tensors[f"{p}.qzeros"] = pack_along(z.T, 4, 1, AWQ_ORDER)  # [nb, N/8]
            tensors[f"{p}.scales"] = np.ascontiguousarray(s.T)  # [nb, N]
    if shared:  # a bfloat16 gate whose values float16 holds exactly
        tensors["model.layers.1.mlp.shared_expert_gate.weight"] = (rng.integers(-64, 64, (1, H)) / 64).astype(bfloat16)
    gate = "model.layers.1.mlp.gate.weight" if scheme == "moe_mlp" else "model.layers.1.block_sparse_moe.gate.weight"
    tensors[gate] = rng.standard_normal((E, H)).astype(np.float32)
    tensors.update(extra or {})
    save_file(tensors, str(tmp_path / "model.safetensors"))
    qc = {"quant_method": method, "bits": bits, "group_size": group}
    qc.update({"checkpoint_format": "gptq_v2" if version == 2 else "gptq"} if method == "gptq" else {"version": "gemm"})
    if method == "compressed-tensors":
        w = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": "group" if group > 0 else "channel",
             "group_size": group if group > 0 else None}
        qc = {"quant_method": method, "format": "pack-quantized",
              "config_groups": {"group_0": {"weights": w, "targets": ["Linear"]}}, "ignore": ["lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps({"num_experts": E, "num_experts_per_tok": 2, "norm_topk_prob": True,
                                                      "quantization_config": qc}))
    return {n: np.stack(v) for n, v in dense.items()}, names


def _check(layer, dense, names, bits, group):
    w, a = layer.weights, layer.attributes
    describe_layer(w, QMoEAttributes.from_kwargs(**a))  # the contract accepts them
    assert a["swiglu_fusion"] == 2 and a["expert_weight_bits"] == bits and a["block_size"] == max(group, 0)
    fc1 = np.concatenate([dense[names[0]], dense[names[1]]], axis=1)  # gate rows, then up rows
    for p, want in (("fc1", fc1), ("fc2", dense[names[2]])):
        got = dequantize(w[f"{p}_experts_weights"], w[f"{p}_scales"], bits, max(group, 0), w.get(f"{p}_zero_points"),
                         K=want.shape[2])
        np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float32).astype(np.float64))


@pytest.mark.parametrize("bits, group, sym, version", [(4, 32, False, 1), (4, 64, True, 1), (8, 32, False, 2),
                                                         (2, 16, False, 1), (4, -1, False, 2)])
def test_gptq_layers_load_losslessly(tmp_path, rng, bits, group, sym, version):
    dense, names = _write(tmp_path, "gptq", rng, bits=bits, group=group, sym=sym, version=version)
    layer = load_layer(tmp_path, 1)
    _check(layer, dense, names, bits, group)
    assert ("fc1_zero_points" in layer.weights) == (not sym)  # symmetric codes: the contract's default zero point
    assert layer.router_weight.shape == (E, H) and layer.attributes["k"] == 2
    assert moe_layers(tmp_path) == [1]


@pytest.mark.parametrize("bits, group, sym", [(4, 32, False), (8, 64, True), (4, -1, False), (2, 16, False)])
def test_compressed_tensors_layers_load_losslessly(tmp_path, rng, bits, group, sym):
    dense, names = _write(tmp_path, "compressed-tensors", rng, bits=bits, group=group, sym=sym)
    layer = load_layer(tmp_path, 1)
    _check(layer, dense, names, bits, group)
    assert ("fc2_zero_points" in layer.weights) == (not sym)


@pytest.mark.parametrize("scheme", ["moe_mlp", "mixtral"])
def test_awq_layers_load_losslessly(tmp_path, rng, scheme):
    dense, names = _write(tmp_path, "awq", rng, group=32, scheme=scheme)
    seen = []
    layer = load_layer(tmp_path / "model.safetensors", 1, progress=lambda d, t: seen.append((d, t)))
    _check(layer, dense, names, 4, 32)
    assert seen == [(e + 1, E) for e in range(E)]


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_gptq_v1_zero_points_are_whole_words_less_one_per_code(tmp_path, rng, bits):
    """GPTQ v1 (GPTQModel's default) stores the v2 zero-point words less 0x11111111 (4-bit; 0x55555555,
    0x01010101) as 32-bit arithmetic, borrows included, and GPTQModel adds it back: zero points of 0 and of
    2^b − 1 load exactly (a per-code +1 would read 0 as 2^b and refuse the layer)."""
    _write(tmp_path, "gptq", rng, bits=bits, group=32, version=1)
    p = "model.layers.1.mlp.experts.0.gate_proj"
    z = rng.integers(0, 1 << bits, size=(H // 32, I))  # [nb, N] v2 zero points, 0 and 2^b − 1 among them
    z[0, :4] = [0, (1 << bits) - 1, 0, 0]
    v2 = pack_along(z, bits, 1).view(np.uint32)  # [nb, N·b/32]
    offset = {2: 0x55555555, 4: 0x11111111, 8: 0x01010101}[bits]
    v1 = ((v2.astype(np.int64) - offset) % (1 << 32)).astype(np.uint32).view(np.int32)
    from safetensors.numpy import load_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors[f"{p}.qzeros"] = v1
    save_file(tensors, str(tmp_path / "model.safetensors"))
    layer = load_layer(tmp_path, 1)
    got = unpack_codes(layer.weights["fc1_zero_points"][0], bits, H // 32)[:I]  # [I, nb] expert 0's gate rows
    np.testing.assert_array_equal(got, z.T)


def test_refusals_name_the_tensor_or_setting(tmp_path, rng):
    _write(tmp_path, "gptq", rng)
    p = "model.layers.1.mlp.experts.0.gate_proj"
    with pytest.raises(QMoEInputError, match="MoE experts of layer 5"):
        load_layer(tmp_path, 5)
    with pytest.raises(QMoEInputError, match="scheme"):
        load_layer(tmp_path, 1, scheme="llama")
    cases = {  # a malformed tensor each
        f"{p}.qweight": (np.zeros((3, I), np.int32), QMoEInputError, f"{p}.qweight"),
        f"{p}.g_idx": (np.arange(H, dtype=np.int32)[::-1].copy() % 2, QMoEUnsupportedError, "act-order"),
        f"{p}.scales": (np.zeros((H // 32, I), np.int32), QMoEInputError, f"{p}.scales"),
    }
    for name, (bad, exc, match) in cases.items():
        sub = tmp_path / name.rsplit(".", 1)[1]
        sub.mkdir()
        _write(sub, "gptq", np.random.default_rng(1), extra={name: bad})
        with pytest.raises(exc, match=match):
            load_layer(sub, 1)


@pytest.mark.parametrize("qc, match", [({"quant_method": "fp8"}, "quant_method"),
                                       ({"quant_method": "awq", "version": "gemv"}, "GEMM packing"),
                                       ({"quant_method": "gptq", "bits": 3, "group_size": 32}, "3-bit"),
                                       ({"quant_method": "compressed-tensors", "format": "float-quantized"},
                                        "pack-quantized is read"),
                                       ({"quant_method": "compressed-tensors", "format": "pack-quantized",
                                         "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int",
                                                                             "strategy": "group", "group_size": 32,
                                                                             "actorder": "group"}}}}, "act-order")])
def test_unsupported_formats_are_refused(tmp_path, rng, qc, match):
    _write(tmp_path, "gptq", rng)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = qc
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QMoEUnsupportedError, match=match):
        load_layer(tmp_path, 1)


def test_a_stray_shared_expert_tensor_is_refused_not_half_loaded(tmp_path, rng):
    _write(tmp_path, "gptq", rng, extra={"model.layers.1.mlp.shared_expert.up_proj.scales": np.ones((2, 2), np.float16)})
    with pytest.raises(QMoEInputError, match="shared_expert.gate_proj.scales"):
        load_layer(tmp_path, 1)


@pytest.mark.parametrize("method, group", [("gptq", 32), ("gptq", -1), ("compressed-tensors", 32)])
def test_a_shared_mlp_of_twice_i_becomes_two_shared_experts(tmp_path, rng, method, group):
    """A shared MLP of 2·I (Qwen2-MoE's shared_expert, with its sigmoid gate) loads as two shared experts of
    I: their dequantized halves are the MLP's, and the float64 reference gives the same output as the
    whole MLP as one shared expert of its own size."""
    from qmoe_rtc.contract.random_layer import random_inputs
    from qmoe_rtc.contract.reference import qmoe as reference
    from qmoe_rtc.runtime.layer import describe_gpu_layer

    dense, names = _write(tmp_path, method, rng, group=group, shared=2)
    layer = load_layer(tmp_path, 1)
    w, a = layer.weights, layer.attributes
    ext = describe_gpu_layer(w, QMoEAttributes.from_kwargs(**a), {}).ext  # as QMoE() validates, GPU-free
    assert ext.S == 2 and ext.gate and w["shared_gate_weight"].dtype == np.float16  # exact in float16
    g, u, d = (dense[f"shared_{n}"][0] for n in names)
    bs = max(group, 0)
    fc1 = dequantize(w["shared_fc1_experts_weights"], w["shared_fc1_scales"], 4, bs, w.get("shared_fc1_zero_points"), K=H)
    fc2 = dequantize(w["shared_fc2_experts_weights"], w["shared_fc2_scales"], 4, bs, w.get("shared_fc2_zero_points"), K=I)
    for s in range(2):
        rows = slice(s * I, (s + 1) * I)
        np.testing.assert_array_equal(fc1[s], np.concatenate([g[rows], u[rows]]).astype(np.float32))
        np.testing.assert_array_equal(fc2[s], d[:, rows].astype(np.float32))
    if group > 0:  # the same MLP as one shared expert of 2·I (the contract takes a shared size of its own)
        whole = dict(w, **_one_shared_expert(w))
        x, logits, _ = random_inputs(rng, 3, H, E, "float16")
        np.testing.assert_allclose(reference(x, logits, **w, **a), reference(x, logits, **whole, **a), rtol=0,
                                   atol=1e-12)


def _one_shared_expert(w: dict) -> dict:
    """Two shared experts of I (block-wise scales, whole bytes of zero points) as one of 2·I: FC1 rows
    gate 0, gate 1, up 0, up 1; FC2 inputs of expert 0 then expert 1."""
    out = {}
    for t in ("experts_weights", "scales", "zero_points"):
        a = w.get(f"shared_fc1_{t}")
        if a is not None:
            out[f"shared_fc1_{t}"] = np.concatenate([a[0, :I], a[1, :I], a[0, I:], a[1, I:]])[None]
        a = w.get(f"shared_fc2_{t}")
        if a is not None:
            out[f"shared_fc2_{t}"] = np.concatenate([a[0], a[1]], axis=-1)[None]
    return out



def test_the_checkpoint_command_reads_every_moe_layer(tmp_path, rng, capsys):
    from qmoe_rtc.__main__ import main

    _write(tmp_path, "awq", rng)
    assert main(["checkpoint", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"layer 1: model: E={E} H={H} I={I} k=2 top-k renormalised, int4 block 32 zero points (float16 scales), " \
           "router [E, H]" in out
    assert main(["checkpoint", str(tmp_path / "nothing")]) == 2  # a QMoEInputError: one line, exit 2
    assert "QMoEInputError" in capsys.readouterr().err
    assert main(["checkpoint", str(tmp_path), "--scheme", "llama"]) == 2  # named, one line
    err = capsys.readouterr().err
    assert "scheme" in err and len(err.strip().splitlines()) == 1


def test_the_checkpoint_command_refuses_what_qmoe_refuses(tmp_path, rng, capsys):
    """k above the expert count (config.json) and a zero-point tensor with dirty padding: each refused
    by the same check QMoE() runs, named per layer, exit 1."""
    from qmoe_rtc.__main__ import main

    _write(tmp_path, "awq", rng)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_experts_per_tok": 99}))
    assert main(["checkpoint", str(tmp_path)]) == 1
    assert "layer 1: refused" in capsys.readouterr().out
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_experts_per_tok": 2}))
    qc = {k: v for k, v in cfg["quantization_config"].items() if k != "bits"}
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    assert main(["checkpoint", str(tmp_path)]) == 1  # no bits: named, never 4 by default
    assert "quantization_config.bits" in capsys.readouterr().out


def test_an_open_checkpoint_serves_many_reads_and_closes(tmp_path, rng):
    dense, names = _write(tmp_path, "gptq", rng)
    with Checkpoint(tmp_path) as ckpt:
        assert moe_layers(ckpt) == [1]
        layer = load_layer(ckpt, 1)
        assert ckpt._open  # the file stays open between reads
    assert not ckpt._open
    _check(layer, dense, names, 4, 32)


@pytest.mark.parametrize("key, value", [("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("n_group", 8),
                                        ("routed_scaling_factor", 2.5)])
def test_a_router_the_contract_cannot_reproduce_is_refused(tmp_path, rng, key, value):
    """DeepSeek-V3-style routing (sigmoid scores, grouped top-k, a scaling factor) is not softmax top-k."""
    _write(tmp_path, "gptq", rng)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg[key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QMoEUnsupportedError, match=f"config.json {key}"):
        load_layer(tmp_path, 1)
    cfg.update(scoring_func="softmax", topk_method="greedy", n_group=1, routed_scaling_factor=1.0)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    load_layer(tmp_path, 1)  # the values that are softmax top-k load


def _write_fp8(tmp_path, rng, block=32, shared=0, scales="float32"):
    """An FP8 block-scaled checkpoint (DeepSeek-V3 / Qwen3-FP8 storage) of layer 1; the dense experts.
    ``scales``: the dtype of weight_scale_inv (float32, bfloat16, or e8m0 with ``scale_fmt: ue8m0``)."""
    import ml_dtypes

    names = ("gate_proj", "up_proj", "down_proj")
    tensors, dense = {}, {}
    mlps = [(f"model.layers.1.mlp.experts.{e}", I, "") for e in range(E)]
    mlps += [("model.layers.1.mlp.shared_experts", shared * I, "shared_")] if shared else []
    for mlp, inter, tag in mlps:
        for n, (N, K) in zip(names, ((inter, H), (inter, H), (H, inter))):
            q = rng.integers(0, 256, size=(N, K)).astype(np.uint8)
            q[(q & 0x7F) == 0x7F] = 0x3C  # no NaN codes
            s = (rng.random((-(-N // block), -(-K // block))) + 0.5).astype(np.float32)
            if scales == "e8m0":  # powers of two 2^-8 .. 2^7, stored as e8m0 bytes
                s = np.exp2(rng.integers(-8, 8, size=s.shape)).astype(np.float32)
                stored = (np.log2(s) + 127).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)
            else:
                stored = s.astype(getattr(ml_dtypes, scales, scales))
                s = stored.astype(np.float32)
            w = q.view(ml_dtypes.float8_e4m3fn)
            full = np.repeat(np.repeat(s, block, 0), block, 1)[:N, :K]
            dense.setdefault(tag + n, []).append(w.astype(np.float64) * full)
            tensors[f"{mlp}.{n}.weight"] = w
            tensors[f"{mlp}.{n}.weight_scale_inv"] = stored
    save_file(tensors, str(tmp_path / "model.safetensors"))
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [block, block]}
    qc.update({"scale_fmt": "ue8m0"} if scales == "e8m0" else {})
    (tmp_path / "config.json").write_text(json.dumps({"num_experts": E, "num_experts_per_tok": 2, "norm_topk_prob": True,
                                                      "quantization_config": qc}))
    return {n: np.stack(v) for n, v in dense.items()}, names


@pytest.mark.parametrize("shared, scales", [(0, "float32"), (2, "float32"), (0, "bfloat16"), (2, "e8m0")])
def test_fp8_block_layers_load_as_the_contracts_fp8_experts(tmp_path, rng, shared, scales):
    """float32 scales (Qwen3-FP8, DeepSeek-V3), bfloat16 ones, and DeepSeek-V3.1's e8m0 (``scale_fmt:
    ue8m0``, float8_e8m0fnu bytes): the contract's float32 FP8 block scales, exactly."""
    from qmoe_rtc.formats.fp8 import dequantize_fp8
    from qmoe_rtc.runtime.layer import describe_gpu_layer

    dense, names = _write_fp8(tmp_path, rng, shared=shared, scales=scales)
    layer = load_layer(tmp_path, 1)
    w, a = layer.weights, layer.attributes
    assert a["quant_type"] == "fp8" and a["block_size"] == 32 and a["expert_weight_bits"] == 8
    assert describe_gpu_layer(w, QMoEAttributes.from_kwargs(**a), {}).ext.S == shared
    fc1 = np.concatenate([dense[names[0]], dense[names[1]]], axis=1)
    for p, want in (("fc1", fc1), ("fc2", dense[names[2]])):
        got = dequantize_fp8(w[f"{p}_experts_weights"], w[f"{p}_scales"], 32)
        np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float32).astype(np.float64))
    if shared:
        g, u, d = (dense[f"shared_{n}"][0] for n in names)
        fc1 = dequantize_fp8(w["shared_fc1_experts_weights"], w["shared_fc1_scales"], 32)
        fc2 = dequantize_fp8(w["shared_fc2_experts_weights"], w["shared_fc2_scales"], 32)
        for s in range(shared):
            rows = slice(s * I, (s + 1) * I)
            np.testing.assert_array_equal(fc1[s], np.concatenate([g[rows], u[rows]]).astype(np.float32))
            np.testing.assert_array_equal(fc2[s], d[:, rows].astype(np.float32))


def test_fp8_blocks_that_straddle_gate_and_up_are_refused(tmp_path, rng):
    _write_fp8(tmp_path, rng, block=128)  # I = 64 rows: one block would hold gate and up rows
    with pytest.raises(QMoEUnsupportedError, match="share a block"):
        load_layer(tmp_path, 1)
