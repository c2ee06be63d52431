"""qmoe_rtc layers in Hugging Face transformers models: :func:`replace_moe_blocks` swaps every MoE block of a loaded
transformers 5 model (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss, DeepSeek-V3) for a qmoe_rtc layer read from the model's
quantized checkpoint, with a progress bar over the blocks::

    import torch
    from transformers import AutoModelForCausalLM
    from qmoe_rtc.hf import replace_moe_blocks

    model = AutoModelForCausalLM.from_pretrained("Qwen/Qwen3-30B-A3B", dtype=torch.bfloat16, device_map="cuda")
    print(replace_moe_blocks(model, "Qwen3-30B-A3B-GPTQ-Int4/"))   # the quantized checkpoint's folder
    model = torch.compile(model, fullgraph=True)                    # optional: the blocks are the custom op

Each replacement (:class:`QMoEBlock`) calls the layer through the custom op ``qmoe_rtc::moe`` (:mod:`qmoe_rtc.torch`),
so the model runs eagerly, under ``torch.compile`` and inside ``torch.cuda.graph``. Which blocks, how the router is
kept, what the replacement returns: :mod:`.families`, :mod:`.block`, :mod:`.replace`. Needs PyTorch, transformers 5
and safetensors (``pip install qmoe_rtc[hf]``); ``import qmoe_rtc`` imports none of them, ``import qmoe_rtc.hf``
imports torch (and registers the op), transformers only when a model is replaced.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401  (PyTorch itself)
except ImportError as exc:
    raise ImportError(f"qmoe_rtc.hf needs PyTorch and transformers, which qmoe_rtc does not install by itself: "
                      f"pip install qmoe_rtc[hf] ({exc})") from exc

from .block import QMoEBlock, reserve_blocks
from .families import FAMILIES, Family
from .replace import DropInReport, find_blocks, replace_moe_blocks

__all__ = ["FAMILIES", "DropInReport", "Family", "QMoEBlock", "find_blocks", "replace_moe_blocks", "reserve_blocks"]
