"""The CUDA driver calls the machinery makes (through ``cuda.bindings``), each checked.

Modules are loaded into the device's primary context (the one the CUDA runtime, CuPy and torch use),
so a loaded function launches on any of their streams. Nothing here runs at import time.
"""

from __future__ import annotations

import functools
import threading

from ..errors import DeviceError

__all__ = ["CU_FUNC_ATTRIBUTE", "MIN_COMPUTE_CAPABILITY", "MIN_DRIVER_VERSION", "REQUIREMENTS", "bindings", "check",
           "current_context", "func_attribute", "get_function", "launch", "launch_config", "launch_ex", "load_cubin",
           "max_smem_optin", "probe", "programmatic_edge", "set_max_dynamic_smem", "sm_count", "stream_is_capturing"]

#: The oldest driver API this build runs on: CUDA 13.0, i.e. NVIDIA driver R580 or newer.
MIN_DRIVER_VERSION = 13000
#: The oldest GPU: compute capability 8.0 (A100).
MIN_COMPUTE_CAPABILITY = (8, 0)
REQUIREMENTS = "an NVIDIA GPU of compute capability 8.0+ and a CUDA 13 driver (R580 or newer)"

_lock = threading.Lock()

#: CUfunction_attribute values used here (cuda.h).
CU_FUNC_ATTRIBUTE = {"max_threads": 0, "shared_bytes": 1, "const_bytes": 2, "local_bytes": 3, "registers": 4,
                     "max_dynamic_shared_bytes": 8}


@functools.lru_cache(maxsize=1)
def _drv():
    try:
        from cuda.bindings import driver
    except ImportError as exc:  # pragma: no cover - a dependency
        raise DeviceError(f"cuda-bindings is needed to load and launch kernels ({exc})") from exc
    return driver


def _check(result, what: str):
    """``result`` is a cuda.bindings return tuple (error, values...): raise on error, else the values."""
    err = result[0]
    if int(err) != 0:
        raise DeviceError(f"{what} failed: {_error_name(_drv(), err)}")
    return result[1] if len(result) == 2 else result[1:]


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def _error_name(drv, err) -> str:
    try:
        res = drv.cuGetErrorName(err)
        return res[1].decode() if int(res[0]) == 0 and isinstance(res[1], bytes) else str(err)
    except Exception:  # a fake or broken driver module: the raw value still says something
        return str(err)


def probe(device_id: int | None = None) -> tuple[int, int]:
    """Check that this machine can run layers, before anything else touches CUDA: an NVIDIA driver
    (for CUDA 13 or newer) and a GPU (``device_id``, when given, must exist and be of compute
    capability 8.0+). Returns ``(driver version, device count)``; raises :class:`DeviceError`
    saying which is missing: no driver, driver too old, no GPU, no such device, GPU too old."""
    drv = _drv()
    try:
        err, version = drv.cuDriverGetVersion()
    except Exception as exc:  # cuda.bindings could not load libcuda: no NVIDIA driver installed
        first = (str(exc).splitlines() or [""])[0]
        raise DeviceError(f"no NVIDIA driver found (the CUDA driver library could not be loaded: {type(exc).__name__}: "
                          f"{first}); running layers needs {REQUIREMENTS}") from None
    if int(err) != 0:
        raise DeviceError(f"the NVIDIA driver did not report its version ({_error_name(drv, err)}); running layers "
                          f"needs {REQUIREMENTS}")
    version = int(version)
    if version < MIN_DRIVER_VERSION:
        raise DeviceError(f"the NVIDIA driver is too old: it supports CUDA {_cuda_version(version)}, this build needs "
                          f"CUDA {_cuda_version(MIN_DRIVER_VERSION)} or newer (driver R580+); update the driver")
    (err, *_rest) = drv.cuInit(0)
    if int(err) != 0:
        name = _error_name(drv, err)
        if name == "CUDA_ERROR_NO_DEVICE":
            raise DeviceError(f"an NVIDIA driver (CUDA {_cuda_version(version)}) is installed but no GPU is visible "
                              "(check CUDA_VISIBLE_DEVICES and the container's GPU access)")
        raise DeviceError(f"the NVIDIA driver (CUDA {_cuda_version(version)}) failed to initialise: {name}")
    err, count = drv.cuDeviceGetCount()
    count = int(count) if int(err) == 0 else 0
    if count < 1:
        raise DeviceError(f"an NVIDIA driver (CUDA {_cuda_version(version)}) is installed but no GPU is visible")
    if device_id is not None:
        if not 0 <= int(device_id) < count:
            raise DeviceError(f"device {device_id}: this machine has {count} GPU(s), numbered 0..{count - 1}")
        dev = _check(drv.cuDeviceGet(int(device_id)), f"cuDeviceGet({device_id})")
        attr = drv.CUdevice_attribute
        cc = tuple(int(_check(drv.cuDeviceGetAttribute(getattr(attr, f"CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_{m}"), dev),
                              "cuDeviceGetAttribute")) for m in ("MAJOR", "MINOR"))
        if cc < MIN_COMPUTE_CAPABILITY:
            raise DeviceError(f"GPU {device_id} has compute capability {cc[0]}.{cc[1]}; this build needs "
                              f"{MIN_COMPUTE_CAPABILITY[0]}.{MIN_COMPUTE_CAPABILITY[1]} or newer (A100, L4/L40, H100/H200)")
    return version, count


