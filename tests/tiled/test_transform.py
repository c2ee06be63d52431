"""The tiled weight layout (qmoe_rtc/tiled/transform.py) on the CPU: the packing is a bijection of the contract
codes for every bit width, block size and zero-point mode; its addresses are the device's (CodeRows in
core/codes.cuh); its pair order is what the dequantization reads; and the choice to tile a layer."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from qmoe_rtc.contract import QMoEAttributes, describe_layer
from qmoe_rtc.contract.random_layer import random_layer
from qmoe_rtc.errors import QMoEAttributeError, QMoEInputError, QMoEUnsupportedError
from qmoe_rtc.kernels import choose, get_family
from qmoe_rtc.runtime.layer import executor_config, layer_config, tiling_unsupported, use_tiled
from qmoe_rtc.specialize import Layout, ModelConfig
from qmoe_rtc.tiled.transform import (
    meta_record_bytes,
    meta_shape,
    pack,
    pack_meta,
    segment_order,
    tile,
    tile_rows,
    tiled_offset,
    tiled_shape,
    unpack,
    unpack_meta,
    untile,
)


def _code(buf: np.ndarray, c: int, bits: int) -> int:
    """Code c of a little-endian bit string (the contract's packing)."""
    v = 0
    for b in range(bits):
        bit = c * bits + b
        v |= ((int(buf[bit >> 3]) >> (bit & 7)) & 1) << b
    return v


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("block_size, zero_points", [(0, False), (16, True), (32, False), (128, True)])
def test_pack_round_trips_every_projection(rng, bits, block_size, zero_points):
    """pack then unpack gives back every projection's codes, FC1's interleaved tile rows included, whether the
    pair order runs over a whole expert or a row group at a time; scales and zero points are not part
    of the tiled array (they stay in the contract layout)."""
    if bits == 1 and block_size == 16:
        block_size = 32  # 1-bit codes with blocks of 16: not a tensor-core layout
    fusion = 1 if bits != 3 else 2
    w, a = random_layer(rng, E=3, H=384, I=96 if block_size <= 32 else 128, k=2, bits=bits, block_size=block_size,
                        zero_points=zero_points, dtype="bfloat16", activation_type="swiglu", swiglu_fusion=fusion)
    layer = describe_layer(w, QMoEAttributes.from_kwargs(**a))
    for p in layer.projections():
        codes = w[f"{p.name}_experts_weights"]
        interleaved = fusion if p.name == "fc1" else 0
        t = pack(np, codes, p.K, bits, interleaved)
        assert t.shape == tiled_shape(layer.E, p.N, p.K, bits) and t.dtype == np.uint8
        np.testing.assert_array_equal(unpack(np, t, p.N, p.K, bits, interleaved), codes)
        # the pair order done a row group at a time (bounded temporaries at upload): the same bytes
        np.testing.assert_array_equal(pack(np, codes, p.K, bits, interleaved, order_bytes=1), t)
        np.testing.assert_array_equal(unpack(np, t, p.N, p.K, bits, interleaved, order_bytes=1), codes)


def _zero_point(zp, e: int, n: int, j: int, bits: int, row_wise: bool) -> int:
    """Contract zero point of expert e, row n, block j (packed along N row-wise, else along the blocks)."""
    return _code(zp[e], n, bits) if row_wise else _code(zp[e, n], j, bits)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("block_size, zero_points", [(0, True), (0, False), (16, True), (32, False), (128, True)])
@pytest.mark.parametrize("scale_dtype", ["float16", "bfloat16", "float32"])
def test_meta_records_hold_each_rows_scale_and_zero_point_where_the_device_reads(rng, bits, block_size, zero_points,
                                                                                 scale_dtype):
    """pack_meta puts the scale and zero point of expert e, row n, block j in the record and half the
    device computes (core/dequant.cuh QuantParams::meta_record / meta_half, mirrored here), for every
    projection (interleaved FC1 rows included), and unpack_meta inverts it."""
    if bits == 1 and block_size == 16:
        block_size = 32
    fusion = 1 if bits != 3 else 2
    w, a = random_layer(rng, E=2, H=256, I=96 if block_size <= 32 else 128, k=2, bits=bits, block_size=block_size,
                        zero_points=zero_points, dtype="bfloat16" if scale_dtype != "float16" else "float16",
                        scale_dtype=scale_dtype, activation_type="swiglu", swiglu_fusion=fusion)
    layer = describe_layer(w, QMoEAttributes.from_kwargs(**a))
    for p in layer.projections():
        s, z = w[p.scale_input], w.get(f"{p.name}_zero_points")
        interleaved = fusion if p.name == "fc1" else 0
        row_wise = s.ndim == 2
        nb = 1 if row_wise else s.shape[2]
        meta = pack_meta(np, s, z, p.N, bits, interleaved)
        sb = s.dtype.itemsize
        assert meta.shape == meta_shape(layer.E, p.N, nb, sb, z is not None) and meta.dtype == np.uint8
        rec = meta_record_bytes(sb, z is not None)
        flat = meta.reshape(-1)
        for _ in range(64):
            e, n, j = int(rng.integers(layer.E)), int(rng.integers(p.N)), int(rng.integers(nb))
            # the device's tile_row of the fusion-1 row it reads (fusion 2's row n is fusion 1's row 2o + h)
            o, h = (n // 2, n % 2) if interleaved == 1 else (n % layer.I, n // layer.I)
            m = 16 * (o // 8) + 8 * h + o % 8 if interleaved else n
            at = (((e * -(-p.N // 16) + m // 16) * nb + j) * 8 + m % 8) * rec
            h = (m // 8) % 2
            want = s[e, n] if row_wise else s[e, n, j]
            assert flat[at + h * sb: at + (h + 1) * sb].tobytes() == np.asarray(want).tobytes()
            if z is not None:
                assert flat[at + 2 * sb + h] == _zero_point(z, e, n, j, bits, row_wise)
        back_s, back_z = unpack_meta(np, meta, p.N, s.dtype, interleaved, row_wise)
        np.testing.assert_array_equal(back_s.view(np.uint8), s.view(np.uint8))
        if z is not None:
            for e in range(layer.E):
                for n in range(0, p.N, 7):
                    for j in range(nb):
                        assert back_z[e, n, j] == _zero_point(z, e, n, j, bits, row_wise)


@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("fusion", [0, 1])
def test_row_wise_scales_given_as_e_n_1_pack_like_e_n(rng, bits, fusion):
    """Row-wise scales may come as [E, N, 1] (the contract allows it); their zero points are still packed
    along N, [E, ceil(N·b/8)]: the records are those of the same scales as [E, N] (a raw reshape error
    on such layers before: the block-wise unpacking was chosen from the scales' rank)."""
    w, a = random_layer(rng, E=8, H=64, I=32, k=2, bits=bits, block_size=0, zero_points=True, dtype="float16",
                        activation_type="swiglu" if fusion else "relu", swiglu_fusion=fusion)
    layer = describe_layer({**w, "fc1_scales": w["fc1_scales"][..., None]}, QMoEAttributes.from_kwargs(**a))
    for p in layer.projections():
        s, z = w[p.scale_input], w[f"{p.name}_zero_points"]
        want = pack_meta(np, s, z, p.N, bits, fusion if p.name == "fc1" else 0)
        got = pack_meta(np, s[..., None], z, p.N, bits, fusion if p.name == "fc1" else 0, row_wise=not p.block_size)
        np.testing.assert_array_equal(got, want)
    with pytest.raises(QMoEInputError, match="row-wise"):
        pack_meta(np, np.ones((2, 16, 2), np.float16), None, 16, 4, row_wise=True)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("interleaved", [0, 1, 2])
@pytest.mark.parametrize("K", [128, 160, 2880])
def test_tile_moves_every_segment_once_to_the_device_address(bits, interleaved, K):
    """Tiling an array of byte indices: every contract byte lands exactly once (the rest is zero
    padding), and segment s of tile row m lands at tiled_offset (the device's CodeRows)."""
    E, N = 2, 32
    kb = K * bits // 8
    idx = np.arange(1, E * N * kb + 1, dtype=np.int64).reshape(E, N, kb)
    t = tile(np, idx, K, bits, interleaved)
    flat = t.reshape(-1)
    moved = flat[flat > 0]
    assert moved.size == idx.size and np.unique(moved).size == idx.size
    np.testing.assert_array_equal(untile(np, t, N, K, bits, interleaved), idx)
    rows = tile_rows(N, interleaved)
    seg = 4 * bits
    for e in range(E):
        for m in range(0, N, 3):
            for s in range(K // 32):
                off = tiled_offset(e, N, m, K, bits, s)
                np.testing.assert_array_equal(flat[off:off + seg], idx[e, rows[m], s * seg:(s + 1) * seg])


def test_interleaved_tile_rows_pair_gate_and_linear_groups():
    """Outputs 8p..8p+7: their gate rows (2o; fusion 2: o) fill one row group, their linear rows (2o + 1;
    fusion 2: I + o) the next. Rows that do not make whole 16-row tiles are refused, not dropped."""
    rows = tile_rows(32, 1)
    assert rows[:8] == [0, 2, 4, 6, 8, 10, 12, 14] and rows[8:16] == [1, 3, 5, 7, 9, 11, 13, 15]
    assert sorted(rows) == list(range(32))
    rows = tile_rows(32, 2)
    assert rows[:8] == list(range(8)) and rows[8:16] == list(range(16, 24)) and rows[16:24] == list(range(8, 16))
    assert sorted(rows) == list(range(32))
    for bad in (dict(N=40, fusion=1), dict(N=24, fusion=2), dict(N=32, fusion=3)):
        with pytest.raises(QMoEInputError, match="FC1 rows"):
            tile_rows(**bad)


def _as_fusion1(w: dict, I: int) -> dict:
    """A swiglu_fusion=2 layer's FC1 arrays with their rows in fusion 1's order (gate o -> 2o, linear I + o
    -> 2o + 1): the same layer for swiglu_fusion=1."""
    perm = np.arange(2 * I).reshape(2, I).T.reshape(-1)  # fusion-1 row r holds fusion-2 row perm[r]
    out = dict(w)
    for n in ("fc1_experts_weights", "fc1_scales", "fc1_experts_bias"):
        out[n] = np.ascontiguousarray(w[n][:, perm])
    if w.get("fc1_zero_points") is not None:  # block-wise: packed along the blocks of a row
        out["fc1_zero_points"] = np.ascontiguousarray(w["fc1_zero_points"][:, perm])
    return out


@pytest.mark.parametrize("bits, block_size", [(4, 128), (3, 32), (8, 0), (2, 16)])
def test_fusion2_fc1_tiles_as_fusion1(rng, bits, block_size):
    """Tiled FC1 codes and meta records of a swiglu_fusion=2 layer are the bytes of the same layer in
    fusion 1's row order, whose bias is fusion1_order's; and that fusion-1 layer computes what the fusion-2
    one does (float64 reference): so the engines, which read tiled fusion 2 as fusion 1 (gate_of), are
    right by construction."""
    from qmoe_rtc.contract.reference import qmoe as reference
    from qmoe_rtc.tiled.transform import fusion1_order

    zp = block_size != 0
    w, a = random_layer(rng, E=3, H=256, I=128, k=2, bits=bits, block_size=block_size, zero_points=zp,
                        dtype="float32", activation_type="swiglu", swiglu_fusion=2, bias=True)
    w1 = _as_fusion1(w, 128)
    K, N = 256, 256
    np.testing.assert_array_equal(pack(np, w["fc1_experts_weights"], K, bits, 2),
                                  pack(np, w1["fc1_experts_weights"], K, bits, 1))
    z, z1 = w.get("fc1_zero_points"), w1.get("fc1_zero_points")
    np.testing.assert_array_equal(pack_meta(np, w["fc1_scales"], z, N, bits, 2), pack_meta(np, w1["fc1_scales"], z1, N, bits, 1))
    np.testing.assert_array_equal(fusion1_order(np, w["fc1_experts_bias"]), w1["fc1_experts_bias"])
    x = rng.standard_normal((5, 256)).astype(np.float32)
    logits = rng.standard_normal((5, 3)).astype(np.float32)
    want = reference(x, logits, **w, **a)
    got = reference(x, logits, **w1, **{**a, "swiglu_fusion": 1})
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_pair_order_puts_natural_neighbours_where_the_shifts_read(rng, bits):
    """The device dequantizes pair i from stored positions first_code(i) and first_code(i) + P
    (core/mma_pair.cuh); after packing those hold natural codes 2i and 2i + 1 of the same segment."""
    order = 4 if bits == 3 else bits
    P, C = 16 // order, 32 // order
    assert sorted(segment_order(bits)) == list(range(32))
    E, N, K = 2, 16, 256
    codes = rng.integers(0, 256, (E, N, K * bits // 8), dtype=np.uint8)
    t = pack(np, codes, K, bits).reshape(-1)
    for e, m, s in ((0, 0, 0), (1, 13, 7), (1, 8, 3)):
        off = tiled_offset(e, N, m, K, bits, s)
        stored, natural = t[off:off + 4 * bits], codes[e, m, s * 4 * bits:(s + 1) * 4 * bits]
        for i in range(16):
            first = (i // P) * C + i % P
            assert _code(stored, first, bits) == _code(natural, 2 * i, bits)
            assert _code(stored, first + P, bits) == _code(natural, 2 * i + 1, bits)


def test_tile_refuses_what_it_cannot_tile():
    with pytest.raises(QMoEInputError, match="multiple of 32"):
        tile(np, np.zeros((1, 8, 10), np.uint8), 40, 2)
    with pytest.raises(QMoEInputError, match=r"shape \[E, N, 64\]"):
        tile(np, np.zeros((1, 8, 60), np.uint8), 128, 4)
    with pytest.raises(QMoEInputError, match="multiple of 8"):
        tile(np, np.zeros((1, 12, 64), np.uint8), 128, 4)
    with pytest.raises(QMoEInputError, match="tiled weights"):
        untile(np, np.zeros((1, 1, 1, 8, 4, 16), np.uint8), 8, 256, 4)


BF16 = Layout(dtype="bfloat16", fc1_bits=4, fc2_bits=4, block_size=128, activation="swiglu", swiglu_fusion=1)


def _config(layout=BF16, **kw):
    return ModelConfig(hidden=256, inter=128, experts=8, k=2, layout=layout, **kw)


def test_use_tiled_follows_the_setting_and_what_the_layer_allows():
    cfg = _config()
    assert use_tiled(cfg, "auto", True) and not use_tiled(cfg, "auto", False)  # dtype unknown: may be float32
    assert use_tiled(cfg, "on", False) and use_tiled(cfg, True, False) and not use_tiled(cfg, "off", True)
    f32 = _config(dataclasses.replace(BF16, dtype="float32", scale_dtype="float32"))
    assert tiling_unsupported(f32) is not None and not use_tiled(f32, "auto", True)
    with pytest.raises(QMoEUnsupportedError, match="prepack='on'"):
        use_tiled(f32, "on", True)
    with pytest.raises(QMoEAttributeError, match="prepack"):
        use_tiled(cfg, "sometimes", True)


def test_tiled_layers_run_only_on_tensor_core_engines():
    """The SIMT families refuse tiled codes, so a tiled layer's paths are the tensor-core pipelines, and
    the warm tool's config for a layer with scales in T is the tiled one (what the executor runs)."""
    tiled = executor_config(_config())
    assert tiled.layout.tiled and not executor_config(_config(), "off").layout.tiled
    assert not executor_config(_config(dataclasses.replace(BF16, scale_dtype="float32"))).layout.tiled
    assert "prepacked" in get_family("gemv").supports(tiled) and "prepacked" in get_family("gemm").supports(tiled)
    assert choose(tiled, None, "decode").pipeline.name == "decode-mma"
    assert choose(tiled, None, "prefill").pipeline.name == "prefill-wgmma"  # the first (device unknown)
    for fam in ("mma_decode", "mma_batched", "mma_prefill", "wgmma_prefill"):
        spec = get_family(fam).spec(tiled)
        assert spec["tiled"] is True and "-DQMOE_TILED=1" in get_family(fam).defines(spec)
        assert "tiled" not in get_family(fam).spec(_config()).as_dict()  # contract modules keep their keys


def test_layer_config_carries_tiled(rng):
    w, a = random_layer(rng, E=4, H=128, I=64, k=2, bits=4, block_size=64, dtype="float16")
    layer = describe_layer(w, QMoEAttributes.from_kwargs(**a))
    assert layer_config(layer, "float16", "float16", tiled=True).layout.tiled
    assert not layer_config(layer, "float16", "float16").layout.tiled


@pytest.mark.parametrize("fmt, fc1_zp, tiled, want", [
    ("int", "none", True, "qmoe::GATE_FUSED1"), ("int", "packed", True, "qmoe::GATE_FUSED1"),
    ("mxfp4", "none", True, "qmoe::GATE_FUSED1"), ("int", "none", False, "qmoe::GATE_FUSED2"),
    ("fp8_e4m3", "none", True, "qmoe::GATE_FUSED2"), ("fp8_e4m3", "none", False, "qmoe::GATE_FUSED2")])
def test_fusion2_kernels_read_tiled_fc1_as_fusion1(fmt, fc1_zp, tiled, want):
    """The kernels' GATE follows where prepack put FC1's rows (fc1_fusion): tiled integer and FP4 codes of
    swiglu_fusion=2 compile as fusion 1, the contract layout and tiled FP8 codes as fusion 2."""
    from qmoe_rtc.kernels._expert import expert_spec, template_types, tiled_spec
    from qmoe_rtc.tiled.transform import fc1_fusion

    bits = {"fp8_e4m3": 8}.get(fmt, 4)
    lay = Layout(dtype="bfloat16", scale_dtype="float32" if fmt != "int" else "", fc1_bits=bits, fc2_bits=bits,
                 fc1_zp=fc1_zp, fc2_zp=fc1_zp, fc1_format=fmt, fc2_format=fmt, block_size=32 if fmt == "mxfp4" else 128,
                 activation="swiglu", swiglu_fusion=2, tiled=tiled)
    cfg = ModelConfig(hidden=256, inter=256, experts=4, k=2, layout=lay)
    spec = expert_spec("mma_prefill", cfg, **tiled_spec(cfg))
    assert template_types(spec)["GATE"] == want
    assert (want == "qmoe::GATE_FUSED1") == (tiled and fc1_fusion(2, lay.format("fc1").scale.square) != 0)
