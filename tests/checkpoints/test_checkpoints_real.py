"""Checkpoints written by the public quantizers themselves (tests/data/checkpoints, README.md there: which
tool, version and settings wrote each): every one loads, in this process and in a fresh one with
nothing imported beforehand, and its contract inputs dequantize exactly to the tool's own dequantization
(``reference.safetensors``, written by the tool's code in float32). The model configs transformers
writes give each model type's routing, or a refusal naming why."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("safetensors")
from safetensors.numpy import load_file  # noqa: E402

from qmoe_rtc.checkpoints import Checkpoint, load_layer, moe_layers  # noqa: E402
from qmoe_rtc.checkpoints.model_config import moe_config  # noqa: E402
from qmoe_rtc.contract import QMoEAttributes  # noqa: E402
from qmoe_rtc.errors import QMoEInputError, QMoEUnsupportedError  # noqa: E402
from qmoe_rtc.formats.quantize import dequantize  # noqa: E402
from qmoe_rtc.runtime.layer import describe_gpu_layer  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "data" / "checkpoints"
REAL = sorted(p for p in DATA.iterdir() if (p / "model.safetensors").is_file())
ROOT = Path(__file__).resolve().parents[2]

#: what each fixture must load as: (bits, block size, zero points, scale dtype, model type, normalize)
EXPECT = {
    "gptqmodel_mixtral_gptq_b2_g32_asym": (2, 32, True, "float16", "mixtral", 1),
    "gptqmodel_mixtral_gptq_b4_g32_asym": (4, 32, True, "float16", "mixtral", 1),
    "gptqmodel_qwen3_moe128_awq_b4_g32_asym_gemm": (4, 32, True, "bfloat16", "qwen3_moe", 0),
    "gptqmodel_qwen3_moe_gptq_b4_g-1_asym_gptq_v2": (4, 0, True, "float16", "qwen3_moe", 0),
    "gptqmodel_qwen3_moe_gptq_b8_g32_sym": (8, 32, False, "float16", "qwen3_moe", 0),
    "llmc_mixtral_w2a16_g32": (2, 32, False, "bfloat16", "mixtral", 1),
    "llmc_mixtral_w4a16_asym_g32": (4, 32, True, "bfloat16", "mixtral", 1),
    "llmc_mixtral_w8a16_ch": (8, 0, False, "bfloat16", "mixtral", 1),
    "llmc_qwen2_moe_w4a16_asym_g32": (4, 32, True, "bfloat16", "qwen2_moe", 0),
    "llmc_qwen3_moe_w3a16_asym_g32": (3, 32, True, "bfloat16", "qwen3_moe", 0),
    "llmc_qwen3_moe_w4a16_g32": (4, 32, False, "bfloat16", "qwen3_moe", 0),
    "llmc_qwen3_moe_w8a16_ch": (8, 0, False, "bfloat16", "qwen3_moe", 0),
}


def test_every_fixture_is_listed():
    assert sorted(p.name for p in REAL) == sorted(EXPECT)


def _dense(reference: dict, prefix: str, E: int, names: tuple) -> dict:
    """The tool's float32 [N, K] projections stacked per expert: {'fc1': [E, 2I, H], 'fc2': [E, H, I]}."""
    g, u, d = (np.stack([reference[f"{prefix}.experts.{e}.{n}.weight"] for e in range(E)]) for n in names)
    return {"fc1": np.concatenate([g, u], axis=1), "fc2": d}


@pytest.mark.parametrize("path", REAL, ids=[p.name for p in REAL])
def test_real_checkpoints_load_exactly(path):
    bits, bs, zp, sdt, model_type, normalize = EXPECT[path.name]
    cfg = json.loads((path / "config.json").read_text())
    E = cfg.get("num_local_experts") or cfg.get("num_experts")
    assert moe_layers(path) == [0]
    layer = load_layer(path, 0)
    w, a = layer.weights, layer.attributes
    describe_gpu_layer(w, QMoEAttributes.from_kwargs(**a), {})  # QMoE() takes them as they are (GPU-free)
    assert (a["expert_weight_bits"], a["block_size"], "fc1_zero_points" in w) == (bits, bs, zp)
    assert str(w["fc1_scales"].dtype) == sdt and layer.model_type == model_type
    assert a["normalize_routing_weights"] == normalize and a["k"] == cfg["num_experts_per_tok"]
    assert w["fc1_experts_weights"].shape[0] == E and layer.router_weight.shape == (E, cfg["hidden_size"])
    ref = load_file(str(path / "reference.safetensors"))
    block = next(n.split(".experts.")[0] for n in ref)
    proj = ("w1", "w3", "w2") if f"{block}.experts.0.w1.weight" in ref else ("gate_proj", "up_proj", "down_proj")
    want = _dense(ref, block, E, proj)
    for p in ("fc1", "fc2"):
        K = want[p].shape[2]
        got = dequantize(w[f"{p}_experts_weights"], w[f"{p}_scales"], bits, bs, w.get(f"{p}_zero_points"), K=K)
        np.testing.assert_array_equal(got.astype(np.float64), want[p].astype(np.float64), err_msg=f"{path.name} {p}")
    if "shared_expert" in " ".join(ref):  # Qwen2-MoE's shared MLP of 2·I: two shared experts of I, exact
        sg, su, sd = (ref[f"{block}.shared_expert.{n}.weight"] for n in proj)
        I = w["fc2_experts_weights"].shape[2] * 8 // bits
        s1 = dequantize(w["shared_fc1_experts_weights"], w["shared_fc1_scales"], bits, bs,
                        w.get("shared_fc1_zero_points"), K=cfg["hidden_size"])
        for s in range(s1.shape[0]):
            rows = slice(s * I, (s + 1) * I)
            np.testing.assert_array_equal(s1[s], np.concatenate([sg[rows], su[rows]]))
        assert "shared_gate_weight" in w