@functools.cache
def sm_count(device_id: int) -> int:
    """Multiprocessors of ``device_id`` (the launch-geometry rules size grids by it)."""
    drv = _drv()
    dev = _check(drv.cuDeviceGet(int(device_id)), f"cuDeviceGet({device_id})")
    attr = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
    return int(_check(drv.cuDeviceGetAttribute(attr, dev), "cuDeviceGetAttribute(multiprocessor count)"))


@functools.cache
def max_smem_optin(device_id: int) -> int:
    """Dynamic shared memory one block of ``device_id`` may opt in to, bytes (the engines size their rings and
    route tiles to it: 99 KiB on sm_86 / sm_89, 163 KiB on sm_80, 227 KiB on sm_90)."""
    drv = _drv()
    dev = _check(drv.cuDeviceGet(int(device_id)), f"cuDeviceGet({device_id})")
    attr = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
    return int(_check(drv.cuDeviceGetAttribute(attr, dev), "cuDeviceGetAttribute(max shared memory per block opt-in)"))


@functools.cache
def _primary_context(device_id: int):
    drv = _drv()
    try:
        _check(drv.cuInit(0), "cuInit")
        dev = _check(drv.cuDeviceGet(int(device_id)), f"cuDeviceGet({device_id})")
        return _check(drv.cuDevicePrimaryCtxRetain(dev), f"cuDevicePrimaryCtxRetain({device_id})")
    except DeviceError:
        raise
    except Exception as exc:  # no driver library at all
        raise DeviceError(f"no usable CUDA driver for device {device_id}: {type(exc).__name__}: {exc}") from exc


class current_context:
    """``with current_context(device_id):`` the device's primary context is current (driver calls that
    need one: module loads, graph instantiation)."""

    def __init__(self, device_id: int):
        self.ctx = _primary_context(int(device_id))

    def __enter__(self):
        with _lock:
            _check(_drv().cuCtxPushCurrent(self.ctx), "cuCtxPushCurrent")
        return self

    def __exit__(self, *exc):
        _check(_drv().cuCtxPopCurrent(), "cuCtxPopCurrent")
        return False


def bindings():
    """The ``cuda.bindings.driver`` module (imported on first use)."""
    return _drv()


def check(result, what: str):
    """Raise :class:`DeviceError` naming ``what`` unless ``result`` (a cuda.bindings return tuple) is a
    success; returns its values."""
    return _check(result, what)


