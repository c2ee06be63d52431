"""The caller's arrays and streams: CuPy arrays and torch CUDA tensors are read in place (shape, dtype,
device address: no DLPack and no copy on the call path), NumPy arrays are uploaded; the stream is
the caller's current one (torch's for torch inputs, CuPy's otherwise).
"""

from __future__ import annotations

from .._arrays import ArrayMeta, dtype_name, is_c_contiguous, is_cupy, is_torch, np_dtype
from ..errors import DeviceError, QMoEInputError

__all__ = ["allocate_like", "array_meta", "cupy", "cupy_stream", "current_stream", "data_ptr", "parse_device", "signature",
           "to_cupy"]

_DLPACK_CUDA = (2, 13)  # kDLCUDA, kDLCUDAManaged

_CUPY, _TORCH, _OTHER = 1, 2, 3
_kinds: dict[type, int] = {}


def cupy():
    try:
        import cupy as cp
    except ImportError as exc:  # pragma: no cover - a dependency
        raise DeviceError(f"the GPU executor needs CuPy ({exc})") from exc
    return cp


class _StreamHandle:
    """A raw ``cudaStream_t`` speaking the CUDA stream protocol (what ``cupy.cuda.Stream.from_external`` reads)."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = int(handle)

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def cupy_stream(handle: int, device_id: int):
    """CuPy's view of the raw stream ``handle`` of ``device_id`` (for ``with`` blocks and graph launches):
    ``Stream.from_external`` where CuPy has it (14+, where ``ExternalStream`` is deprecated), the
    null stream for handle 0."""
    cp = cupy()
    if int(handle) == 0:
        return cp.cuda.Stream.null
    from_external = getattr(cp.cuda.Stream, "from_external", None)
    if from_external is None:  # CuPy 13
        return cp.cuda.ExternalStream(int(handle), device_id)
    return from_external(_StreamHandle(handle))


def _kind(a) -> int:
    t = type(a)
    k = _kinds.get(t)
    if k is None:
        k = _kinds[t] = _CUPY if is_cupy(a) else (_TORCH if is_torch(a) else _OTHER)
    return k


def signature(a) -> tuple | None:
    """What validation looks at (array type, shape, strides, dtype, device): equal signatures validate
    alike, so a call's checks run once per signature. Cheap attribute reads only (no DLPack)."""
    if a is None:
        return None
    k = _kinds.get(type(a)) or _kind(a)
    if k == _CUPY:
        return (k, a.shape, a.strides, a.dtype, a.data.device_id)
    if k == _TORCH:
        return (k, a.shape, a.stride(), a.dtype, a.device)
    return (k, type(a))


def data_ptr(a) -> int:
    """Device address of a CuPy array or torch tensor (0 for None)."""
    if a is None:
        return 0
    k = _kinds.get(type(a)) or _kind(a)
    if k == _CUPY:
        return a.data.ptr
    if k == _TORCH:
        return a.data_ptr()
    raise QMoEInputError("input", "a CuPy array or a torch CUDA tensor", type(a).__name__)


def is_host_array(a) -> bool:
    return a is not None and _kind(a) == _OTHER and hasattr(a, "shape") and hasattr(a, "dtype")


def is_host_signature(sig) -> bool:
    """A signature of something that is neither a CuPy array nor a torch tensor (uploaded, or refused)."""
    return sig is not None and sig[0] == _OTHER


def array_meta(name: str, a) -> ArrayMeta | None:
    """Shape, dtype, contiguity and device of a layer tensor, read without touching CUDA (nothing is
    imported or uploaded): what :meth:`QMoE.__init__` validates before anything goes to the GPU.
    Refuses what :func:`to_cupy` could not take (host torch tensors, objects that are no arrays)."""
    if a is None:
        return None
    shape = tuple(int(d) for d in getattr(a, "shape", ()))
    if is_cupy(a):
        return ArrayMeta(shape, dtype_name(a), is_c_contiguous(a), int(a.device.id))
    if is_torch(a):
        if a.device.type != "cuda":
            raise QMoEInputError(name, "a CUDA tensor, a CuPy array or a NumPy array", f"a torch tensor on {a.device}")
        return ArrayMeta(shape, dtype_name(a), bool(a.is_contiguous()), int(a.device.index))
    if hasattr(a, "__dlpack__") and not type(a).__module__.startswith("numpy"):
        try:
            kind, dev = a.__dlpack_device__()
        except Exception as exc:
            raise QMoEInputError(name, "a CUDA array exportable through DLPack", f"{type(a).__name__} ({exc})") from None
        if int(kind) not in _DLPACK_CUDA:
            raise QMoEInputError(name, "a CUDA array exportable through DLPack", f"{type(a).__name__} in host memory")
        return ArrayMeta(shape, dtype_name(a), is_c_contiguous(a), int(dev))
    if hasattr(a, "shape") and hasattr(a, "dtype"):
        return ArrayMeta(shape, dtype_name(a), is_c_contiguous(a), None)
    raise QMoEInputError(name, "a CuPy array, a torch CUDA tensor or a NumPy array", type(a).__name__)


