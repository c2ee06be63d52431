"""A checkpoint on disk: one ``.safetensors`` file, or a folder of them (with or without
``model.safetensors.index.json``) beside a Hugging Face ``config.json``. Tensors are read one at a time
through ``safetensors`` (NumPy arrays; bfloat16 through ml_dtypes, imported here before the first read:
safetensors' NumPy side knows bfloat16 only once ml_dtypes has registered it), so a layer's load holds
only that layer's tensors. A file safetensors cannot parse (truncated, corrupt, a header past the end of
the file) and a ``config.json`` that is not a JSON object are refused naming the file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import QMoEInputError, QMoEUnsupportedError

__all__ = ["Checkpoint"]


def _safetensors():
    try:
        from safetensors import safe_open
    except ImportError as exc:  # an optional dependency: pip install 'qmoe_rtc[checkpoints]'
        raise QMoEUnsupportedError("loading checkpoints needs the safetensors package "
                                   "(pip install safetensors, or qmoe_rtc[checkpoints])") from exc
    import ml_dtypes  # noqa: F401  registers bfloat16 (and the float8s) with NumPy for safetensors' reader

    return safe_open


def _unreadable(path: Path, exc: Exception) -> QMoEInputError:
    """The one-line refusal of a safetensors file its reader cannot parse."""
    why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return QMoEInputError("checkpoint", "a readable .safetensors file", f"{path}: {why}")


def _header(path: Path) -> dict:
    """The JSON header of safetensors file ``path`` (8-byte little-endian length, then the JSON), checked
    to lie inside the file with every tensor's data."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        raw = fh.read(8)
        n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if n < 2 or 8 + n > size:
            raise QMoEInputError("checkpoint", "a .safetensors file (an 8-byte header length, then the header)",
                                 f"{path}: a header of {n} bytes in a file of {size}")
        try:
            head = json.loads(fh.read(n))
        except ValueError as exc:
            raise _unreadable(path, exc) from None
    if not isinstance(head, dict):
        raise QMoEInputError("checkpoint", "a .safetensors header that is a JSON object", f"{path}")
    end = max((int(v["data_offsets"][1]) for k, v in head.items() if k != "__metadata__" and isinstance(v, dict)
               and "data_offsets" in v), default=0)
    if 8 + n + end > size:
        raise QMoEInputError("checkpoint", f"a .safetensors file of at least {8 + n + end} bytes (its header's "
                             "tensors)", f"{path}: {size} bytes (truncated)")
    return head


def _json_object(path: Path) -> dict:
    """The JSON object in ``path`` ({} when there is no such file)."""
    if not path.is_file():
        return {}
    try:
        v = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise QMoEInputError(path.name, "a JSON object", f"{path}: not JSON ({exc})") from None
    if not isinstance(v, dict):
        raise QMoEInputError(path.name, "a JSON object", f"{path}: a JSON {type(v).__name__}")
    return v


#: safetensors dtype names NumPy lacks, read through ml_dtypes by :func:`_float8`.
_FLOAT8 = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu"}


def _float8(path: Path, name: str, header: dict):
    """A float8 tensor's bytes as its ml_dtypes array: the file's own ``header`` (:func:`_header`: each
    tensor's dtype, shape and data offsets, the safetensors format) locates it, since safetensors' NumPy
    loader cannot name a float8 NumPy dtype."""
    import ml_dtypes

    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
    info = header[name]
    dtype = _FLOAT8.get(info["dtype"])
    if dtype is None:
        raise QMoEUnsupportedError(f"{name}: dtype {info['dtype']} (NumPy cannot hold it)")
    begin, end = info["data_offsets"]
    raw = np.fromfile(path, dtype=np.uint8, count=end - begin, offset=8 + n + begin)
    return raw.view(getattr(ml_dtypes, dtype)).reshape(info["shape"])


class Checkpoint:
    """The tensors (by name) and the ``config.json`` of a checkpoint at ``path`` (a file or a folder).
    Each file is opened once and kept open until :meth:`close` (or the end of a ``with`` block), so
    reading a model's thousands of expert tensors parses each file's header once."""

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.exists():
            raise QMoEInputError("checkpoint", "an existing .safetensors file or folder", str(self.path))
        folder = self.path if self.path.is_dir() else self.path.parent
        files = [self.path] if self.path.is_file() else sorted(self.path.glob("*.safetensors"))
        if not files:
            raise QMoEInputError("checkpoint", "a folder with .safetensors files", f"none in {self.path}")
        safe_open = _safetensors()
        self._where: dict[str, Path] = {}
        self._headers: dict[Path, dict] = {}  # file -> its parsed header (float8 tensors are read through it)
        for f in files:
            self._headers[f] = _header(f)  # truncated or corrupt: one line naming the file, before safetensors' error
            try:
                with safe_open(str(f), framework="np") as h:
                    for name in h.keys():
                        self._where[name] = f
            except Exception as exc:  # safetensors' SafetensorError (not importable as such in every version)
                raise _unreadable(f, exc) from None
        self._names = sorted(self._where)
        self._open: dict[Path, object] = {}  # file -> its open safe_open handle
        self.config: dict = _json_object(folder / "config.json")
        # ModelOpt's older exports: the quantization beside config.json
        self._hf_quant: dict = _json_object(folder / "hf_quant_config.json")

    @property
    def names(self) -> list[str]:
        """Every tensor name, sorted."""
        return self._names

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str):
        """The NumPy array of tensor ``name`` (a ``QMoEInputError`` naming it when it is not there)."""
        f = self._where.get(name)
        if f is None:
            raise QMoEInputError(name, "a tensor of the checkpoint", f"missing from {self.path}")
        h = self._open.get(f)
        if h is None:
            h = self._open[f] = _safetensors()(str(f), framework="np").__enter__()
        try:
            return h.get_tensor(name)
        except (AttributeError, TypeError):  # safetensors' NumPy side has no float8 dtype (NumPy lacks one)
            return _float8(f, name, self._headers[f])
        except Exception as exc:  # a tensor whose bytes cannot be read
            raise _unreadable(f, exc) from None

    def close(self) -> None:
        """Close the files opened so far (a later :meth:`get` opens them again)."""
        for h in self._open.values():
            h.__exit__(None, None, None)
        self._open.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def quantization(self) -> dict:
        """``config.json``'s ``quantization_config``; without one, the ``quantization`` object of an
        ``hf_quant_config.json`` beside it (NVIDIA ModelOpt's exports) with ``quant_method: modelopt``;
        empty when there is neither."""
        q = self.config.get("quantization_config")
        if not q and self._hf_quant:
            hq = self._hf_quant.get("quantization")
            if not isinstance(hq, dict):
                raise QMoEInputError("hf_quant_config.json quantization", "an object", type(hq).__name__)
            return {"quant_method": "modelopt", **hq}
        q = q or {}
        if not isinstance(q, dict):
            raise QMoEInputError("config.json quantization_config", "an object", type(q).__name__)
        return q
