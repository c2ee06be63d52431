"""Compile/cache machinery: compile units in, cubins and loaded modules out. It knows no kernel family
and no layout (a test checks that nothing here imports ``qmoe_rtc.kernels`` or ``qmoe_rtc.specialize``).

    unit = CompileUnit(name, source, kernels, defines)   # built by a kernel family
    get_cubin(unit, arch=None) -> CompiledModule          # no GPU needed with an explicit arch
    store_cubin(unit, arch) -> CompiledModule             # the same, and the entry on disk (the warm tool)
    load_module(unit, device=None) -> LoadedModule        # needs a GPU; memoised per (device, unit key)
    module[key](grid, block, args, shared_mem=0, stream=None)
"""

from .args import CTYPES, KernelDef, Launch, ParamBlock, Ptr, Scalar, Struct
from .cache import LoadedModule, check_stored, clear_memory, disk_entry_dir, entry_stem, get_cubin, load_module, store_cubin
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
    "load_module",
    "nvrtc_version",
    "store_cubin",
    "unit_key",
]
