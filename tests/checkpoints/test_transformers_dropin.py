"""qmoe_rtc.hf on the CPU: tiny random transformers 5 models of each family (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss,
DeepSeek-V3), quantized and saved in their tools' layouts (:mod:`support.hf_models`), their MoE blocks replaced with
``backend="reference"`` (the float64 reference in place of the GPU layer): the blocks found, the layers read and the
inputs each layer gets, the model's logits against transformers' on the dequantized weights (float32: to 1e-5; the
replaced blocks matter: without them the logits move by far more), what each block returns, ``torch.compile`` with
``fullgraph=True``, the refusals (an unknown MoE block by its class, a checkpoint of another model, transformers 4),
the freed experts and the progress bar. Without torch or transformers only the import checks run; the GPU run is
``test_transformers_dropin_gpu.py``."""

from __future__ import annotations

import copy
import logging
import subprocess
import sys

import numpy as np
import pytest

from qmoe_rtc.errors import QMoEInputError, QMoEUnsupportedError

from support.hf_models import FAMILIES, E, H, I, config, logits_of, make_case, pick_ids, rel_err, routers

#: float32 models: the float64 reference against transformers' float32 (measured: about 5e-7)
TOL32 = 1e-5
#: a bfloat16 model on the CPU: both computations in bfloat16 (measured about 1e-2, transformers' own bfloat16 run
#: being as far from its float32 run), on inputs whose routing is clear of ties (support.hf_models.clearance)
TOL16 = 2.5e-2


def test_import_without_torch_names_the_extra():
    code = "import sys; sys.modules['torch'] = None\nimport qmoe_rtc.hf"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode != 0 and "pip install qmoe_rtc[hf]" in r.stderr, r.stderr


