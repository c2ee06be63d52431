"""Writes the checkpoints beside this file with the public quantizers themselves (not run by the tests:
it needs torch and the tools; README.md says which versions wrote what is committed).

    # llm-compressor (its own environment: it pins transformers 5.17)
    pip install torch llmcompressor==0.14.0.1 compressed-tensors==0.19.0
    python make_fixtures.py llmc mixtral:w4a16_asym:32 mixtral:w2a16:32 mixtral:w8a16:ch qwen3_moe:w4a16:32 \
        qwen3_moe:w3a16_asym:32 qwen3_moe:w8a16:ch qwen2_moe:w4a16_asym:32
    # GPTQModel (another environment: it needs transformers >= 5.20)
    pip install torch gptqmodel==7.7.0
    GPTQMODEL_CPU_WORKERS=2 python make_fixtures.py gptq mixtral:4:32:asym: mixtral:2:32:asym: \
        qwen3_moe:8:32:sym: qwen3_moe:4:-1:asym:gptq_v2 qwen3_moe128:4:32:asym:gemm:awq
    # the model configs transformers writes (either environment)
    python make_fixtures.py configs

Each quantized folder keeps the tool's ``config.json`` and ``model.safetensors`` as written, and a
``reference.safetensors``: every expert projection [N, K] dequantized by the tool's own code in float32
(compressed-tensors' ``PackedQuantizationCompressor.decompress``; GPTQModel's ``dequantize_weight`` after
its load-time v1 -> v2 conversion, the model loaded in the scales' own dtype so they stay exact).
"""

from __future__ import annotations

import os
import sys

import torch
import transformers

OUT = os.path.dirname(os.path.abspath(__file__))
SMALL = dict(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)


def tiny(name: str, vocab: int):
    """A random one-layer bf16 model of ``name``'s architecture (H 64, I 32, 4 experts, k 2)."""
    H, I = (128, 64) if name == "qwen3_moe128" else (64, 32)
    kw = dict(hidden_size=H, intermediate_size=I, vocab_size=vocab, num_experts_per_tok=2, **SMALL)
    if name == "mixtral":
        cfg = transformers.MixtralConfig(num_local_experts=4, **kw)
    elif name == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(moe_intermediate_size=I, shared_expert_intermediate_size=2 * I, num_experts=4, **kw)
    else:
        cfg = transformers.Qwen3MoeConfig(moe_intermediate_size=I, num_experts=4, head_dim=H // 2, **kw)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)


def _tokenizer(path: str, vocab: int) -> None:
    import tokenizers

    words = {f"t{i}": i for i in range(vocab - 2)} | {"<unk>": vocab - 2, "<pad>": vocab - 1}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="<unk>"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                         eos_token="<unk>").save_pretrained(path)


def base(name: str, vocab: int) -> str:
    path = os.path.join(OUT, ".base", f"{name}_{vocab}")
    if not os.path.isdir(path):
        tiny(name, vocab).save_pretrained(path)
        _tokenizer(path, vocab)
    return path