def parse_device(device) -> int | None:
    """The device index of ``device``: None, an int, ``'cuda'`` / ``'cuda:N'``, a ``torch.device`` or a
    CuPy ``Device``; anything else is a :class:`QMoEInputError` naming ``device``."""
    if device is None:
        return None
    if isinstance(device, int) and not isinstance(device, bool):
        idx = device
    elif isinstance(device, str):
        text = device.strip().lower()
        if text == "cuda":
            return None
        head, _, tail = text.partition(":")
        if head != "cuda" or not tail.isdigit():
            raise QMoEInputError("device", "None, a device index (0, 1 ...) or 'cuda:N'", repr(device))
        idx = int(tail)
    elif getattr(device, "type", None) == "cuda":  # torch.device("cuda", n)
        return None if device.index is None else int(device.index)
    elif is_cupy(device) and hasattr(device, "id"):  # cupy.cuda.Device
        idx = int(device.id)
    else:
        raise QMoEInputError("device", "None, a device index (0, 1 ...) or 'cuda:N'", repr(device))
    if idx < 0:
        raise QMoEInputError("device", "a non-negative device index", repr(device))
    return idx


def to_cupy(name: str, a, device_id: int):
    """A CuPy view of a CuPy array or CUDA tensor (DLPack, zero copy), or a device copy of a NumPy array
    (layer construction only: never on the call path). float8_e4m3fn arrays (FP8 expert weights) are
    read as their uint8 codes (CuPy has no float8 dtype)."""
    if a is None:
        return None
    cp = cupy()
    if dtype_name(a) == "float8_e4m3fn":
        a = _codes_view(a)
    if is_cupy(a):
        return a
    if hasattr(a, "__dlpack__") and not type(a).__module__.startswith("numpy"):
        try:
            return cp.from_dlpack(a)
        except Exception as exc:
            raise QMoEInputError(name, "a CUDA array exportable through DLPack", f"{type(a).__name__} ({exc})") from None
    if hasattr(a, "shape") and hasattr(a, "dtype"):
        with cp.cuda.Device(device_id):
            return cp.asarray(a)
    raise QMoEInputError(name, "a CuPy array, a torch CUDA tensor or a NumPy array", type(a).__name__)


def _codes_view(a):
    """The uint8 codes of a float8_e4m3fn NumPy array or torch tensor (a view, no copy)."""
    if is_torch(a):
        import torch

        return a.view(torch.uint8)
    import numpy as np

    return a.view(np.uint8)


def _torch_raw_stream():
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what torch's own compiled kernels use
    if raw is not None:
        return raw
    return lambda device: torch.cuda.current_stream(device).cuda_stream


def current_stream(a, device_id: int):
    """A function ``device -> raw stream handle`` of the caller's current stream for input ``a``."""
    if _kind(a) == _TORCH:
        return _torch_raw_stream()
    cp = cupy()
    return lambda device: cp.cuda.get_current_stream(device).ptr


def allocate_like(a, shape, dtype: str, device_id: int):
    """An uninitialised output of ``shape`` / ``dtype`` of the same array type as ``a``, on ``device_id``."""
    if _kind(a) == _TORCH:
        import torch

        return torch.empty(shape, dtype=getattr(torch, dtype), device=f"cuda:{device_id}")
    cp = cupy()
    with cp.cuda.Device(device_id):
        return cp.empty(shape, dtype=np_dtype(dtype))

