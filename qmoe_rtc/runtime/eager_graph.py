"""One driver launch per eager call: a plan's launches as an instantiated CUDA graph. Before each
launch the kernel nodes that take the call's addresses get them (``cuGraphExecKernelNodeSetParams``,
host-side only); then ``cuGraphLaunch``. Used outside capture (a capture records the plain launches).
A launch that overlaps its predecessor (``BoundLaunches.overlapped``) hangs on a programmatic edge,
as capturing it would record.

A graph exec serialises its own launches, and each (plan, pool) has its own exec, so calls on
different streams (different pools) stay independent.
"""

from __future__ import annotations

from ..errors import DeviceError
from ..jit import driver

__all__ = ["GraphedLaunches"]


class GraphedLaunches:
    """The launches of a :class:`~qmoe_rtc.runtime.plan.BoundLaunches` as one graph exec."""

    __slots__ = ("_graph", "_exec", "_launch", "_ok", "_set", "bound", "updates")

    def __init__(self, bound, device_id: int):
        drv = driver.bindings()
        self.bound = bound  # keeps the parameter blocks the nodes were built from alive
        self._graph = self._exec = None
        updates = []
        with driver.current_context(device_id):
            self._graph = driver.check(drv.cuGraphCreate(0), "cuGraphCreate")
            prev = None
            for (fn, gx, gy, gz, bx, by, bz, smem, vals, address, slots, kern, _params), cfg in zip(bound.items,
                                                                                                 bound.overlapped):
                p = drv.CUDA_KERNEL_NODE_PARAMS()
                p.func, p.sharedMemBytes, p.kernelParams, p.extra = fn, smem, address, 0
                p.gridDimX, p.gridDimY, p.gridDimZ, p.blockDimX, p.blockDimY, p.blockDimZ = gx, gy, gz, bx, by, bz
                deps = [prev] if prev is not None and cfg is None else None
                node = driver.check(drv.cuGraphAddKernelNode(self._graph, deps, 0 if deps is None else 1, p),
                                    f"cuGraphAddKernelNode({kern!r})")
                if prev is not None and cfg is not None:  # an overlapped launch: a programmatic edge
                    driver.check(drv.cuGraphAddDependencies(self._graph, [prev], [node], [driver.programmatic_edge()], 1),
                                 f"cuGraphAddDependencies({kern!r}, programmatic)")
                prev = node
                if slots:
                    updates.append((prev, p, vals, slots, kern))
            self._exec = driver.check(drv.cuGraphInstantiate(self._graph, 0), "cuGraphInstantiate")
        self.updates = tuple(updates)
        self._set, self._launch, self._ok = drv.cuGraphExecKernelNodeSetParams, drv.cuGraphLaunch, drv.CUresult.CUDA_SUCCESS

    def launch(self, stream: int, ptrs: tuple) -> None:
        """The forward on ``stream`` with the call's addresses ``ptrs`` (see plan.PER_CALL)."""
        ok, ex = self._ok, self._exec
        for node, params, vals, slots, kern in self.updates:
            for i, w in slots:
                vals[i] = ptrs[w]
            err = self._set(ex, node, params)[0]
            if err != ok:
                raise DeviceError(f"updating the graph node of {kern!r} failed: {err}")
        err = self._launch(ex, stream)[0]
        if err != ok:
            raise DeviceError(f"launching the graph of {len(self.bound.items)} kernels failed: {err}")

    def __del__(self):  # best effort: the driver may already be gone at interpreter exit
        try:
            drv = driver.bindings()
            if self._exec is not None:
                drv.cuGraphExecDestroy(self._exec)
            if self._graph is not None:
                drv.cuGraphDestroy(self._graph)
        except Exception:  # noqa: BLE001 - nothing useful to do at teardown
            pass
