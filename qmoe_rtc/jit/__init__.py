"""Compile/cache machinery: compile units in, cubins and loaded modules out. It knows no kernel family
and no layout (a test checks that nothing here imports ``qmoe_rtc.kernels`` or ``qmoe_rtc.specialize``).

    unit = CompileUnit(name, source, kernels, defines, parts=())  # built by a kernel family
    get_cubin(unit, arch=None) -> CompiledModule          # no GPU needed with an explicit arch
    get_cubins(unit, arch=None) -> (CompiledModule, ...)  # one per piece of a unit with parts, side by side
    store_cubin(s)(unit, arch)                            # the same, and the entries on disk (the warm tool)
    load_module(unit, device=None) -> LoadedModule        # needs a GPU; memoised per (device, unit key)
    load_modules(units, device=None, kernels=None)  # the same, every unit's pieces side by side (or those holding `kernels`)
    module[key](grid, block, args, shared_mem=0, stream=None)
"""

from .args import CTYPES, KernelDef, Launch, ParamBlock, Ptr, Scalar, Struct
from .cache import (
    LoadedModule,
    check_stored,
    clear_memory,
    disk_entry_dir,
    entry_stem,
    get_cubin,
    get_cubins,
    load_module,
    load_modules,
    store_cubin,
    store_cubins,
)
from .compiler import SUPPORTED_ARCHS, CompiledModule, check_arch, default_arch, nvrtc_version
from .launch import Kernel
from .unit import SCHEMA_VERSION, CompileUnit, unit_key

__all__ = [
    "CTYPES",
    "SCHEMA_VERSION",
    "SUPPORTED_ARCHS",
    "CompileUnit",
    "CompiledModule",
    "Kernel",
    "KernelDef",
    "Launch",
    "LoadedModule",
    "ParamBlock",
    "Ptr",
    "Scalar",
    "Struct",
    "check_arch",
    "check_stored",
    "clear_memory",
    "default_arch",
    "disk_entry_dir",
    "entry_stem",
    "get_cubin",
    "get_cubins",
    "load_module",
    "load_modules",
    "nvrtc_version",
    "store_cubin",
    "store_cubins",
    "unit_key",
]