def load_cubin(cubin: bytes, device_id: int):
    """Load a cubin on ``device_id``; returns the CUmodule (kept alive by the caller)."""
    drv = _drv()
    ctx = _primary_context(int(device_id))
    with _lock:
        _check(drv.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
        try:
            return _check(drv.cuModuleLoadData(cubin), "cuModuleLoadData")
        finally:
            _check(drv.cuCtxPopCurrent(), "cuCtxPopCurrent")


def get_function(module, lowered_name: str):
    """A function of a loaded module, fully loaded now (``cuFuncLoad``): with CUDA's lazy module loading
    its code would otherwise be loaded at its first launch, which for a layer planned by ``reserve()``
    can be inside a graph capture; loading at plan time keeps that work out of the capture."""
    drv = _drv()
    fn = _check(drv.cuModuleGetFunction(module, lowered_name.encode()), f"cuModuleGetFunction({lowered_name})")
    load = getattr(drv, "cuFuncLoad", None)
    if load is not None:
        _check(load(fn), f"cuFuncLoad({lowered_name})")
    else:  # older bindings: querying an attribute loads the function too
        func_attribute(fn, "registers")
    return fn


def set_max_dynamic_smem(function, nbytes: int) -> None:
    """Let ``function`` take ``nbytes`` of dynamic shared memory (static + dynamic may pass 48 KiB)."""
    drv = _drv()
    attr = drv.CUfunction_attribute(CU_FUNC_ATTRIBUTE["max_dynamic_shared_bytes"])
    _check(drv.cuFuncSetAttribute(function, attr, int(nbytes)), f"cuFuncSetAttribute(max dynamic smem {nbytes})")


def func_attribute(function, name: str) -> int:
    drv = _drv()
    attr = drv.CUfunction_attribute(CU_FUNC_ATTRIBUTE[name])
    return int(_check(drv.cuFuncGetAttribute(attr, function), f"cuFuncGetAttribute({name})"))


def launch(function, grid, block, shared_mem: int, stream: int, params_address: int) -> None:
    """``cuLaunchKernel`` with a packed ``void**`` parameter array (see :class:`~qmoe_rtc.jit.args.ParamBlock`)."""
    err = _drv().cuLaunchKernel(function, grid[0], grid[1], grid[2], block[0], block[1], block[2], shared_mem,
                                stream, params_address, 0)[0]
    if int(err) != 0:
        _check((err,), f"cuLaunchKernel(grid {tuple(grid)}, block {tuple(block)}, smem {shared_mem})")


def launch_config(grid, block, shared_mem: int, overlap: bool):
    """A ``CUlaunchConfig`` for :func:`launch_ex`; ``overlap`` sets programmatic stream serialization (the
    kernel may start before the previous one on the stream ends; sm_90+). The stream is set per launch."""
    drv = _drv()
    cfg = drv.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = (int(g) for g in grid)
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = (int(b) for b in block)
    cfg.sharedMemBytes = int(shared_mem)
    if overlap:
        attr = drv.CUlaunchAttribute()
        attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        cfg.attrs = [attr]
        cfg.numAttrs = 1
    return cfg


def launch_ex(config, function, stream: int, params_address: int) -> None:
    """``cuLaunchKernelEx`` on ``stream`` with a config from :func:`launch_config`."""
    drv = _drv()
    config.hStream = stream
    err = drv.cuLaunchKernelEx(config, function, params_address, 0)[0]
    if int(err) != 0:
        _check((err,), f"cuLaunchKernelEx(grid {(config.gridDimX, config.gridDimY, config.gridDimZ)}, overlapped)")


def programmatic_edge():
    """Graph edge data of a programmatic dependency (what capturing an overlapped launch records)."""
    drv = _drv()
    edge = drv.CUgraphEdgeData()
    edge.from_port = drv.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
    edge.type = drv.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
    return edge


def stream_is_capturing(stream: int) -> bool:
    """True while ``stream`` (a raw CUstream handle) is being captured into a graph."""
    drv = _drv()
    res = drv.cuStreamIsCapturing(stream)
    if int(res[0]) == int(drv.CUresult.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT):
        return True  # the legacy stream while another stream captures: treat as capturing (nothing may allocate)
    return int(_check(res, "cuStreamIsCapturing")) != int(drv.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE)
