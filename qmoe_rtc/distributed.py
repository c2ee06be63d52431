"""Expert-parallel QMoE over ``torch.distributed`` [ext]: each rank holds a slice of the experts and the
partial outputs are summed with ``all_reduce`` on the process group's communicator (NCCL for CUDA).

::

    import torch.distributed as dist
    from qmoe_rtc.distributed import ExpertParallelQMoE

    dist.init_process_group("nccl")                     # torchrun sets rank / world size
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    moe = ExpertParallelQMoE(**weights, **attributes)   # full-layer weights; only this rank's experts go up
    y = moe(x, router_logits)                           # every rank gets the whole layer's output

Routing runs on every rank over all E logits (the same picks everywhere); each rank computes the
routes to its experts (:mod:`qmoe_rtc.contract.slices`) into ``out`` in the activation dtype T, then one
``all_reduce(SUM)`` on torch's current stream adds the ranks' partial outputs in place. Shared
experts [ext] run on ``shared_rank`` only. Both steps are capturable: inside ``torch.cuda.graph``
pass ``out=`` and run one eager call at that shape first (it plans the layer and makes NCCL set up
its communicator). torch is imported when a layer is built, not with the package.
"""

from __future__ import annotations

from ._arrays import shape_str
from .contract.extensions import SHARED_INPUTS
from .contract.slices import even_split
from .errors import DeviceError, QMoEAttributeError, QMoEInputError

__all__ = ["ExpertParallelQMoE", "rank_experts"]

#: Inputs whose leading dimension is the expert axis (the ones a rank slices).
_EXPERT_AXIS = tuple(f"{p}_{t}" for p in ("fc1", "fc2", "fc3")
                     for t in ("experts_weights", "scales", "zero_points", "experts_bias", "global_scale"))


def rank_experts(num_experts: int, world: int, rank: int, placement=None) -> list[int]:
    """The global expert ids rank ``rank`` of ``world`` holds, in local order: an even contiguous
    split, or ``placement`` (a sequence [E] giving each expert's rank)."""
    if placement is None:
        e0, e1 = even_split(num_experts, world, rank)
        return list(range(e0, e1))
    place = [int(p) for p in placement]
    if len(place) != num_experts:
        raise QMoEInputError("placement", f"one rank per expert ([E] = [{num_experts}])", f"length {len(place)}")
    bad = [p for p in place if not 0 <= p < world]
    if bad:
        raise QMoEInputError("placement", f"ranks in 0..{world - 1}", f"rank {bad[0]}")
    held = [e for e, p in enumerate(place) if p == rank]
    if not held:
        raise QMoEInputError("placement", f"at least one expert on every rank (rank {rank} has none)", str(place))
    return held


def _take(a, idx: list[int]):
    """Experts ``idx`` of an array with the expert axis first (NumPy, CuPy or torch; a contiguous
    range is a view where the array type allows it)."""
    contiguous = idx == list(range(idx[0], idx[0] + len(idx)))
    if contiguous:
        return a[idx[0]: idx[-1] + 1]
    if hasattr(a, "index_select"):  # torch
        import torch

        return a.index_select(0, torch.as_tensor(idx, device=a.device))
    return a[idx]


class ExpertParallelQMoE:
    """One QMoE layer split by experts over the ranks of ``group`` (default: the world group).

    ``weights_and_attributes``: the whole layer's inputs and attributes as for
    :class:`qmoe_rtc.QMoE` (E experts); this rank keeps its experts (``placement`` [E] of ranks, or an
    even contiguous split) and builds a :class:`~qmoe_rtc.QMoE` slice of them. ``shared_rank``: the
    rank that runs the shared experts [ext], if any. Other keywords (``device``, ``decode_max_routes``,
    ``validate_content``) go to the slice.
    """

    def __init__(self, *, group=None, placement=None, shared_rank: int = 0, **weights_and_attributes):
        try:
            import torch.distributed as dist
        except ImportError as exc:  # the package itself needs no torch
            raise DeviceError(f"qmoe_rtc.distributed needs torch with torch.distributed ({exc})") from exc

        from .executor import QMoE

        if not dist.is_available() or not dist.is_initialized():
            raise QMoEAttributeError("group", "an initialized torch.distributed process group "
                                     "(torch.distributed.init_process_group first)", "none")
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        kw = dict(weights_and_attributes)
        w1 = kw.get("fc1_experts_weights")
        if w1 is None or len(getattr(w1, "shape", ())) != 3:
            raise QMoEInputError("fc1_experts_weights", "[E, N, ceil(K·b/8)] (the whole layer's experts)",
                                 shape_str(getattr(w1, "shape", ())))
        E = int(w1.shape[0])
        if not 0 <= shared_rank < self.world:
            raise QMoEAttributeError("shared_rank", f"a rank in 0..{self.world - 1}", str(shared_rank))
        self.experts = rank_experts(E, self.world, self.rank, placement)
        for n in _EXPERT_AXIS:
            if kw.get(n) is not None:
                kw[n] = _take(kw[n], self.experts)
        if self.rank != shared_rank:
            for n in (*SHARED_INPUTS, "shared_gate_weight"):
                kw.pop(n, None)
        if self.experts == list(range(self.experts[0], self.experts[-1] + 1)):
            kw.update(expert_range=(self.experts[0], self.experts[-1] + 1), num_experts=E)
        else:
            import numpy as np

            m = np.full(E, -1, dtype=np.int32)
            m[self.experts] = np.arange(len(self.experts), dtype=np.int32)
            kw["expert_map"] = m
        self.local = QMoE(**kw)

    def __call__(self, input, router_probs=None, router_weights=None, out=None):
        """The whole layer's output on every rank: this rank's partial output (into ``out`` when given),
        then ``all_reduce(SUM)`` over the group on torch's current stream. ``input`` and ``out`` are
        torch CUDA tensors."""
        import torch
        import torch.distributed as dist

        if not isinstance(input, torch.Tensor):  # CuPy inputs would run on CuPy's stream, the reduction on torch's
            raise QMoEInputError("input", "a torch CUDA tensor (the layer and its all_reduce run on torch's current "
                                 "stream)", type(input).__name__)
        y = self.local(input, router_probs, router_weights, out=out)
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=self.group)
        return y
