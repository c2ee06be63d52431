"""Scratch pools: the buffers a layer's kernels write between launches (routes, activations, per-route
outputs, grouping lists, tile counters), grown outside graph capture only.

A pool holds one byte buffer per argument name, grown to the largest size any plan asked for;
every growth bumps ``generation`` (bound launches hold buffer addresses and rebind on a change).
Growing while the stream is being captured is a :class:`~qmoe_rtc.errors.CaptureError`.
"""

from __future__ import annotations

import logging

from ..errors import CaptureError
from ..jit.driver import stream_is_capturing
from .interop import cupy

__all__ = ["ScratchPool"]

log = logging.getLogger("qmoe_rtc")


class ScratchPool:
    """Named scratch buffers of one layer on one device (one pool per stream: see the executor)."""

    def __init__(self, device_id: int, label: str = ""):
        self.device_id = device_id
        self.label = label
        self.bufs: dict = {}  # name -> uint8 CuPy array of the slot's largest size
        self.generation = 0

    def missing(self, needs: dict) -> dict:
        """The slots of ``needs`` (name -> Slot) this pool does not hold at their size."""
        return {n: s for n, s in needs.items() if n not in self.bufs or self.bufs[n].nbytes < s.nbytes}

    def ensure(self, needs: dict, stream: int) -> None:
        """Grow to hold ``needs``; refused while ``stream`` is being captured (an allocation there
        would not be part of the graph)."""
        grow = self.missing(needs)
        if not grow:
            return
        if stream_is_capturing(stream):
            have = {n: (self.bufs[n].nbytes if n in self.bufs else 0) for n in grow}
            raise CaptureError(f"the scratch pool {self.label or ''} is too small inside graph capture "
                               f"(needs {', '.join(f'{n} {s.nbytes} B (has {have[n]})' for n, s in grow.items())}): run "
                               "one eager call at this shape, or QMoE.reserve(max_rows), before capturing")
        cp = cupy()
        with cp.cuda.Device(self.device_id):
            for n, s in grow.items():
                nbytes = max(16, -(-s.nbytes // 256) * 256)  # whole 256-byte granules: vector loads stay inside
                self.bufs[n] = cp.zeros(nbytes, cp.uint8) if s.zero else cp.empty(nbytes, cp.uint8)
            if any(s.zero for s in grow.values()):
                cp.cuda.get_current_stream().synchronize()  # zeroed before any stream's kernel reads it
        self.generation += 1
        log.debug("qmoe_rtc: scratch %s grown: %s", self.label, {n: s.nbytes for n, s in grow.items()})

    def address(self, name: str) -> int:
        return int(self.bufs[name].data.ptr)

    def snapshot(self) -> tuple:
        """The buffers as they are now (what a graph recorded on them keeps alive)."""
        return tuple(self.bufs.values())
