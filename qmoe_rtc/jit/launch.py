"""A loaded kernel: its argument specs, its CUfunction on one device, and a checked launch."""

from __future__ import annotations

from ..errors import QMoEInputError
from . import driver
from .args import KernelDef, Launch, ParamBlock

__all__ = ["Kernel"]


class Kernel:
    """One ``__global__`` function of a loaded module.

    ``kernel(grid, block, args, shared_mem=0, stream=None)`` checks and packs ``args`` (positional, in
    the spec's order, struct members flattened) and launches: the general path for tools and tests.
    The executor packs a :class:`~qmoe_rtc.jit.args.ParamBlock` once per plan and calls
    :meth:`launch_packed`.
    """

    def __init__(self, kdef: KernelDef, function, device_id: int, module_name: str = ""):
        self.kdef = kdef
        self.function = function
        self.device_id = device_id
        self.module_name = module_name
        self._max_dyn_smem = 0  # opted-in dynamic shared memory

    @property
    def key(self) -> str:
        return self.kdef.key

    def reserve_dynamic_smem(self, nbytes: int) -> None:
        """Opt in to ``nbytes`` of dynamic shared memory; only ever raised (the attribute is a maximum and
        every launcher of this kernel goes through here)."""
        if nbytes > self._max_dyn_smem:
            driver.set_max_dynamic_smem(self.function, int(nbytes))
            self._max_dyn_smem = int(nbytes)

    def attribute(self, name: str) -> int:
        """A function attribute: ``registers``, ``local_bytes``, ``shared_bytes`` ... (see driver.CU_FUNC_ATTRIBUTE)."""
        return driver.func_attribute(self.function, name)

    def pack(self, values: dict) -> ParamBlock:
        return ParamBlock(self.kdef, values, self.device_id)

    def launch_packed(self, launch: Launch, params: ParamBlock, stream: int) -> None:
        driver.launch(self.function, launch.grid, launch.block, launch.shared_mem, stream, params.address)

    def __call__(self, grid, block, args, *, shared_mem: int = 0, stream=None) -> None:
        args = tuple(args)
        names = self.kdef.arg_names()
        if len(args) != len(names):
            raise QMoEInputError(self.kdef.key, f"{len(names)} arguments {list(names)}",
                                 f"{len(args)}")
        grid = tuple(int(g) for g in (grid if isinstance(grid, tuple) else (grid,))) + (1, 1)
        block = tuple(int(b) for b in (block if isinstance(block, tuple) else (block,))) + (1, 1)
        grid, block = grid[:3], block[:3]
        if min(grid) <= 0 or min(block) <= 0:
            raise QMoEInputError(f"{self.kdef.key}.launch", "positive grid and block dimensions", f"grid {grid} block {block}")
        params = self.pack(dict(zip(names, args)))
        self.reserve_dynamic_smem(shared_mem)
        if stream is None:  # CuPy's current stream, as a CuPy launch would use
            import cupy

            stream = cupy.cuda.get_current_stream()
        handle = int(getattr(stream, "ptr", stream))
        self.launch_packed(Launch(grid, block, int(shared_mem)), params, handle)

    def __repr__(self) -> str:
        return f"Kernel({self.module_name}:{self.kdef.key})"
