"""Typed exceptions raised by qmoe_rtc: every refusal is a :class:`QMoEError`.

::

    QMoEError
    ├── QMoEInputError          a bad input tensor or parameter (names it, expected, actual)
    │   ├── QMoEAttributeError  a bad attribute value (k, activation_type, block_size ...)
    │   │   └── WeightFormatError   an unknown weight format name or quant_type
    │   └── KnobError           a QMOE_RTC_* environment variable (or knob override) has a bad value
    ├── QMoEUnsupportedError    a valid layer this build cannot run (names the limit)
    ├── DeviceError             no GPU / no driver / driver too old / array on another device
    ├── CaptureError            something not allowed inside CUDA graph capture
    ├── CompileError            NVRTC refused a generated unit (log, options, source)
    └── CacheError              the on-disk kernel cache
        ├── CacheMissError      strict mode: a module is not on disk
        ├── CacheCorruptError   an entry failed its integrity check (the cache treats it as a miss)
        └── CacheLocationError  the cache directory cannot be used to store (the warm tool)

``except qmoe_rtc.QMoEInputError`` catches every refusal of bad input, attributes and knobs included.
Nothing in the package uses ``assert`` for runtime checks.
"""

from __future__ import annotations

__all__ = [
    "QMoEError",
    "QMoEInputError",
    "QMoEAttributeError",
    "QMoEUnsupportedError",
    "CompileError",
    "CacheError",
    "CacheMissError",
    "CacheCorruptError",
    "CacheLocationError",
    "DeviceError",
    "CaptureError",
    "KnobError",
    "WeightFormatError",
]


class QMoEError(Exception):
    """Base class of every error raised by qmoe_rtc."""


class _ExpectedActual(QMoEError, ValueError):
    """A named value that is not what was expected: ``{kind} '{name}': expected ..., got ...``."""

    kind = "value"

    def __init__(self, name: str, expected: str, actual: str, hint: str | None = None):
        self.name = name
        self.expected = expected
        self.actual = actual
        self.hint = hint
        msg = f"{self.kind} '{name}': expected {expected}, got {actual}"
        if hint:
            msg += f" ({hint})"
        super().__init__(msg)

    def __reduce__(self):
        return (type(self), (self.name, self.expected, self.actual, self.hint))


class QMoEInputError(_ExpectedActual):
    """Bad input: an input tensor that is malformed (rank, shape, dtype, layout, content) or a parameter
    with a bad value (``device``, ``decode_max_routes``, a :func:`~qmoe_rtc.formats.quantize.quantize` argument).

    ``name`` is the ONNX Runtime input name (e.g. ``"fc1_scales"``) or the parameter's name;
    ``expected`` and ``actual`` are short human-readable descriptions.
    """

    kind = "input"


class QMoEAttributeError(QMoEInputError):
    """An attribute (``k``, ``activation_type``, ``block_size`` ...) has a bad value (a kind of bad
    input: ``except QMoEInputError`` catches it)."""

    kind = "attribute"


class QMoEUnsupportedError(QMoEError, NotImplementedError):
    """A valid request that this build cannot serve (said plainly, naming the limit; never silently degraded)."""


class CompileError(QMoEError):
    """NVRTC refused a generated translation unit.

    Carries the compiler log, the options, the kernel/module name and the source, and survives
    pickling so warm-up worker processes can report it.
    """

    def __init__(self, name: str, log: str, options: tuple[str, ...] = (), source: str = ""):
        self.name = name
        self.log = log
        self.options = tuple(options)
        self.source = source
        super().__init__(f"NVRTC failed to compile '{name}' (options: {' '.join(self.options)}):\n{log}")

    def __reduce__(self):
        return (type(self), (self.name, self.log, self.options, self.source))

    def numbered_source(self) -> str:
        """The source with 1-based line numbers, to read alongside the log."""
        lines = self.source.splitlines()
        width = len(str(len(lines)))
        return "\n".join(f"{i + 1:>{width}} | {line}" for i, line in enumerate(lines))


class CacheError(QMoEError):
    """The on-disk kernel cache (base class)."""


class CacheMissError(CacheError):
    """Strict cache mode: a kernel module was needed that is not already on disk."""


class CacheCorruptError(CacheError):
    """An on-disk cache entry failed its integrity check (treated as a miss by the cache)."""


class CacheLocationError(CacheError):
    """The cache directory cannot store entries (not a directory, not writable, not trusted, disk
    full). Raised where storing is the point (the warm tool); elsewhere the cache falls back to
    memory with one WARNING (docs/runtime-compilation.md, "Unusable cache locations")."""


class DeviceError(QMoEError, RuntimeError):
    """No usable GPU/driver, or an array lives on a device other than the one expected."""


class CaptureError(QMoEError, RuntimeError):
    """Something that is not allowed inside CUDA graph capture was attempted during capture."""


class WeightFormatError(QMoEAttributeError):
    """A weight format that does not exist (qmoe_rtc/formats): ``name`` is the argument or attribute that named
    it (``format``, ``quant_type``, ``--format`` ...), ``expected`` the names there are, ``actual`` the value
    given (a kind of bad attribute: ``except QMoEAttributeError`` catches it)."""


class KnobError(QMoEInputError):
    """An environment knob (``QMOE_RTC_*``) or a knob override (``knobs.scope``) has a value it does not
    accept (a kind of bad input: ``except QMoEInputError`` catches it): ``name`` is the variable,
    ``expected`` the values it accepts, ``actual`` the value given (qmoe_rtc/settings/knobs.py)."""

    kind = "knob"