def test_the_package_imports_neither_torch_nor_transformers():
    code = ("import sys, qmoe_rtc, qmoe_rtc.checkpoints, qmoe_rtc.executor; qmoe_rtc.QMoE\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')]; print(bad); "
            "sys.exit(bool(bad))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.fixture
def torch():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers", minversion="5")
    pytest.importorskip("safetensors")
    return torch


@pytest.fixture
def hf(torch, caplog):
    caplog.set_level(logging.ERROR, logger="qmoe_rtc")  # backend='reference' warns at each replacement
    import qmoe_rtc.hf as hf

    return hf


def _replaced(hf, case, **kw):
    model = copy.deepcopy(case.model)
    report = hf.replace_moe_blocks(model, case.path, backend="reference", progress=False, **kw)
    return model, report


@pytest.mark.parametrize("family", FAMILIES)
def test_the_blocks_of_each_family_are_found(hf, tmp_path, family):
    case = make_case(family, tmp_path)
    blocks, dense = hf.find_blocks(case.model)
    assert [(L, path, f.name) for L, path, _, f in blocks] == [(L, f"model.layers.{L}.mlp", family)
                                                               for L in case.moe_layers]
    assert dense == ({0: "model.layers.0.mlp"} if family == "deepseek_v3" else {})
    assert case.moe_layers == ([1, 2] if family == "deepseek_v3" else [0, 1])


@pytest.mark.parametrize("router", ["torch", "layer"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_replaced_model_computes_what_transformers_computes(hf, torch, tmp_path, family, router):
    case = make_case(family, tmp_path)
    want = logits_of(case.model, case.ids)
    model, report = _replaced(hf, case, router=router)
    assert sorted(report.replaced) == case.moe_layers and report.families == [family]
    assert all(type(model.model.layers[L].mlp).__name__ == "QMoEBlock" for L in case.moe_layers)
    assert rel_err(logits_of(model, case.ids), want) <= TOL32
    assert rel_err(logits_of(_without_moe(case.model), case.ids), want) > 1000 * TOL32  # the comparison sees the blocks


def _without_moe(model):
    """A copy of the transformers model whose MoE blocks add nothing (their down projections zeroed)."""
    import torch

    model = copy.deepcopy(model)
    with torch.no_grad():
        for L in routers(model):
            block = model.model.layers[L].mlp
            for t in (block.experts.down_proj, getattr(block.experts, "down_proj_bias", None),
                      *[getattr(block, s).down_proj.weight for s in ("shared_expert", "shared_experts") if hasattr(block, s)]):
                if t is not None:
                    t.zero_()
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_each_block_returns_what_it_replaced_returned(hf, torch, tmp_path, family):
    case = make_case(family, tmp_path)
    x = torch.randn(2, 5, H)
    for router in ("torch", "layer"):
        model, _ = _replaced(hf, case, router=router)
        for L in case.moe_layers:
            with torch.no_grad():
                old, new = case.model.model.layers[L].mlp(x), model.model.layers[L].mlp(x)
            if family == "gpt_oss":  # GptOssMLP returns (hidden_states, router_scores)
                assert isinstance(new, tuple) and len(new) == 2
                old, (new, scores) = old[0], new
                if router == "torch":
                    assert torch.equal(scores, case.model.model.layers[L].mlp(x)[1])
                else:
                    assert scores is None  # the router module is not called; the decoder layer discards it
            assert isinstance(new, torch.Tensor) and new.shape == old.shape == x.shape and new.dtype == old.dtype
            assert rel_err(new, old) <= TOL32


@pytest.mark.parametrize("family", FAMILIES)
def test_the_layers_read_and_the_inputs_each_layer_gets(hf, torch, tmp_path, monkeypatch, family):
    import qmoe_rtc.checkpoints.layer as loader

    case = make_case(family, tmp_path)
    read, load = [], loader.load_layer
    monkeypatch.setattr(loader, "load_layer", lambda ckpt, L, **kw: read.append(L) or load(ckpt, L, **kw))
    for router in ("torch", "layer"):
        model, _ = _replaced(hf, case, router=router)
        for L in case.moe_layers:
            old, w = case.model.model.layers[L].mlp, model.model.layers[L].mlp.moe.layer.weights
            K1 = H if family == "deepseek_v3" else H // 2  # FP8: a byte per code; int4 and MXFP4: two per byte
            assert w["fc1_experts_weights"].shape == (E, 2 * I, K1)
            assert w["fc2_experts_weights"].shape == (E, H, I if family == "deepseek_v3" else I // 2)
            shared = {"qwen2_moe": 2, "deepseek_v3": 1}.get(family)  # Qwen2's 2I shared MLP: 2 shared experts of I
            assert (w["shared_fc1_experts_weights"].shape[:2] == (shared, 2 * I)) if shared else \
                "shared_fc1_experts_weights" not in w
            if family == "qwen2_moe":  # the model's gate, as float32
                assert np.array_equal(w["shared_gate_weight"], old.shared_expert_gate.weight[0].detach().numpy())
            if family == "deepseek_v3":
                assert w["router_score_bias"].dtype == np.float32
                assert np.array_equal(w["router_score_bias"], old.gate.e_score_correction_bias.detach().numpy())
            r = old.router if family == "gpt_oss" else old.gate
            if router == "layer":
                assert np.array_equal(w["router_weight"], r.weight.detach().numpy())
                assert ("router_bias" in w) == (family == "gpt_oss")
            else:
                assert "router_weight" not in w and "router_bias" not in w
    assert read == case.moe_layers * 2


def test_a_bfloat16_model_matches_within_bfloat16_rounding(hf, torch, tmp_path):
    """GPTQ's float16 scales beside bfloat16 activations: the layer's scales become float32 (exactly)."""
    case = make_case("mixtral", tmp_path, dtype=torch.bfloat16)
    model, report = _replaced(hf, case)
    assert report.dtype == "bfloat16"
    assert model.model.layers[0].mlp.moe.layer.weights["fc1_scales"].dtype == np.float32
    for ids in pick_ids(case.model, "mixtral", need=0.01, count=2):
        got, want = logits_of(model, ids), logits_of(case.model, ids)
        assert got.dtype == torch.bfloat16 and rel_err(got, want) <= TOL16


@pytest.mark.parametrize("family", FAMILIES)
def test_compile_fullgraph_traces_the_replaced_model(hf, torch, tmp_path, family):
    case = make_case(family, tmp_path)
    model, _ = _replaced(hf, case)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    layer = model.model.layers[case.moe_layers[0]].mlp.moe.layer
    calls = layer.calls
    torch.testing.assert_close(logits_of(compiled, case.ids), logits_of(model, case.ids), rtol=1e-6, atol=1e-6)
    assert layer.calls == calls + 2  # the compiled graph called the layer through the op
    torch._dynamo.reset()


def test_router_logits_are_still_recorded_with_the_router_in_torch(hf, torch, tmp_path):
    case = make_case("mixtral", tmp_path)
    model, _ = _replaced(hf, case)
    with torch.no_grad():
        got = model(case.ids, output_router_logits=True, use_cache=False).router_logits
        want = case.model(case.ids, output_router_logits=True, use_cache=False).router_logits
    assert len(got) == len(want) == 2 and torch.equal(got[0], want[0])  # layer 0: the same router on the same input
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)


def test_the_float_experts_are_freed(hf, torch, tmp_path):
    case = make_case("deepseek_v3", tmp_path)
    model = copy.deepcopy(case.model)
    old = {L: model.model.layers[L].mlp for L in case.moe_layers}
    size = sum(t.numel() * t.element_size() for b in old.values() for name, t in b.named_parameters()
               if not name.startswith("gate."))
    report = hf.replace_moe_blocks(model, case.path, backend="reference", progress=False)
    assert report.freed_bytes == size
    for L, b in old.items():  # the router stays, now the replacement's
        assert all(p.is_meta for n, p in b.named_parameters() if not n.startswith("gate."))
        assert b.gate is model.model.layers[L].mlp.gate and not b.gate.weight.is_meta
    assert "dense MLPs left as they are: layers 0" in str(report)


def test_checkpoint_layers_past_the_model_are_listed_not_read(hf, torch, tmp_path):
    """DeepSeek-V3's checkpoints hold a multi-token-prediction layer past the model's: listed, not read."""
    from transformers import AutoModelForCausalLM

    case = make_case("deepseek_v3", tmp_path)
    model = AutoModelForCausalLM.from_config(config("deepseek_v3", num_hidden_layers=2)).eval()
    report = hf.replace_moe_blocks(model, case.path, backend="reference", progress=False)
    assert sorted(report.replaced) == [1] and report.checkpoint_only == [2]
    assert "checkpoint MoE layers not in the model (not read): 2" in str(report)


def test_an_unknown_moe_block_is_refused_by_its_class_and_nothing_changes(hf, torch, tmp_path):
    import transformers as tf

    cfg = tf.PhimoeConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_hidden_layers=2, vocab_size=128,
                          num_attention_heads=4, num_key_value_heads=2)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    case = make_case("mixtral", tmp_path)
    with pytest.raises(QMoEUnsupportedError, match=r"model\.layers\.0\.mlp \(PhimoeSparseMoeBlock\).*MixtralSparseMoeBlock"):
        hf.replace_moe_blocks(model, case.path, backend="reference", progress=False)
    assert all(type(layer.mlp).__name__ == "PhimoeSparseMoeBlock" for layer in model.model.layers)
    dense = tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(hidden_size=H, intermediate_size=I, num_hidden_layers=1,
                                                              vocab_size=128, num_attention_heads=4))
    with pytest.raises(QMoEInputError, match="with none"):
        hf.replace_moe_blocks(dense, case.path, backend="reference", progress=False)


@pytest.mark.parametrize("change, name, match", [
    (lambda b: setattr(b.gate, "top_k", 3), "model.layers.1.mlp k", "3 .the model's model.layers.1.mlp.gate.top_k"),
    (lambda b: setattr(b.gate, "norm_topk_prob", False), "model.layers.1.mlp normalize_routing_weights", "0"),
    (lambda b: setattr(b.experts, "intermediate_dim", 2 * I), "model.layers.1.mlp I", "64"),
])
def test_a_checkpoint_of_another_model_is_refused_naming_the_setting(hf, torch, tmp_path, change, name, match):
    """Layer 1 differs: layer 0 (before it) is replaced, layer 1 left as it was."""
    case = make_case("qwen3_moe", tmp_path)
    model = copy.deepcopy(case.model)
    change(model.model.layers[1].mlp)
    with pytest.raises(QMoEInputError, match=match) as ei:
        hf.replace_moe_blocks(model, case.path, backend="reference", progress=False)
    assert ei.value.name == name
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["QMoEBlock", "Qwen3MoeSparseMoeBlock"]


def test_a_model_layer_the_checkpoint_lacks_is_refused_before_any_change(hf, torch, tmp_path):
    from transformers import AutoModelForCausalLM

    case = make_case("qwen3_moe", tmp_path)
    model = AutoModelForCausalLM.from_config(config("qwen3_moe", num_hidden_layers=3)).eval()
    with pytest.raises(QMoEInputError, match="layer 2") as ei:
        hf.replace_moe_blocks(model, case.path, backend="reference", progress=False)
    assert "checkpoint's MoE layers: 0-1" in str(ei.value)
    assert all(type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in model.model.layers)


def test_bad_arguments_are_named(hf, torch, tmp_path, monkeypatch):
    import transformers

    case = make_case("qwen3_moe", tmp_path)
    for kw, name in ((dict(router="both"), "router"), (dict(backend="fast"), "backend"), (dict(progress="yes"), "progress"),
                     (dict(layer_kwargs={"k": 3}), "layer_kwargs['k']"), (dict(dtype="int8"), "dtype")):
        with pytest.raises(QMoEInputError) as ei:
            hf.replace_moe_blocks(case.model, case.path, **{"backend": "reference", **kw})
        assert ei.value.name == name
    with pytest.raises(QMoEInputError, match="a model on a CUDA device"):  # the GPU layers need the model on a GPU
        hf.replace_moe_blocks(case.model, case.path, progress=False)
    monkeypatch.setattr(transformers, "__version__", "4.57.1")
    with pytest.raises(QMoEUnsupportedError, match="transformers 4.57.1"):
        hf.replace_moe_blocks(case.model, case.path, backend="reference")
    assert all(type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in case.model.model.layers)


def test_the_progress_bar_and_the_reference_warning(torch, tmp_path, monkeypatch, capsys, caplog):
    import qmoe_rtc.hf as hf

    case = make_case("mixtral", tmp_path)
    with caplog.at_level(logging.WARNING, logger="qmoe_rtc"):
        hf.replace_moe_blocks(copy.deepcopy(case.model), case.path, backend="reference", progress=False)
    assert "float64 CPU reference" in caplog.text and "not a way to serve" in caplog.text
    assert capsys.readouterr().err == ""
    monkeypatch.setitem(sys.modules, "tqdm", None)  # no tqdm: a line per block
    hf.replace_moe_blocks(copy.deepcopy(case.model), case.path, backend="reference")
    err = capsys.readouterr().err
    assert "qmoe_rtc: MoE block 1/2: layer 0: int4 block 32" in err and "MoE block 2/2: layer 1" in err
    monkeypatch.delitem(sys.modules, "tqdm")
    pytest.importorskip("tqdm")
    hf.replace_moe_blocks(copy.deepcopy(case.model), case.path, backend="reference")
    assert "qmoe_rtc: MoE blocks" in capsys.readouterr().err


def test_16_bit_arrays_take_the_activation_dtype_where_exact(torch):
    from ml_dtypes import bfloat16

    from qmoe_rtc.hf.replace import _in_dtype

    exact = np.array([0.5, 1.0, -2.0], np.float16)  # bfloat16 holds these
    inexact = np.array([0.5, 1.0009765625], np.float16)  # 1 + 2^-10: float16 only
    assert _in_dtype({"s": exact}, "bfloat16")["s"].dtype == bfloat16
    assert _in_dtype({"s": exact, "t": inexact}, "bfloat16")["s"].dtype == np.float32  # together: all float32
    assert _in_dtype({"s": exact.astype(bfloat16)}, "float16")["s"].dtype == np.float16
    kept = {"s": exact, "q": np.zeros(3, np.uint8)}
    assert _in_dtype(kept, "float16") is kept


def test_experts_left_on_the_meta_device_are_never_read(hf, torch, tmp_path):
    """A model loaded without its float experts (on the meta device) is replaced all the same."""
    case = make_case("qwen2_moe", tmp_path)
    model = copy.deepcopy(case.model)
    for L in case.moe_layers:
        model.model.layers[L].mlp.experts.to("meta")
        model.model.layers[L].mlp.shared_expert.to("meta")
    report = hf.replace_moe_blocks(model, case.path, backend="reference", progress=False)
    assert report.freed_bytes == len(case.moe_layers) * H * 4  # the shared gate's [1, H] float32 alone
    assert rel_err(logits_of(model, case.ids), logits_of(case.model, case.ids)) <= TOL32


@pytest.mark.parametrize("family, router, logits", [("mixtral", "torch", "bfloat16"), ("mixtral", "layer", "float32"),
                                                     ("gpt_oss", "torch", "bfloat16"), ("deepseek_v3", "torch", "float32")])
def test_reserve_plans_with_the_dtypes_the_forward_calls_with(hf, torch, tmp_path, monkeypatch, family, router, logits):
    from qmoe_rtc.torch.module import MoEModule

    calls = []
    monkeypatch.setattr(MoEModule, "reserve", lambda self, *a: calls.append(a))
    case = make_case(family, tmp_path, dtype=torch.bfloat16)
    model, _ = _replaced(hf, case, router=router)
    assert hf.reserve_blocks(model, 64) == len(case.moe_layers)
    assert calls == [(64, "bfloat16", logits)] * len(case.moe_layers)
    L = case.moe_layers[0]
    with torch.no_grad():  # the dtype the forward hands the layer is the one reserved
        r = model.model.layers[L].mlp.router if family == "gpt_oss" else model.model.layers[L].mlp.gate
        got = r(torch.randn(3, H, dtype=torch.bfloat16))[0].dtype
    assert router == "layer" or str(got) == f"torch.{logits}"
