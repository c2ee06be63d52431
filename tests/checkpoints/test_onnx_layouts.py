"""ONNX Runtime 1.32's own QMoE layouts read into the contract (qmoe_rtc.checkpoints.onnx_layouts), CPU only.

Each form is built here with onnx.helper the way ONNX Runtime's schema and GenAI builder define it, with
this file's own packers and decoders (written from those definitions, independent of the import):

- 4/8-bit codes CUDA-prepacked (SM80 fpA_intB: K-row permutation, transpose, column interleave, word
  order), with ``weights_prepacked`` absent and 1: read back to the exact raw codes;
- ``quant_type="fp4"`` (MXFP4, N-packed [E, K, N/2] codes, e8m0 block scales, a global scale) and
  ``"nvfp4"`` (N-packed or, with ``weights_prepacked=1``, K-packed bytes): the float64 dequantization of
  what is imported equals the dequantization of the ORT form; a global scale that no e8m0 exponent can
  absorb is refused by name;
- INT3 (``weights_prepacked=0``): read as is, and the float64 reference matches onnxruntime's CPU kernel.
"""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from qmoe_rtc.checkpoints.onnx_layouts import unprepack_sm80  # noqa: E402
from qmoe_rtc.checkpoints.onnx_nodes import qmoe_nodes  # noqa: E402
from qmoe_rtc.contract import INPUT_NAMES, QMoEAttributes, describe_layer  # noqa: E402
from qmoe_rtc.contract.random_layer import random_layer  # noqa: E402
from qmoe_rtc.errors import QMoEInputError, QMoEUnsupportedError  # noqa: E402
from qmoe_rtc.formats.fp4 import dequantize_fp4  # noqa: E402