def llmc(spec: str) -> None:
    """``model:wBa16[_asym]:group`` (group 'ch': the channel strategy), round-to-nearest, no calibration."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from safetensors import safe_open
    from safetensors.torch import save_file

    name, scheme, group = spec.split(":")
    bits, sym = int(scheme[1]), not scheme.endswith("_asym")
    args = (QuantizationArgs(num_bits=bits, type="int", symmetric=sym, strategy="channel") if group == "ch" else
            QuantizationArgs(num_bits=bits, type="int", symmetric=sym, strategy="group", group_size=int(group)))
    qs = QuantizationScheme(targets=["Linear"], weights=args)
    model = transformers.AutoModelForCausalLM.from_pretrained(base(name, 32), dtype=torch.bfloat16)
    oneshot(model=model, recipe=[QuantizationModifier(config_groups={"group_0": qs},
                                                      ignore=["lm_head", "re:.*gate$", "re:.*router$"])])
    out = os.path.join(OUT, f"llmc_{name}_{scheme}_" + ("ch" if group == "ch" else f"g{group}"))
    model.save_pretrained(out, save_compressed=True)
    ref = {}
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as h:
        for p in sorted({k.rsplit(".", 1)[0] for k in h.keys() if k.endswith(".weight_packed") and ".experts." in k
                         or k.endswith(".weight_packed") and "shared_expert." in k}):
            sd = {n: h.get_tensor(f"{p}.{n}") for n in ("weight_packed", "weight_scale", "weight_shape",
                                                         "weight_zero_point") if f"{p}.{n}" in h.keys()}
            sd["weight_scale"] = sd["weight_scale"].float()
            ref[f"{p}.weight"] = PackedQuantizationCompressor.decompress(sd, qs)["weight"].float().contiguous()
    save_file(ref, os.path.join(out, "reference.safetensors"))
    print("wrote", out)


def gptq(spec: str) -> None:
    """``model:bits:group:sym|asym:format[:method]`` quantized by GPTQModel on the CPU (64 calibration rows)."""
    from gptqmodel import GPTQModel, QuantizeConfig
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear
    from safetensors.torch import save_file

    name, bits, group, sym, fmt, *method = spec.split(":")
    kw = dict(bits=int(bits), group_size=int(group), sym=sym == "sym", desc_act=False)
    kw.update({"format": fmt} if fmt else {})
    kw.update({"act_group_aware": False} if int(group) < 0 else {})
    kw.update({"quant_method": method[0]} if method else {})
    model = GPTQModel.load(base(name, 64), QuantizeConfig(**kw), device="cpu")
    calib = [{"input_ids": torch.tensor([[(i * 7 + j * 3) % 31 + 1 for j in range(64)]]),
              "attention_mask": torch.ones(1, 64, dtype=torch.long)} for i in range(64)]
    model.quantize(calib, batch_size=8)
    out = os.path.join(OUT, f"gptqmodel_{name}_{method[0] if method else 'gptq'}_b{bits}_g{group}_{sym}"
                       + (f"_{fmt}" if fmt else ""))
    model.save(out)
    loaded = GPTQModel.load(out, device="cpu", dtype=torch.bfloat16 if method == ["awq"] else torch.float16)
    ref = {}
    for n, mod in loaded.model.named_modules():
        if isinstance(mod, BaseQuantLinear) and (".experts." in n or "shared_expert." in n):
            mod.scales = mod.scales.float()
            ref[f"{n}.weight"] = mod.dequantize_weight().float().T.contiguous()  # [N, K]
    save_file(ref, os.path.join(out, "reference.safetensors"))
    print("wrote", out)


def configs() -> None:
    os.makedirs(os.path.join(OUT, "configs"), exist_ok=True)
    kinds = {"mixtral": ("MixtralConfig", dict(num_local_experts=4)),
             "phimoe": ("PhimoeConfig", dict(num_local_experts=4)),
             "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=4, moe_intermediate_size=32,
                                                  shared_expert_intermediate_size=64)),
             "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, moe_intermediate_size=32)),
             "qwen3_next": ("Qwen3NextConfig", dict(num_experts=4, moe_intermediate_size=32,
                                                    shared_expert_intermediate_size=32)),
             "olmoe": ("OlmoeConfig", dict(num_experts=4)),
             "deepseek_v3": ("DeepseekV3Config", dict(n_routed_experts=4, moe_intermediate_size=32, n_shared_experts=1,
                                                      n_group=1, topk_group=1)),
             "gpt_oss": ("GptOssConfig", dict(num_local_experts=4))}
    for name, (cls, extra) in kinds.items():
        cfg = getattr(transformers, cls)(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=128, num_experts_per_tok=2, **extra)
        cfg.to_json_file(os.path.join(OUT, "configs", f"{name}.json"), use_diff=True)  # as save_pretrained writes it


if __name__ == "__main__":
    what, *specs = sys.argv[1:]
    if what == "configs":
        configs()
    for s in specs:
        (llmc if what == "llmc" else gptq)(s)
