"""Expert slices [ext]: a layer that holds only some of a model's E experts (expert parallelism).

A slice is given either as ``expert_range=(e0, e1)`` with ``num_experts=E`` (experts e0..e1-1, held
in that order), or as ``expert_map``: an integer array ``[E]`` whose entry e is the local index of
global expert e in the slice's weights, or -1 when the slice does not hold it. The slice's weight
tensors have the local expert count in place of E; routing still runs over all E logits
(``router_probs [rows, E]``), so every slice of a layer picks the same experts and weights, and a
route to an expert the slice does not hold contributes nothing. The call returns this slice's
partial output, in the activation dtype T; the partial outputs of slices that together hold every
expert once sum to the whole layer's output (docs/contract.md, "Expert slices").

Nothing here touches a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._arrays import dtype_name, shape_str
from ..errors import QMoEAttributeError, QMoEInputError

__all__ = ["ExpertSlice", "describe_slice", "even_split"]


@dataclass(frozen=True)
class ExpertSlice:
    """Which of a layer's ``num_experts`` experts one slice holds: ``held[j]`` is the global id of
    local expert j."""

    num_experts: int
    held: tuple[int, ...]

    @property
    def local_experts(self) -> int:
        return len(self.held)

    def global_to_local(self) -> np.ndarray:
        """int32 ``[E]``: the local index of each global expert, -1 where the slice does not hold it."""
        m = np.full(self.num_experts, -1, dtype=np.int32)
        m[list(self.held)] = np.arange(len(self.held), dtype=np.int32)
        return m

    @property
    def is_range(self) -> bool:
        return self.held == tuple(range(self.held[0], self.held[0] + len(self.held)))

    def check_local(self, local_experts: int) -> None:
        """:class:`QMoEInputError` unless the slice's weights hold ``local_experts`` experts (dim 0)."""
        if local_experts != self.local_experts:
            raise QMoEInputError("fc1_experts_weights", f"{self.local_experts} experts in dim 0 ({self.describe()})",
                                 f"{local_experts}")

    def describe(self) -> str:
        if self.is_range:
            return f"experts {self.held[0]}..{self.held[-1]} of {self.num_experts}"
        return f"{len(self.held)} of {self.num_experts} experts (expert_map)"


def _int(name: str, v, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise QMoEAttributeError(name, what, repr(v))
    return int(v)


def describe_slice(expert_range=None, expert_map=None, num_experts=None, local_experts: int | None = None
                   ) -> ExpertSlice | None:
    """The :class:`ExpertSlice` of a layer's slice arguments (None when none is given), checked against
    ``local_experts`` (the leading dim of its weights) when given. Errors name the argument."""
    if expert_range is None and expert_map is None:
        if num_experts is not None:
            raise QMoEAttributeError("num_experts", "unset unless expert_range is given (the weights tell E)",
                                     repr(num_experts))
        return None
    if expert_range is not None and expert_map is not None:
        raise QMoEAttributeError("expert_map", "unset when expert_range is given (one way to say the slice)",
                                 "an array")
    if expert_map is not None:
        if num_experts is not None:
            raise QMoEAttributeError("num_experts", "unset with expert_map (its length is E)", repr(num_experts))
        a = np.asarray(expert_map.get() if hasattr(expert_map, "get") else expert_map)
        if a.ndim != 1 or a.dtype.kind not in "iu" or a.size < 1:
            raise QMoEInputError("expert_map", "a 1-D integer array [E] (local index or -1 per expert)",
                                 f"{dtype_name(a)} {shape_str(a.shape)}")
        held_local = a[a >= 0]
        n = int(held_local.size)
        if (a < -1).any():
            e = int(np.argwhere(a < -1)[0][0])
            raise QMoEInputError("expert_map", "entries -1 (not held) or a local index", f"{int(a[e])} at expert {e}")
        if n == 0:
            raise QMoEInputError("expert_map", "at least one held expert", "only -1 entries")
        if sorted(held_local.tolist()) != list(range(n)):
            raise QMoEInputError("expert_map", f"local indices 0..{n - 1}, each once", f"{sorted(held_local.tolist())}")
        held = [0] * n
        for e, j in enumerate(a.tolist()):
            if j >= 0:
                held[j] = e
        sl = ExpertSlice(int(a.size), tuple(held))
    else:
        if not isinstance(expert_range, (tuple, list)) or len(expert_range) != 2:
            raise QMoEAttributeError("expert_range", "a pair (e0, e1)", repr(expert_range))
        e0 = _int("expert_range", expert_range[0], "a pair of ints (e0, e1)")
        e1 = _int("expert_range", expert_range[1], "a pair of ints (e0, e1)")
        if num_experts is None:
            raise QMoEAttributeError("num_experts", "E, the layer's expert count (with expert_range)", "unset")
        E = _int("num_experts", num_experts, "a positive int")
        if not 0 <= e0 < e1 <= E:
            raise QMoEAttributeError("expert_range", f"0 <= e0 < e1 <= num_experts ({E})", repr(tuple(expert_range)))
        sl = ExpertSlice(E, tuple(range(e0, e1)))
    if local_experts is not None:
        sl.check_local(local_experts)
    return sl


def even_split(num_experts: int, ranks: int, rank: int) -> tuple[int, int]:
    """``(e0, e1)`` of rank ``rank`` of ``ranks`` in an even contiguous split of ``num_experts``
    (the first ``E % R`` ranks hold one more)."""
    E = _int("num_experts", num_experts, "a positive int")
    R = _int("ranks", ranks, "a positive int")
    r = _int("rank", rank, "an int")
    if E < 1 or R < 1 or not 0 <= r < R:
        raise QMoEAttributeError("rank", f"0 <= rank < ranks ({R}) and ranks >= 1, num_experts >= 1", f"{r} of {R}")
    if R > E:
        raise QMoEAttributeError("ranks", f"at most num_experts ({E}) (every rank holds an expert)", str(R))
    base, extra = divmod(E, R)
    e0 = r * base + min(r, extra)
    return e0, e0 + base + (1 if r < extra else 0)