SLOTS = INPUT_NAMES + ("fc1_global_scale", "fc2_global_scale")
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def _save(tmp_path, weights: dict, attrs: dict, raw_dtypes: dict | None = None):
    """One QMoE node with ``weights`` as initializers (``raw_dtypes``: slot -> ONNX type for uint8 bytes)."""
    raw_dtypes = raw_dtypes or {}
    inits, names = [], []
    for slot in SLOTS[2:]:
        a = weights.get(slot)
        if a is None:
            names.append("")
            continue
        if slot in raw_dtypes:
            inits.append(helper.make_tensor(slot, raw_dtypes[slot], a.shape, np.ascontiguousarray(a).tobytes(), raw=True))
        else:
            inits.append(numpy_helper.from_array(np.ascontiguousarray(a), slot))
        names.append(slot)
    while names and not names[-1]:
        names.pop()
    node = helper.make_node("QMoE", ["x", "probs", *names], ["y"], name="moe", domain="com.microsoft", **attrs)
    H = 64
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [None, H]),
                                            helper.make_tensor_value_info("probs", TensorProto.FLOAT16, [None, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [None, H])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    path = tmp_path / "m.onnx"
    onnx.save_model(model, str(path))
    return path


# ---- CUDA SM80 prepacking, byte by byte as ONNX Runtime's packer does it (4 or 8 bits) ----

def _nibbles(b):
    return np.stack([b & 0xF, b >> 4], axis=-1).reshape(*b.shape[:-1], -1)


def _sm80_prepack(raw, N, K, bits):
    """[E, N, K·b/8] offset-binary codes -> [E, K, N·b/8] bytes of the CUDA QMoE (SM80) layout."""
    out = []
    for q in raw:
        codes = (_nibbles(q) if bits == 4 else q).astype(np.int16)[:, :K] - (8 if bits == 4 else 128)
        t = codes.T & (0xF if bits == 4 else 0xFF)                               # [K, N] signed codes
        R = 32 if bits == 4 else 16                                              # rows per MMA tile
        pm = ([0, 1, 8, 9, 16, 17, 24, 25, 2, 3, 10, 11, 18, 19, 26, 27, 4, 5, 12, 13, 20, 21, 28, 29, 6, 7, 14, 15,
               22, 23, 30, 31] if bits == 4 else [0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15])
        t = t[[(r // R) * R + pm[r % R] for r in range(K)]]
        t = t.T.copy()                                                           # subbyte transpose: [N, K]
        stream = (t[:, 0::2] | (t[:, 1::2] << 4)).astype(np.uint8).reshape(-1) if bits == 4 else t.astype(np.uint8).reshape(-1)
        stream = stream.reshape(-1, 16 // bits, K // 64, 32 if bits == 4 else 64).transpose(0, 2, 1, 3).reshape(-1)
        if bits == 8:
            s = stream.astype(np.int16)
            s = np.where(s > 127, s - 256, s) + 128                              # add the bias back
            stream = s.reshape(-1, 4)[:, [0, 2, 1, 3]].reshape(-1).astype(np.uint8)
        else:
            v = _nibbles(stream[None])[0].astype(np.int16).reshape(-1, 8)[:, [0, 2, 4, 6, 1, 3, 5, 7]].reshape(-1)
            v = np.where(v > 7, v - 16, v) + 8
            stream = (v[0::2] | (v[1::2] << 4)).astype(np.uint8)
        out.append(stream.reshape(K, N * bits // 8))
    return np.stack(out)


@pytest.mark.parametrize("bits,block_size,prepacked", [(4, 32, None), (4, 0, 1), (8, 64, None), (8, 0, 1)])
def test_cuda_prepacked_int_codes_read_back_exactly(tmp_path, rng, bits, block_size, prepacked):
    E, H, I = 4, 64, 128  # fused swiglu: FC1 [256 x 64], FC2 [64 x 128]: shapes tell the layouts apart
    w, a = random_layer(rng, E=E, H=H, I=I, bits=bits, block_size=block_size, activation_type="swiglu",
                        swiglu_fusion=1)
    ort = dict(w, fc1_experts_weights=_sm80_prepack(w["fc1_experts_weights"], 2 * I, H, bits),
               fc2_experts_weights=_sm80_prepack(w["fc2_experts_weights"], H, I, bits))
    attrs = dict(a) if prepacked is None else dict(a, weights_prepacked=prepacked)
    (node,) = qmoe_nodes(_save(tmp_path, ort, attrs))
    assert "prepacked" in node.layout and "weights_prepacked" not in node.attributes
    for slot in ("fc1_experts_weights", "fc2_experts_weights"):
        np.testing.assert_array_equal(node.weights[slot], w[slot], err_msg=slot)
    describe_layer(node.weights, QMoEAttributes.from_kwargs(**node.attributes))
    # the raw form with weights_prepacked=0 is read as it is
    (raw,) = qmoe_nodes(_save(tmp_path, w, dict(a, weights_prepacked=0)))
    np.testing.assert_array_equal(raw.weights["fc1_experts_weights"], w["fc1_experts_weights"])


def test_prepacked_layouts_that_onnx_runtime_does_not_define_are_refused(tmp_path, rng):
    w, a = random_layer(rng, E=2, H=64, I=64, bits=2, block_size=32, activation_type="swiglu", swiglu_fusion=1)
    with pytest.raises(QMoEUnsupportedError, match="moe weights_prepacked=1"):
        qmoe_nodes(_save(tmp_path, w, dict(a, weights_prepacked=1)))
    with pytest.raises(QMoEInputError, match="moe weights_prepacked"):
        qmoe_nodes(_save(tmp_path, w, dict(a, weights_prepacked=2)))
    with pytest.raises(QMoEInputError, match="K a multiple of 64"):
        unprepack_sm80(np.zeros((1, 32, 64), np.uint8), 128, 32, 4)


# ---- FP4: MXFP4 ("fp4") and NVFP4, codes N-packed [E, K, N/2] ----

def _ort_fp4_dense(packed_kn, scales, g, qt):
    """float64 [E, N, K] of ONNX Runtime's FP4 form: codes [E, K, N/2] (even N low), block scales
    [E, N, K/bs], global scale [E] multiplying."""
    codes = _nibbles(packed_kn).transpose(0, 2, 1)                               # [E, N, K]
    s = scales.view(np.uint8)
    if qt == "fp4":
        block = 2.0 ** (s.astype(np.float64) - 127)
    else:
        block = s.view(_e4m3()).astype(np.float64)
    bs = 32 if qt == "fp4" else 16
    return E2M1[codes] * np.repeat(block, bs, axis=2) * g.astype(np.float64)[:, None, None]


def _e4m3():
    import ml_dtypes

    return ml_dtypes.float8_e4m3fn


def _fp4_case(rng, qt, g1, g2, E=4, H=64, I=32):
    bs = 32 if qt == "fp4" else 16
    w, scale_type = {}, TensorProto.FLOAT8E8M0 if qt == "fp4" else TensorProto.FLOAT8E4M3FN
    for p, N, K, g in (("fc1", 2 * I, H, g1), ("fc2", H, I, g2)):
        w[f"{p}_experts_weights"] = rng.integers(0, 256, (E, K, N // 2), dtype=np.uint8)
        if qt == "fp4":
            w[f"{p}_scales"] = rng.integers(118, 136, (E, N, K // bs), dtype=np.uint8)
        else:  # finite e4m3 bytes (no 0x7F / 0xFF), positive
            w[f"{p}_scales"] = rng.integers(0x20, 0x50, (E, N, K // bs), dtype=np.uint8)
        w[f"{p}_global_scale"] = np.asarray(g, np.float32)
    attrs = dict(k=2, activation_type="swiglu", swiglu_fusion=1, expert_weight_bits=4, quant_type=qt,
                 normalize_routing_weights=1)
    return w, attrs, {"fc1_scales": scale_type, "fc2_scales": scale_type}


def _imported_dense(node, p):
    w = node.weights
    return dequantize_fp4(node.attributes["quant_type"], w[f"{p}_experts_weights"], w[f"{p}_scales"],
                          w.get(f"{p}_global_scale")).astype(np.float64)


@pytest.mark.parametrize("g1,g2", [([1, 1, 1, 1], [1, 1, 1, 1]), ([0.5, 4, 1, 0.125], [2, 1, 0.25, 8])])
def test_mxfp4_fp4_reads_transposed_with_the_global_scale_folded(tmp_path, rng, g1, g2):
    w, attrs, types = _fp4_case(rng, "fp4", g1, g2)
    (node,) = qmoe_nodes(_save(tmp_path, w, attrs, types))
    assert node.attributes["quant_type"] == "mxfp4" and node.attributes["block_size"] == 32
    assert "fc1_global_scale" not in node.weights
    for p in ("fc1", "fc2"):
        want = _ort_fp4_dense(w[f"{p}_experts_weights"], w[f"{p}_scales"], w[f"{p}_global_scale"], "fp4")
        np.testing.assert_array_equal(_imported_dense(node, p), want, err_msg=p)
    describe_layer(node.weights, QMoEAttributes.from_kwargs(**node.attributes))


def test_mxfp4_global_scales_that_cannot_fold_exactly_are_refused(tmp_path, rng):
    w, attrs, types = _fp4_case(rng, "fp4", [1, 0.3, 1, 1], [1, 1, 1, 1])
    with pytest.raises(QMoEUnsupportedError, match="moe fc1_global_scale.*powers of two"):
        qmoe_nodes(_save(tmp_path, w, attrs, types))
    w, attrs, types = _fp4_case(rng, "fp4", [1, 1, 1, 1], [2.0**-130, 1, 1, 1])
    with pytest.raises(QMoEUnsupportedError, match="moe fc2_global_scale.*0..254"):
        qmoe_nodes(_save(tmp_path, w, attrs, types))
    w, attrs, types = _fp4_case(rng, "fp4", [1, 1, 1, 1], [1, 1, 1, 1])
    with pytest.raises(QMoEUnsupportedError, match="moe quant_type='wfp4afp8'"):
        qmoe_nodes(_save(tmp_path, w, dict(attrs, quant_type="wfp4afp8"), types))
    del w["fc2_global_scale"]
    with pytest.raises(QMoEInputError, match="moe fc2_global_scale"):
        qmoe_nodes(_save(tmp_path, w, attrs, types))


@pytest.mark.parametrize("prepacked", [None, 0, 1])
def test_nvfp4_n_packed_and_k_packed_read_exactly(tmp_path, rng, prepacked):
    g1, g2 = rng.uniform(0.001, 0.01, 4), rng.uniform(0.001, 0.01, 4)
    w, attrs, types = _fp4_case(rng, "nvfp4", g1, g2)
    ort = dict(w)
    if prepacked == 1:  # K-packed row-major [E, N, K/2] bytes, kept under the [E, K, N/2] shape
        for p in ("fc1", "fc2"):
            kn = w[f"{p}_experts_weights"]
            ort[f"{p}_experts_weights"] = (_nibbles(kn).transpose(0, 2, 1).reshape(kn.shape[0], -1, 2)
                                           @ np.array([1, 16])).astype(np.uint8).reshape(kn.shape)
        attrs["weights_prepacked"] = 1
    elif prepacked == 0:
        attrs["weights_prepacked"] = 0
    (node,) = qmoe_nodes(_save(tmp_path, ort, attrs, types))
    assert node.attributes["quant_type"] == "nvfp4" and node.attributes["block_size"] == 16
    for p in ("fc1", "fc2"):
        want = _ort_fp4_dense(w[f"{p}_experts_weights"], w[f"{p}_scales"], w[f"{p}_global_scale"], "nvfp4")
        np.testing.assert_allclose(_imported_dense(node, p), want, rtol=2**-23, err_msg=p)  # float32 e4m3·g
    describe_layer(node.weights, QMoEAttributes.from_kwargs(**node.attributes))


# ---- INT3 (weights_prepacked=0): the contract's layout; onnxruntime's CPU kernel runs it ----

def test_int3_models_match_onnxruntime(tmp_path, rng):
    ort = pytest.importorskip("onnxruntime", minversion="1.32")
    from qmoe_rtc.contract.reference import qmoe as reference

    from support.ort_oracle import run_ort_qmoe

    w, a = random_layer(rng, E=4, H=64, I=64, k=2, bits=3, block_size=32, activation_type="swiglu",
                        swiglu_fusion=1, dtype="float16", normalize_routing_weights=1,
                        activation_alpha=1.702, activation_beta=1.0, swiglu_limit=7.0)
    (node,) = qmoe_nodes(_save(tmp_path, w, dict(a, weights_prepacked=0)))
    assert node.layout == "raw" and node.attributes.keys() == a.keys()
    assert all(np.isclose(node.attributes[n], v) if isinstance(v, float) else node.attributes[n] == v
               for n, v in a.items())  # ONNX stores float attributes in float32
    for slot, arr in w.items():
        if arr is not None:
            np.testing.assert_array_equal(node.weights[slot], arr, err_msg=slot)
    x = rng.standard_normal((6, 64)).astype(np.float16)
    logits = (rng.permutation(4)[None, :] + rng.uniform(0, 0.4, (6, 4))).astype(np.float16)
    ours = reference(x, logits, **node.weights, **node.attributes).astype(np.float64)
    try:
        theirs = run_ort_qmoe({"input": x, "router_probs": logits, **node.weights}, weights_prepacked=0,
                              **node.attributes).astype(np.float64)
    except ort.capi.onnxruntime_pybind11_state.Fail as exc:  # pragma: no cover - depends on the ORT build
        pytest.skip(f"onnxruntime CPU does not run this INT3 node: {exc}")
    rel = np.linalg.norm(ours - theirs) / np.linalg.norm(theirs)
    assert rel <= 5e-3, f"relative error {rel:.2e} against onnxruntime (it rounds 3-bit intermediates to T)"


def test_legacy_swiglu_without_fusion_attribute_reads_as_interleaved(tmp_path, rng):
    w, a = random_layer(rng, E=2, H=64, I=64, bits=4, block_size=32, activation_type="swiglu", swiglu_fusion=1)
    legacy = {k: v for k, v in a.items() if k != "swiglu_fusion"}
    (node,) = qmoe_nodes(_save(tmp_path, w, dict(legacy, weights_prepacked=0)))
    assert node.attributes["swiglu_fusion"] == 1
