"""The benchmark's PyTorch baseline (:mod:`qmoe_rtc.bench.run`): weights dequantized once, the classic eager
per-expert loop per forward."""

from __future__ import annotations

from .report import Shape

__all__ = ["torch_moe", "torch_weights"]


def torch_weights(cp, torch, weights: dict, shape: Shape, dtype: str, bits, block_size: int, device="cuda"):
    """FC1 [E, 2I, H] and FC2 [E, H, I] dequantized once to the activation dtype, as torch tensors."""
    from ..formats.quantize import dequantize

    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    out = []
    for name, N, K, b in (("fc1", 2 * shape.I, shape.H, bits[0]), ("fc2", shape.H, shape.I, bits[1])):
        W = torch.empty((shape.E, N, K), dtype=tdt, device=device)
        zp = weights.get(f"{name}_zero_points")
        chunk = max(1, (1 << 26) // (N * K))
        for e0 in range(0, shape.E, chunk):
            s = slice(e0, min(shape.E, e0 + chunk))
            w = dequantize(weights[f"{name}_experts_weights"][s], weights[f"{name}_scales"][s], b, block_size,
                           zero_points=None if zp is None else zp[s], K=K)  # float32 CuPy
            W[s].copy_(torch.from_dlpack(w).to(tdt))
            del w
        out.append(W)
    return out


def torch_moe(torch, x, logits, W1, W2, k: int):
    """The classic eager MoE: softmax top-k, per-expert loop (host sync), FC1, swiglu (interleaved), FC2."""
    T, H = x.shape
    p = torch.softmax(logits.float(), dim=-1)
    w, idx = torch.topk(p, k, dim=-1)
    w = w / w.sum(dim=-1, keepdim=True)
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    tok, wsorted = order // k, w.reshape(-1)[order]
    out = torch.zeros((T, H), dtype=torch.float32, device=x.device)
    start = 0
    for e, c in zip(experts.tolist(), counts.tolist()):
        rows = tok[start:start + c]
        h = x[rows] @ W1[e].t()  # [c, 2I]
        g, lin = h[:, 0::2].float(), h[:, 1::2].float()
        y = (g * torch.sigmoid(g) * lin).to(x.dtype) @ W2[e].t()  # [c, H]
        out.index_add_(0, rows, y.float() * wsorted[start:start + c, None])
        start += c
    return out.to(x.dtype)
