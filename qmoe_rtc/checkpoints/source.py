"""A checkpoint on disk: one ``.safetensors`` file, or a folder of them (with or without
``model.safetensors.index.json``) beside a Hugging Face ``config.json``. Tensors are read one at a time
through ``safetensors`` (NumPy arrays; bfloat16 through ml_dtypes), so a layer's load holds only that
layer's tensors."""

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
    return safe_open


#: safetensors dtype names NumPy lacks, read through ml_dtypes by :func:`_float8`.
_FLOAT8 = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu"}


def _float8(path: Path, name: str):
    """A float8 tensor's bytes as its ml_dtypes array: the file's own header (8-byte little-endian length,
    then JSON with each tensor's dtype, shape and data offsets, the safetensors format) locates it, since
    safetensors' NumPy loader cannot name a float8 NumPy dtype."""
    import ml_dtypes

    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        info = json.loads(fh.read(n))[name]
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
        for f in files:
            with safe_open(str(f), framework="np") as h:
                for name in h.keys():
                    self._where[name] = f
        self._names = sorted(self._where)
        self._open: dict[Path, object] = {}  # file -> its open safe_open handle
        cfg = folder / "config.json"
        self.config: dict = json.loads(cfg.read_text()) if cfg.is_file() else {}
        hf = folder / "hf_quant_config.json"  # ModelOpt's older exports: the quantization beside config.json
        self._hf_quant: dict = json.loads(hf.read_text()) if hf.is_file() else {}

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
            return _float8(f, name)

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
