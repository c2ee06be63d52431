"""Checkpoints of grouped sigmoid routers (CPU): DeepSeek-V3, Kimi-K2, GLM-4.5 and GLM-4.5V-style models written here
in their real tools' layouts (DeepSeek-V3's FP8 blocks with float32 ``weight_scale_inv``, Kimi-K2-Thinking's
compressed-tensors int4, an AWQ GLM-4.5; ``mlp.gate.e_score_correction_bias`` float32, ``mlp.shared_experts``, a dense
first layer), loaded into layers whose float64 reference output equals a NumPy transcription of the models' own
router and MLPs (transformers' DeepseekV3TopkRouter / Glm4MoeTopkRouter: sigmoid, bias, groups by their two best
scores, masked to 0.0, top k, ``/ (sum + 1e-20)``, ``* routed_scaling_factor``; DeepseekV3MLP) on the dense weights
the test quantized from; in this process and in a fresh one, through ``load_layer`` and the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from ml_dtypes import bfloat16, float8_e4m3fn

from qmoe_rtc.checkpoints import load_layer, moe_layers
from qmoe_rtc.checkpoints.formats import AWQ_ORDER
from qmoe_rtc.contract import QMoEAttributes
from qmoe_rtc.contract.reference import qmoe as reference
from qmoe_rtc.errors import QMoEInputError, QMoEUnsupportedError
from qmoe_rtc.runtime.layer import describe_gpu_layer

from support.hf_models import pack_along

save_file = pytest.importorskip("safetensors.numpy").save_file

ROOT = Path(__file__).resolve().parents[2]
H, I, E, K_TOP, DENSE_I = 64, 32, 16, 4, 64  # noqa: E741
NAMES = ("gate_proj", "up_proj", "down_proj")
#: style -> (model_type, quantization, routing fields of config.json as the model's hub config spells them)
STYLES = {
    "deepseek_v3": ("deepseek_v3", "fp8", dict(n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                                               scoring_func="sigmoid", topk_method="noaux_tc")),
    "kimi_k2": ("kimi_k2", "compressed-tensors", dict(n_group=1, topk_group=1, routed_scaling_factor=2.827,
                                                     norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc")),
    "glm4_moe": ("glm4_moe", "awq", dict(n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True)),
    "glm4v_moe": ("glm4v_moe", "awq", dict(n_group=2, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=False)),
}
QUANT = {
    "fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 32]},
    "compressed-tensors": {"quant_method": "compressed-tensors", "format": "pack-quantized", "version": "0.19.0",
                           "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                               "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}},
                           "ignore": ["lm_head", "re:.*self_attn.*", "re:.*mlp.gate$"]},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True},
}


def _projection(tensors: dict, p: str, method: str, rng, N: int, K: int) -> np.ndarray:
    """Write projection ``p`` [N, K] in ``method``'s storage; returns its dense float64 weights."""
    nb = K // 32
    if method == "fp8":  # e4m3 codes (no NaN) times float32 block scales of 32 x 32
        q = rng.integers(0, 256, size=(N, K)).astype(np.uint8)
        q[(q & 0x7F) >= 0x78] = 0x38  # no NaN, magnitudes up to 240
        s = (rng.integers(128, 384, size=(N // 32, nb)) * 2.0**-16).astype(np.float32)  # 9 bits: exact products
        w = q.view(float8_e4m3fn)
        tensors[f"{p}.weight"], tensors[f"{p}.weight_scale_inv"] = w, s
        return w.astype(np.float64) * np.repeat(np.repeat(s, 32, 0), 32, 1)
    q = rng.integers(0, 16, size=(N, K))
    s = (rng.random((N, nb)) * 0.02 + 0.002).astype(bfloat16)
    z = np.full((N, nb), 8) if method == "compressed-tensors" else rng.integers(1, 16, size=(N, nb))
    if method == "compressed-tensors":
        tensors[f"{p}.weight_packed"] = pack_along(q, 4, 1)  # [N, K/8]
        tensors[f"{p}.weight_scale"] = s  # [N, nb]
        tensors[f"{p}.weight_shape"] = np.array([N, K], dtype=np.int32)
    else:  # AWQ GEMM
        tensors[f"{p}.qweight"] = pack_along(q.T, 4, 1, AWQ_ORDER)  # [K, N/8]
        tensors[f"{p}.qzeros"] = pack_along(z.T, 4, 1, AWQ_ORDER)  # [nb, N/8]
        tensors[f"{p}.scales"] = np.ascontiguousarray(s.T)  # [nb, N]
    return ((q.reshape(N, nb, 32) - z[..., None]) * s.astype(np.float64)[..., None]).reshape(N, K)


def write_grouped(path: Path, rng, style: str, *, drop=(), config=None) -> dict:
    """A three-layer checkpoint of ``style`` (STYLES) at ``path``: layer 0 a dense MLP (first_k_dense_replace 1),
    layers 1 and 2 MoE with E routed experts, one shared expert, the router's bfloat16 weight and float32
    e_score_correction_bias. ``drop``: tensor-name suffixes left out; ``config``: config.json fields changed.
    Returns {layer: {'experts': [E] of (g, u, d), 'shared': (g, u, d), 'bias', 'gate'}} in float64."""
    model_type, method, routing = STYLES[style]
    root = "model.language_model.layers" if style == "glm4v_moe" else "model.layers"
    tensors, dense = {}, {}
    for j, (N, K) in enumerate(((DENSE_I, H), (DENSE_I, H), (H, DENSE_I))):
        _projection(tensors, f"{root}.0.mlp.{NAMES[j]}", method, rng, N, K)
    for L in (1, 2):
        block = f"{root}.{L}.mlp"
        mlp = [tuple(_projection(tensors, f"{p}.{n}", method, rng, *nk) for n, nk in
                     zip(NAMES, ((I, H), (I, H), (H, I)))) for p in [f"{block}.experts.{e}" for e in range(E)] +
               [f"{block}.shared_experts"]]
        gate = (rng.standard_normal((E, H)) * 0.1).astype(bfloat16)
        bias = (0.1 * rng.standard_normal(E)).astype(np.float32)
        tensors[f"{block}.gate.weight"], tensors[f"{block}.gate.e_score_correction_bias"] = gate, bias
        dense[L] = dict(experts=mlp[:E], shared=mlp[E], bias=bias.astype(np.float64), gate=gate.astype(np.float64))
    tensors = {n: t for n, t in tensors.items() if not any(n.endswith(d) for d in drop)}
    save_file(tensors, str(path / "model.safetensors"))
    text = dict(hidden_size=H, intermediate_size=DENSE_I, moe_intermediate_size=I, n_routed_experts=E,
                n_shared_experts=1, num_experts_per_tok=K_TOP, first_k_dense_replace=1, num_hidden_layers=3,
                hidden_act="silu", **routing)
    cfg = {"model_type": model_type, "quantization_config": QUANT[method]}
    if style == "glm4v_moe":  # transformers' Glm4vMoeConfig: the text model's fields in text_config
        cfg["text_config"] = dict(model_type="glm4v_moe_text", **text)
    else:
        cfg.update(text, architectures=["DeepseekV3ForCausalLM" if style != "glm4_moe" else "Glm4MoeForCausalLM"])
    for key, v in (config or {}).items():
        target = cfg["text_config"] if style == "glm4v_moe" and key in text else cfg
        if v is None:
            target.pop(key, None)
        else:
            target[key] = v
    (path / "config.json").write_text(json.dumps(cfg))
    return dense


def _mlp(x, g, u, d):
    """DeepseekV3MLP / Glm4MoeMLP: down(silu(gate x) * up x), in float64."""
    a, b = x @ g.T, x @ u.T
    return (a / (1.0 + np.exp(-a)) * b) @ d.T


def transformers_moe(x, logits, layer: dict, routing: dict, k: int = K_TOP, fill: float = 0.0) -> np.ndarray:
    """The model's MoE block on float64 ``x`` [rows, H] and router ``logits`` [rows, E], as transformers' router
    computes it (``fill``: the choice score of dropped groups' experts; DeepSeek-V3's own inference code: -inf)."""
    G, g, rsf = routing["n_group"], routing["topk_group"], routing["routed_scaling_factor"]
    s = 1.0 / (1.0 + np.exp(-logits))
    choice = s + layer["bias"]
    group_score = np.sort(choice.reshape(len(x), G, E // G), axis=-1)[..., -2:].sum(-1)  # [rows, G]
    kept = np.zeros_like(group_score, dtype=bool)
    np.put_along_axis(kept, np.argsort(-group_score, axis=-1, kind="stable")[:, :g], True, axis=-1)
    choice = np.where(np.repeat(kept, E // G, axis=-1), choice, fill)
    idx = np.argsort(-choice, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(s, idx, axis=-1)
    if routing["norm_topk_prob"]:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    w = w * rsf
    out = np.zeros_like(x)
    for r in range(len(x)):
        for j in range(k):
            out[r] += w[r, j] * _mlp(x[r:r + 1], *layer["experts"][idx[r, j]])[0]
    return out + _mlp(x, *layer["shared"])


def widened(weights: dict) -> dict:
    """The layer with its 16-bit scales as float32 (exactly): the reference then rounds its output to float32."""
    return {n: a.astype(np.float32) if n.endswith("scales") and a.dtype != np.float32 else a for n, a in weights.items()}


@pytest.mark.parametrize("style", sorted(STYLES))
def test_grouped_checkpoints_compute_the_models_moe_block(tmp_path, rng, style):
    dense = write_grouped(tmp_path, rng, style)
    model_type, _, routing = STYLES[style]
    assert moe_layers(tmp_path) == [1, 2]  # layer 0 is dense
    for L in (1, 2):
        layer = load_layer(tmp_path, L)
        w, a = layer.weights, layer.attributes
        assert layer.model_type == model_type and a["scoring_func"] == "sigmoid" and a["k"] == K_TOP
        assert (a["n_group"], a["topk_group"]) == (routing["n_group"], routing["topk_group"])
        assert a["routed_scaling_factor"] == routing["routed_scaling_factor"]
        assert a["normalize_routing_weights"] == int(routing["norm_topk_prob"])
        assert w["router_score_bias"].dtype == np.float32 and w["router_score_bias"].shape == (E,)
        np.testing.assert_array_equal(w["router_score_bias"], dense[L]["bias"])
        assert layer.source["router_score_bias"].endswith(f"layers.{L}.mlp.gate.e_score_correction_bias")
        assert layer.router_weight.shape == (E, H)
        ext = describe_gpu_layer(w, QMoEAttributes.from_kwargs(**a), {}).ext  # as QMoE() validates it, GPU-free
        assert ext.score_bias and ext.S == 1 and not ext.gate  # one shared expert, no shared gate (DeepSeek)
        x = rng.standard_normal((64, H))
        logits = (x @ dense[L]["gate"].T).astype(np.float32)  # the router's float32 logits
        want = transformers_moe(x, logits.astype(np.float64), dense[L], routing)
        got = reference(x.astype(np.float32), logits, **widened(w), **a)
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * np.abs(want).max(), err_msg=f"{style} layer {L}")


def test_the_bias_and_the_groups_change_the_choice(tmp_path, rng):
    """The comparison above would pass if the loader dropped the bias or the groups only where they change
    nothing: on this DeepSeek-V3-style layer each one changes most rows' output."""
    dense = write_grouped(tmp_path, rng, "deepseek_v3")
    w, a = (lambda L: (widened(L.weights), L.attributes))(load_layer(tmp_path, 1))
    x = rng.standard_normal((64, H))
    logits = (x @ dense[1]["gate"].T).astype(np.float32)
    base = reference(x.astype(np.float32), logits, **w, **a)
    no_bias = reference(x.astype(np.float32), logits, **{n: v for n, v in w.items() if n != "router_score_bias"}, **a)
    no_groups = reference(x.astype(np.float32), logits, **w, **{**a, "topk_group": 4})
    for other in (no_bias, no_groups):
        assert (np.abs(other - base).max(axis=-1) > 1e-3 * np.abs(base).max()).mean() > 0.2


def test_dropped_groups_are_left_out_where_transformers_fills_zero():
    """transformers fills the dropped groups' choice scores with 0.0, DeepSeek-V3's inference code (and the
    contract) leaves them out: they differ only where fewer than k kept experts have a positive biased score."""
    from qmoe_rtc.contract.reference import route

    attrs = QMoEAttributes.from_kwargs(k=2, scoring_func="sigmoid", n_group=2, topk_group=1, normalize_routing_weights=1)
    logits = np.array([[4.0, 3.0, -4.0, -4.0]], dtype=np.float32)  # group 0 kept; expert 1's biased score < 0
    bias = np.array([0.0, -0.99, 0.0, 0.0], dtype=np.float32)
    idx, _ = route(logits, attrs, score_bias=bias)
    assert idx.tolist() == [[0, 1]]  # transformers' 0.0 fill would pick expert 2 (a dropped group) second


def test_a_fresh_process_loads_a_grouped_checkpoint_and_the_command_reads_it(tmp_path, rng):
    write_grouped(tmp_path, rng, "deepseek_v3")
    code = (f"from qmoe_rtc.checkpoints import load_layer; L = load_layer({str(tmp_path)!r}, 2); "
            "a = L.attributes; b = L.weights['router_score_bias']; "
            "print(a['scoring_func'], a['n_group'], a['topk_group'], a['routed_scaling_factor'], b.dtype, b.shape[0])")
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["sigmoid", "4", "2", "2.5", "float32", str(E)]
    cli = subprocess.run([sys.executable, "-m", "qmoe_rtc", "checkpoint", str(tmp_path)], capture_output=True,
                         text=True, env=env, timeout=120)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    lines = [line for line in cli.stdout.splitlines() if line.startswith("layer ")]
    assert [line.split(":")[0] for line in lines] == ["layer 1", "layer 2"]
    assert f"deepseek_v3: E={E} H={H} I={I} k={K_TOP} sigmoid top-k in 2 of 4 groups with score bias renormalised " \
           "x2.5, fp8_e4m3 block 32" in lines[0]
    assert "1 shared expert," in lines[0]


def test_a_dense_layer_is_named_not_searched_for_experts(tmp_path, rng):
    write_grouped(tmp_path, rng, "kimi_k2")
    with pytest.raises(QMoEInputError, match=r"layer 0.*MoE layer \(this checkpoint's: 1, 2\).*dense MLP "
                                             r"\(model\.layers\.0\.mlp\.gate_proj"):
        load_layer(tmp_path, 0)


@pytest.mark.parametrize("drop, exc, match", [
    ("layers.1.mlp.gate.e_score_correction_bias", QMoEInputError, r"layers\.1\.mlp\.gate\.e_score_correction_bias"),
    ("layers.1.mlp.shared_experts.gate_proj.scales", QMoEInputError, r"shared_experts\.gate_proj\.scales.*n_shared"),
])
def test_a_missing_bias_or_shared_mlp_is_named(tmp_path, rng, drop, exc, match):
    drop = (drop,) if "bias" in drop else tuple(f"layers.1.mlp.shared_experts.{n}.{t}" for n in NAMES
                                                 for t in ("qweight", "qzeros", "scales"))
    write_grouped(tmp_path, rng, "glm4_moe", drop=drop)
    with pytest.raises(exc, match=match):
        load_layer(tmp_path, 1)


@pytest.mark.parametrize("change, exc, match", [
    (dict(n_group=None), QMoEInputError, "config.json n_group"),
    (dict(routed_scaling_factor=None), QMoEInputError, "config.json routed_scaling_factor"),
    (dict(norm_topk_prob=None), QMoEInputError, "config.json norm_topk_prob"),
    (dict(scoring_func="softmax"), QMoEUnsupportedError, "config.json scoring_func"),
    (dict(topk_method="greedy"), QMoEUnsupportedError, "config.json topk_method"),
    (dict(n_shared_experts=2), QMoEInputError, r"shared_experts\.up_proj|shared_experts\.gate_proj"),
])
def test_config_fields_the_routing_needs_are_named(tmp_path, rng, change, exc, match):
    write_grouped(tmp_path, rng, "deepseek_v3", config=change)
    with pytest.raises(exc, match=match):
        load_layer(tmp_path, 1)


def test_a_score_bias_beside_a_softmax_router_is_refused(tmp_path, rng):
    """A checkpoint with e_score_correction_bias whose config reads as softmax top-k (model type deepseek_v2):
    refused naming the tensor, never loaded without it."""
    write_grouped(tmp_path, rng, "kimi_k2", config=dict(model_type="deepseek_v2", scoring_func=None, topk_method=None,
                                                       n_group=None, topk_group=None, routed_scaling_factor=None))
    with pytest.raises(QMoEUnsupportedError, match="e_score_correction_bias"):
        load_layer(tmp_path, 1)


def _config(model_type: str, **change) -> dict:
    """A config.json of ``model_type`` with DeepSeek-V3's routing fields (E 16, k 4, 4 groups keeping 2)."""
    cfg = dict(model_type=model_type, n_routed_experts=E, num_experts_per_tok=K_TOP, n_shared_experts=1,
               first_k_dense_replace=3, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    cfg.update(change)
    return {n: v for n, v in cfg.items() if v is not None}


@pytest.mark.parametrize("model_type", ["deepseek_v3", "kimi_k2", "glm4_moe", "dots1"])
def test_each_grouped_model_type_reads_its_routing(model_type):
    from qmoe_rtc.checkpoints.model_config import moe_config

    got = moe_config(_config(model_type))
    assert (got.E, got.k, got.normalize, got.score_bias, got.shared, got.first_dense) == (E, K_TOP, 1, True, 1, 3)
    assert got.routing == dict(scoring_func="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5)
    # k = 1: transformers' router renormalises whenever norm_topk_prob; DeepSeek's own code (Kimi-K2's) only for k > 1
    assert moe_config(_config(model_type, num_experts_per_tok=1)).normalize == int(model_type != "kimi_k2")
    assert moe_config(_config(model_type, norm_topk_prob=False)).normalize == 0


def test_multimodal_configs_are_read_in_their_text_config():
    from qmoe_rtc.checkpoints.model_config import moe_config

    text = _config("glm4v_moe_text")
    got = moe_config({"model_type": "glm4v_moe", "text_config": text, "vision_config": {"depth": 2}})
    assert got.model_type == "glm4v_moe" and got.routing["n_group"] == 4 and got.score_bias
    with pytest.raises(QMoEInputError, match="config.json text_config.n_group"):
        moe_config({"model_type": "glm4v_moe", "text_config": {**text, "n_group": None}})
    with pytest.raises(QMoEInputError, match="config.json text_config"):
        moe_config({"model_type": "glm4v_moe", "vision_config": {}})
    qwen = {"model_type": "qwen3_vl_moe", "text_config": dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)}
    assert (lambda c: (c.E, c.k, c.normalize, c.routing))(moe_config(qwen)) == (8, 2, 1, {})


@pytest.mark.parametrize("change, match", [
    (dict(topk_group=5), "config.json topk_group"),
    (dict(n_group=3), "config.json n_group"),  # 16 experts in 3 groups
    (dict(n_group=16, topk_group=1), "config.json n_group"),  # one expert a group: no two best to sum
    (dict(num_experts_per_tok=9), "config.json num_experts_per_tok"),  # more than the 8 experts of 2 kept groups
    (dict(routed_scaling_factor=0), "config.json routed_scaling_factor"),
    (dict(routed_scaling_factor=True), "config.json routed_scaling_factor"),
    (dict(routed_scaling_factor="2.5"), "config.json routed_scaling_factor"),
    (dict(routed_scaling_factor=float("inf")), "config.json routed_scaling_factor"),
    (dict(n_group=0), "config.json n_group"),
    (dict(topk_group=1.5), "config.json topk_group"),
    (dict(norm_topk_prob="yes"), "config.json norm_topk_prob"),
    (dict(n_shared_experts=-1), "config.json n_shared_experts"),
])
def test_bad_routing_values_are_named(change, match):
    from qmoe_rtc.checkpoints.model_config import moe_config

    with pytest.raises(QMoEInputError, match=match):
        moe_config(_config("deepseek_v3", **change))


def test_deepseek_v2s_group_limited_greedy_stays_refused_with_its_reason():
    from qmoe_rtc.checkpoints.model_config import moe_config

    v2 = dict(model_type="deepseek_v2", n_routed_experts=E, num_experts_per_tok=K_TOP, norm_topk_prob=False,
              scoring_func="softmax", topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0)
    assert moe_config(v2).routing == {}  # DeepSeek-V2-Lite: softmax top-k
    with pytest.raises(QMoEUnsupportedError, match="topk_method = 'group_limited_greedy'.*best softmax probability"):
        moe_config({**v2, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2})
    with pytest.raises(QMoEUnsupportedError, match="routed_scaling_factor = 16.0.*sigmoid-scored weights only"):
        moe_config({**v2, "routed_scaling_factor": 16.0})
    for mt, why in (("phimoe", "sparse mixer"), ("llama4", "top-1")):
        with pytest.raises(QMoEUnsupportedError, match=why):
            moe_config({**v2, "model_type": mt})
