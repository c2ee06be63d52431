"""Compile-only tests (NVRTC, no GPU): a representative set of layouts for sm_80 and sm_90,
compile errors, arch validation, argument packing."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from qmoe_rtc.errors import CompileError, QMoEAttributeError, QMoEInputError
from qmoe_rtc.jit import KernelDef, KernelFamily, Launch, Ptr, Scalar, disk_entry_dir, get_cubin, pack_args
from qmoe_rtc.kernels import get_family, register
from qmoe_rtc.kernels.dequant import dequant_spec


# every bit width, every zero-point mode, both block layouts, three dtypes, both scale dtypes:
# combined, not the cartesian product
REPRESENTATIVE = [
    ("float32", 1, 0, "none", "float32"),
    ("float16", 2, 16, "packed", "float16"),
    ("bfloat16", 3, 0, "packed", "float32"),
    ("float16", 3, 128, "offset", "float32"),
    ("bfloat16", 4, 32, "none", "bfloat16"),
    ("float32", 4, 0, "offset", "float32"),
    ("float16", 8, 64, "packed", "float32"),
    ("bfloat16", 8, 0, "none", "bfloat16"),
    ("float32", 2, 128, "offset", "float32"),
    ("float16", 1, 16, "packed", "float32"),
]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("dtype,bits,bs,zp,sdt", REPRESENTATIVE)
def test_compile_representative(cache, arch, dtype, bits, bs, zp, sdt):
    spec = dequant_spec(dtype, bits, bs, zp, sdt)
    mod = get_cubin(spec, arch)
    assert mod.origin == "compiled"
    assert mod.cubin[:4] == b"\x7fELF"  # SASS cubin, not PTX
    assert mod.lowered["dequant_expert"].startswith("_ZN4qmoe14dequant_expert")
    assert f"-arch={arch}" in mod.options and "-std=c++17" in mod.options
    assert not any(o.startswith("-arch=compute") for o in mod.options)


def test_sm_90a_compiles(cache):
    assert get_cubin(dequant_spec("float16", 4), "sm_90a").cubin[:4] == b"\x7fELF"


@pytest.mark.parametrize("arch", ["compute_90", "sm90", "90", "", "sm_90b"])
def test_arch_must_be_a_sass_target(arch):
    with pytest.raises(QMoEAttributeError):
        get_cubin(dequant_spec("float16", 4), arch)


class _BrokenFamily(KernelFamily):
    """A family whose template does not compile (test only)."""

    name = "test_broken"
    header = "types.cuh"

    def kernels(self, spec):
        return (KernelDef("k", "qmoe::no_such_kernel<int>", (Scalar("n", "int32"),)),)

    def source(self, spec):
        return '#include "types.cuh"\nnamespace qmoe { this is not C++; }\n'

    def launch(self, spec, kernel, **problem):
        return Launch((1, 1, 1), (32, 1, 1))


@pytest.fixture
def broken_family():
    from qmoe_rtc.kernels import unregister

    register(_BrokenFamily)
    yield
    unregister(_BrokenFamily.name)


def test_compile_error_is_typed_picklable_and_leaves_no_entry(cache, broken_family):
    from qmoe_rtc.specialize import ModuleSpec

    spec = ModuleSpec.make("test_broken", x=1)
    with pytest.raises(CompileError) as info:
        get_cubin(spec, "sm_90")
    err = info.value
    assert "error" in err.log and "-arch=sm_90" in err.options and "not C++" in err.source
    assert "2 | namespace qmoe" in err.numbered_source()
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, CompileError) and back.log == err.log and back.options == err.options
    d = disk_entry_dir("sm_90")
    assert not d.exists() or not any(d.iterdir())


def test_pack_args_converts_scalars_to_declared_c_types():
    kd = KernelDef("k", "k", (Scalar("n", "int32"), Scalar("m", "int64"), Scalar("f", "float32"), Ptr("p", "uint8", nullable=True)))
    n, m, f, p = pack_args(kd, (3, np.int64(2**40), 0.5, None))
    assert type(n) is np.int32 and type(m) is np.int64 and type(f) is np.float32 and type(p) is np.uint64 and p == 0
    with pytest.raises(QMoEInputError):
        pack_args(kd, (2**31, 1, 0.5, None))  # int32 overflow
    with pytest.raises(QMoEInputError):
        pack_args(kd, (1.5, 1, 0.5, None))  # float for an int
    with pytest.raises(QMoEInputError):
        pack_args(kd, (1, 1, 0.5))  # wrong count
    with pytest.raises(QMoEInputError):
        pack_args(kd, (1, 1, 0.5, np.zeros(3, np.uint8)))  # host array for a device pointer
    with pytest.raises(QMoEInputError):
        pack_args(KernelDef("k", "k", (Ptr("p", "uint8"),)), (None,))  # not nullable


def test_get_family_unknown():
    from qmoe_rtc.errors import QMoEUnsupportedError

    with pytest.raises(QMoEUnsupportedError):
        get_family("no_such_family")
