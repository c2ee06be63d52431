"""Compile/cache machinery: NVRTC -> cubin, two-tier cache, argument packing and launch.

Public API (see docs/runtime-compilation.md)::

    get_cubin(spec, arch=None) -> CompiledModule        # no GPU needed with an explicit arch
    get_cubins(family, layout_or_config, arch=None) -> [CompiledModule]
    load_module(spec, device=None) -> LoadedModule      # needs a GPU; memoised per device
    load_kernels(spec, device=None) -> {key: Kernel}
    Kernel(grid, block, args, shared_mem=0, stream=None)
"""

from .cache import (
    SCHEMA_VERSION,
    LoadedModule,
    cache_key,
    clear_memory,
    disk_entry_dir,
    get_cubin,
    get_cubins,
    load_kernels,
    load_module,
)
from .compiler import SUPPORTED_ARCHS, CompiledModule, check_arch, default_arch, nvrtc_version
from .family import CPP_TYPES, KernelDef, KernelFamily, Launch, Ptr, Scalar
from .launch import Kernel, pack_args

__all__ = [
    "SCHEMA_VERSION",
    "SUPPORTED_ARCHS",
    "CPP_TYPES",
    "CompiledModule",
    "Kernel",
    "KernelDef",
    "KernelFamily",
    "Launch",
    "LoadedModule",
    "Ptr",
    "Scalar",
    "cache_key",
    "check_arch",
    "clear_memory",
    "default_arch",
    "disk_entry_dir",
    "get_cubin",
    "get_cubins",
    "load_kernels",
    "load_module",
    "nvrtc_version",
    "pack_args",
]