def test_a_fresh_process_reads_bfloat16_checkpoints():
    """Nothing imported first (no ml_dtypes, numpy or safetensors beforehand): bfloat16 scales and
    routers load, and the command line reads every layer."""
    path = DATA / "llmc_mixtral_w4a16_asym_g32"
    code = (f"from qmoe_rtc.checkpoints import load_layer; L = load_layer({str(path)!r}, 0); "
            "print(L.weights['fc1_scales'].dtype, L.router_weight.dtype)")
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["bfloat16", "bfloat16"]
    cli = subprocess.run([sys.executable, "-m", "qmoe_rtc", "checkpoint", str(path)], capture_output=True, text=True,
                         env=env, timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert "layer 0:" in cli.stdout and "E=4" in cli.stdout


@pytest.mark.parametrize("model_type, want", [
    ("mixtral", (4, 2, 1)), ("qwen2_moe", (4, 2, 0)), ("qwen3_moe", (4, 2, 0)), ("olmoe", (4, 2, 0)),
    ("qwen3_next", (4, 2, 1)), ("gpt_oss", (4, 2, 1)), ("deepseek_v3", (4, 2, 1)),
    ("phimoe", "sparse mixer"),
])
def test_transformers_configs_give_each_model_types_routing(model_type, want):
    cfg = json.loads((DATA / "configs" / f"{model_type}.json").read_text())
    assert cfg["model_type"] == model_type
    if isinstance(want, str):
        with pytest.raises(QMoEUnsupportedError, match=want):
            moe_config(cfg)
        return
    got = moe_config(cfg)
    assert (got.E, got.k, got.normalize) == want
    if model_type == "deepseek_v3":  # no scoring_func / topk_method in transformers' config: the model type says it
        assert "scoring_func" not in cfg and "topk_method" not in cfg
        assert got.routing == dict(scoring_func="sigmoid", n_group=1, topk_group=1, routed_scaling_factor=2.5)
        assert got.score_bias and (got.shared, got.first_dense) == (1, 1)
    else:
        assert got.routing == {} and not got.score_bias


def test_missing_config_fields_are_named_not_guessed():
    base = json.loads((DATA / "configs" / "qwen3_moe.json").read_text())
    for key, match in (("norm_topk_prob", "norm_topk_prob"), ("num_experts_per_tok", "num_experts_per_tok"),
                       ("num_local_experts", "num_local_experts")):
        cfg = {k: v for k, v in base.items() if k != key}
        with pytest.raises(QMoEInputError, match=match):
            moe_config(cfg)
    mixtral = json.loads((DATA / "configs" / "mixtral.json").read_text())
    assert "norm_topk_prob" not in mixtral and moe_config(mixtral).normalize == 1  # Mixtral always renormalises
    with pytest.raises(QMoEInputError, match="norm_topk_prob"):  # an unknown model type: the field is required
        moe_config({**mixtral, "model_type": "my_moe"})
    with pytest.raises(QMoEInputError, match="JSON object"):
        moe_config([1, 2])


def test_a_missing_expert_is_named_not_loaded_as_fewer(tmp_path):
    """config.json says 4 experts; expert 2's tensors are gone: the missing tensor is named (it loaded 2 of 4
    experts before, failing later as a router-shape mismatch)."""
    src = DATA / "llmc_qwen3_moe_w4a16_g32"
    from safetensors.numpy import save_file

    with Checkpoint(src) as ck:
        tensors = {n: ck.get(n) for n in ck.names if ".experts.2." not in n}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(QMoEInputError, match=r"experts\.2\.gate_proj"):
        load_layer(tmp_path, 0)


@pytest.mark.parametrize("damage, match", [
    (lambda b: b[: len(b) // 2], "truncated"),
    (lambda b: (10**9).to_bytes(8, "little") + b[8:], "header"),
    (lambda b: b[:8] + b"{not json" + b[17:], "readable"),
    (lambda b: b"", "header"),
])
def test_a_damaged_safetensors_file_is_one_line_naming_it(tmp_path, damage, match):
    src = DATA / "llmc_qwen3_moe_w4a16_g32"
    (tmp_path / "model.safetensors").write_bytes(damage((src / "model.safetensors").read_bytes()))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(QMoEInputError, match=match) as info:
        load_layer(tmp_path, 0)
    assert "model.safetensors" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("text", ["[1, 2]", "{not json", '"a string"'])
def test_a_config_that_is_not_an_object_is_named(tmp_path, text):
    src = DATA / "llmc_qwen3_moe_w4a16_g32"
    (tmp_path / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(QMoEInputError, match="config.json"):
        load_layer(tmp_path, 0)
