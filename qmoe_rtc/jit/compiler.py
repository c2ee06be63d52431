"""NVRTC front end: generated unit -> SASS cubin for one exact architecture.

Never PTX: a driver cannot JIT PTX newer than itself, while a cubin compiled by a newer NVRTC of the
same major version loads fine (docs/runtime-compilation.md). Works without a GPU when the arch is explicit.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CompileError, DeviceError, KnobError, QMoEAttributeError
from ..settings import knobs

__all__ = [
    "SUPPORTED_ARCHS",
    "CompiledModule",
    "check_arch",
    "default_arch",
    "nvrtc_version",
    "cuda_src_dir",
    "cuda_include_dir",
    "base_options",
    "key_options",
    "compile_unit",
    "compile_ptx_listing",
]

log = logging.getLogger("qmoe_rtc")

#: Architectures we build and test for. Others matching ``sm_<digits>[a|f]`` are accepted too.
SUPPORTED_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_90a")
_ARCH_RE = re.compile(r"^sm_(\d{2,3})([af]?)$")

#: CUDA headers our templates include (their bytes go into the cache key).
CUDA_HEADERS = ("cuda_fp16.h", "cuda_fp16.hpp", "cuda_bf16.h", "cuda_bf16.hpp")


@dataclass(frozen=True)
class CompiledModule:
    """A compiled module: raw cubin plus what is needed to find its kernels.

    ``lowered`` maps kernel key -> lowered (mangled) name. ``origin`` is where this copy came
    from: 'compiled', 'disk' or 'memory'; ``ms`` the time that took.
    """

    name: str
    family: str
    key: str
    arch: str
    cubin: bytes = field(repr=False)
    lowered: dict
    options: tuple = ()
    nvrtc: tuple = ()
    origin: str = "compiled"
    ms: float = 0.0


def check_arch(arch: str) -> str:
    """Validate a cubin target ('sm_90', 'sm_90a' ...): 'compute_XX' (PTX) is refused, and so is a GPU
    older than the kernels need (compute capability 8.0: cp.async, bf16 mma), before any compile."""
    m = _ARCH_RE.match(arch) if isinstance(arch, str) else None
    if m is None:
        raise QMoEAttributeError("arch", "a SASS target like sm_80, sm_86, sm_89, sm_90 or sm_90a (never compute_XX)", repr(arch))
    from .driver import MIN_COMPUTE_CAPABILITY

    major, minor = MIN_COMPUTE_CAPABILITY
    if int(m.group(1)) < 10 * major + minor:
        raise QMoEAttributeError("arch", f"sm_{major}{minor} or newer (the kernels use cp.async and bfloat16 tensor-core "
                                 "MMAs: A100, L4/L40, H100/H200)", repr(arch))
    return _ARCH_SPECIFIC.get(arch, arch)


#: Targets compiled as their arch-specific variant: a Hopper cubin is built for sm_90a (it runs on every
#: sm_90 GPU and has the warpgroup MMA the wgmma prefill engine needs); 'sm_90' means the same thing.
_ARCH_SPECIFIC = {"sm_90": "sm_90a"}


#: What :func:`default_arch`'s error suggests; the warm CLI catches the error and says ``--arch sm_XX``.
ARCH_HINT = "pass the architecture explicitly, e.g. arch='sm_90' (H100/H200) or arch='sm_80' (A100)"


def default_arch(device: int | None = None) -> str:
    """The architecture of ``device`` (default: CuPy's current device), resolved only when called.

    Without a usable GPU: :class:`DeviceError` saying why (no driver, driver too old, no GPU) and that
    the architecture can be given explicitly."""
    from . import driver

    if device is not None and device in _ARCH_OF:
        return _ARCH_OF[device]
    try:
        driver.probe(device)
        import cupy

        dev = cupy.cuda.Device(device) if device is not None else cupy.cuda.Device()
        cc = dev.compute_capability  # e.g. '90'
    except DeviceError as exc:
        raise DeviceError(f"cannot take the GPU architecture from this machine: {exc}; {ARCH_HINT}") from None
    except Exception as exc:  # CuPy missing or broken
        raise DeviceError(f"cannot take the GPU architecture from this machine ({type(exc).__name__}: {exc}); "
                          f"{ARCH_HINT}") from exc
    if device is not None:
        _ARCH_OF[device] = check_arch(f"sm_{cc}")
    return check_arch(f"sm_{cc}")


_ARCH_OF: dict[int, str] = {}  # device id -> its arch (a device does not change its architecture)


def _nvrtc():
    from cuda.bindings import nvrtc

    return nvrtc


def _check(result, what: str, name: str = "", options=(), source: str = "", prog=None) -> None:
    nvrtc = _nvrtc()
    if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        log_text = _program_log(prog) if prog is not None else ""
        err = nvrtc.nvrtcGetErrorString(result)[1]
        msg = err.decode() if isinstance(err, bytes) else str(err)
        raise CompileError(name or what, f"{what}: {msg}\n{log_text}".rstrip(), tuple(options), source)


def _program_log(prog) -> str:
    nvrtc = _nvrtc()
    res, size = nvrtc.nvrtcGetProgramLogSize(prog)
    if res != nvrtc.nvrtcResult.NVRTC_SUCCESS or size <= 1:
        return ""
    buf = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, buf)
    return buf.rstrip(b"\x00").decode(errors="replace")


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    nvrtc = _nvrtc()
    res, major, minor = nvrtc.nvrtcVersion()
    _check(res, "nvrtcVersion")
    return (int(major), int(minor))


@functools.cache
def cuda_src_dir() -> Path:
    """Our device-template directory (``qmoe_rtc/cuda_src``)."""
    return Path(__file__).resolve().parent.parent / "cuda_src"


def _candidate_include_dirs():
    # 1. headers shipped with the pip NVRTC/runtime wheels (match the NVRTC we load)
    try:
        import nvidia  # namespace package of the NVIDIA wheels

        for base in getattr(nvidia, "__path__", []):
            for sub in ("cu13", "cuda_runtime", "cuda_nvrtc", "cu12"):
                yield Path(base) / sub / "include"
    except ImportError:
        pass
    # 2. a CUDA toolkit
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            yield Path(os.environ[env]) / "include"
    yield Path("/usr/local/cuda/include")


@functools.cache
def cuda_include_dir() -> Path:
    """First directory holding ``cuda_fp16.h``: pip wheels, then $CUDA_HOME, $CUDA_PATH, /usr/local/cuda."""
    tried = []
    for d in _candidate_include_dirs():
        tried.append(str(d))
        if (d / "cuda_fp16.h").is_file():
            return d
    raise CompileError("<setup>", "CUDA headers (cuda_fp16.h) not found; tried: " + ", ".join(tried))


#: Tuning knob split_compile -> the NVRTC options it adds (0: as many threads as the machine has)
SPLIT_COMPILE_OPTIONS = {"off": (), "ptxas": ("-Xptxas", "--split-compile=0"),
                         "all": ("-Xptxas", "--split-compile=0", "--split-compile=0")}


def base_options(arch: str, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The exact NVRTC options for a unit (include dirs last)."""
    opts = [f"-arch={check_arch(arch)}", "-std=c++17", "--device-as-default-execution-space", "-DNDEBUG"]
    if knobs.get("lineinfo"):
        opts.append("-lineinfo")
    split = knobs.get("split_compile")
    if split not in SPLIT_COMPILE_OPTIONS:
        raise KnobError(knobs.label("split_compile"), f"one of {sorted(SPLIT_COMPILE_OPTIONS)}", repr(split))
    opts += SPLIT_COMPILE_OPTIONS[split]
    opts += list(extra)
    opts += [f"-I{cuda_src_dir()}", f"-I{cuda_include_dir()}"]
    return tuple(opts)


def key_options(options: tuple[str, ...]) -> tuple[str, ...]:
    """Options as they enter the cache key: include paths become labels (their contents are hashed
    separately), so a cache warmed on one machine is valid on another."""
    src, inc = f"-I{cuda_src_dir()}", f"-I{cuda_include_dir()}"
    out = []
    for o in options:
        if o == src:
            out.append("-I<qmoe_rtc/cuda_src>")
        elif o == inc:
            out.append("-I<cuda/include>")
        elif o.startswith("-I") or o.startswith("--include-path"):
            raise CompileError("<options>", f"include option {o!r} is invisible to the cache key; refused", tuple(options))
        else:
            out.append(o)
    return tuple(out)


def compile_unit(name: str, source: str, name_exprs: dict[str, str], arch: str,
                 options: tuple[str, ...]) -> tuple[bytes, dict[str, str], str]:
    """Compile ``source`` to a cubin for ``arch``.

    ``name_exprs`` maps kernel key -> C++ name expression. Returns (cubin, {key: lowered name},
    NVRTC log). Raises :class:`CompileError` (log, options, source attached).
    """
    nvrtc = _nvrtc()
    check_arch(arch)
    opts = [o.encode() for o in options]
    res, prog = nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], [])
    _check(res, "nvrtcCreateProgram", name, options, source)
    try:
        for expr in name_exprs.values():
            (res,) = nvrtc.nvrtcAddNameExpression(prog, expr.encode())
            _check(res, f"nvrtcAddNameExpression({expr})", name, options, source, prog)
        (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        text = _program_log(prog)
        if res != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(name, text or str(res), tuple(options), source)
        res, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check(res, "nvrtcGetCUBINSize", name, options, source, prog)
        if size == 0:
            raise CompileError(name, "NVRTC produced no cubin (is the arch a real sm_XX?)", tuple(options), source)
        cubin = b" " * size
        (res,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        _check(res, "nvrtcGetCUBIN", name, options, source, prog)
        lowered = {}
        for key, expr in name_exprs.items():
            res, low = nvrtc.nvrtcGetLoweredName(prog, expr.encode())
            _check(res, f"nvrtcGetLoweredName({expr})", name, options, source, prog)
            lowered[key] = low.decode() if isinstance(low, bytes) else str(low)
        return bytes(cubin), lowered, text
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def compile_ptx_listing(name: str, source: str, name_exprs: dict[str, str], arch: str,
                        options: tuple[str, ...]) -> str:
    """PTX of the unit, for reading only (dump knob). Never cached, never loaded."""
    nvrtc = _nvrtc()
    m = _ARCH_RE.match(arch)
    virt = f"-arch=compute_{m.group(1)}{m.group(2)}" if m else "-arch=compute_80"
    opts = [virt.encode() if o.startswith("-arch=") else o.encode() for o in options]
    res, prog = nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], [])
    try:
        for expr in name_exprs.values():
            nvrtc.nvrtcAddNameExpression(prog, expr.encode())
        (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if res != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            return "// PTX listing failed:\n// " + _program_log(prog).replace("\n", "\n// ")
        res, size = nvrtc.nvrtcGetPTXSize(prog)
        buf = b" " * size
        nvrtc.nvrtcGetPTX(prog, buf)
        return buf.rstrip(b"\x00").decode(errors="replace")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _file_sig(p: Path) -> tuple:
    st = p.stat()
    return (str(p), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _hash_files(sigs: tuple) -> str:
    h = hashlib.sha256()
    for path, _size, _mtime in sigs:
        p = Path(path)
        data = p.read_bytes()
        h.update(f"{p.name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


@functools.lru_cache(maxsize=4)
def _template_files(root: Path) -> tuple[Path, ...]:
    return tuple(sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".cuh", ".cu", ".h")))


def cuda_src_digest() -> str:
    """Hash of every file under cuda_src (names + bytes): the whole include closure and more.
    Memoised on (path, size, mtime), so an edited template is noticed without a restart. The listing is
    read once a process (a key is computed on every plan: walking the tree each time cost ~0.4 ms); a
    file added later counts once a template that includes it is edited, which changes that one's mtime."""
    return _hash_files(tuple(_file_sig(p) for p in _template_files(cuda_src_dir())))


def cuda_headers_digest() -> str:
    """Hash of the CUDA headers our templates include, from the include dir in use."""
    d = cuda_include_dir()
    files = [d / h for h in CUDA_HEADERS if (d / h).is_file()]
    return _hash_files(tuple(_file_sig(p) for p in files))
