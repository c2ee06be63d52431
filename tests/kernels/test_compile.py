"""Compile-only tests (NVRTC, no GPU): a representative set of layouts for sm_80 and sm_90,
compile errors, arch validation, argument packing."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from qmoe_rtc.errors import CompileError, QMoEAttributeError, QMoEInputError
from qmoe_rtc.jit import KernelDef, Launch, ParamBlock, Ptr, Scalar, Struct, check_arch, disk_entry_dir, get_cubin
from qmoe_rtc.jit.args import param_layout
from qmoe_rtc.kernels import KernelFamily, get_family, register, spec_unit
from qmoe_rtc.kernels.dequant import dequant_spec

from support.cubin_sections import text_sections


def compile_spec(spec, arch):
    return get_cubin(spec_unit(spec), arch)


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
    mod = compile_spec(spec, arch)
    assert mod.origin == "compiled"
    assert mod.cubin[:4] == b"\x7fELF"  # SASS cubin, not PTX
    assert mod.lowered["dequant_expert"].startswith("_ZN4qmoe14dequant_expert")
    assert f"-arch={check_arch(arch)}" in mod.options and "-std=c++17" in mod.options  # sm_90 is built as sm_90a
    assert not any(o.startswith("-arch=compute") for o in mod.options)


def test_sm_90a_compiles(cache):
    assert compile_spec(dequant_spec("float16", 4), "sm_90a").cubin[:4] == b"\x7fELF"


@pytest.mark.parametrize("arch", ["compute_90", "sm90", "90", "", "sm_90b"])
def test_arch_must_be_a_sass_target(arch):
    with pytest.raises(QMoEAttributeError):
        compile_spec(dequant_spec("float16", 4), arch)


class _BrokenFamily(KernelFamily):
    """A family whose template does not compile (test only)."""

    name = "test_broken"
    header = "types.cuh"

    def kernels(self, spec):
        return (KernelDef("k", "qmoe::no_such_kernel<int>", (Scalar("n", "int32"),)),)

    def source(self, spec):
        return '#include "types.cuh"\nnamespace qmoe { this is not C++; }\n'

    def launch(self, spec, role, problem):
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
        compile_spec(spec, "sm_90")
    err = info.value
    assert "error" in err.log and f"-arch={check_arch('sm_90')}" in err.options and "not C++" in err.source
    assert "2 | namespace qmoe" in err.numbered_source()
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, CompileError) and back.log == err.log and back.options == err.options
    d = disk_entry_dir("sm_90")
    assert not d.exists() or not any(d.iterdir())


def test_param_block_packs_each_argument_as_its_declared_c_type():
    kd = KernelDef("k", "k", (Scalar("n", "int32"), Scalar("m", "int64"), Scalar("f", "float32"),
                              Ptr("p", "uint8", nullable=True), Ptr("q", None)))
    pb = ParamBlock(kd, dict(n=-3, m=np.int64(2**40), f=0.5, p=None, q=0xDEAD0))
    raw = pb.values
    assert raw[0:1].view(np.int32)[0] == -3 and raw[1] == 2**40
    assert raw[2:3].view(np.float32)[0] == np.float32(0.5) and pb.value("p") == 0 and pb.value("q") == 0xDEAD0
    addrs = np.frombuffer(np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint64 * 5).from_address(pb.address)),
                          dtype=np.uint64)
    assert list(addrs) == [raw.ctypes.data + 8 * i for i in range(5)]  # void** points at each slot
    pb.set_pointer("q", 0xBEEF0)
    assert pb.value("q") == 0xBEEF0 and pb.word("q") == 4
    for bad in (dict(n=2**31), dict(n=1.5), dict(n=True), dict(f="x"), dict(q=None)):
        with pytest.raises(QMoEInputError):
            ParamBlock(kd, {**dict(n=1, m=1, f=0.5, p=None, q=16), **bad})
    with pytest.raises(QMoEInputError, match="no binding"):
        ParamBlock(kd, dict(n=1, m=1, f=0.5, p=None))  # q missing
    with pytest.raises(QMoEInputError):
        ParamBlock(kd, dict(n=1, m=1, f=0.5, p=None, q=np.zeros(3, np.uint8)))  # host array for a device pointer


def test_param_block_lays_struct_parameters_out_as_c_does():
    # struct A { int a; double-aligned void* p; float f; }  -> a@0 p@8 f@16, size 24 (padded to 8)
    # kernel(int n, A s, float g, struct B { float x; int y; } t) -> n@0 s@8 g@32 t@36 (48 bytes with the tail)
    a = Struct("s", "A", (Scalar("a", "int32"), Ptr("p", "uint8"), Scalar("f", "float32")))
    b = Struct("t", "B", (Scalar("x", "float32"), Scalar("y", "int32")))
    kd = KernelDef("k", "k", (Scalar("n", "int32"), a, Scalar("g", "float32"), b))
    assert kd.arg_names() == ("n", "a", "p", "f", "g", "x", "y")
    tops, flat, size = param_layout(kd.args)
    assert tops == [0, 8, 32, 36] and [o for _, o in flat] == [0, 8, 16, 24, 32, 36, 40] and size == 48
    pb = ParamBlock(kd, dict(n=7, a=-1, p=0xABC0, f=2.0, g=3.0, x=4.0, y=9))
    raw = pb.values.view(np.uint8)
    assert raw[:4].view(np.int32)[0] == 7 and raw[8:12].view(np.int32)[0] == -1
    assert pb.value("p") == 0xABC0 and pb.word("p") == 2 and raw[24:28].view(np.float32)[0] == 2.0
    assert raw[32:36].view(np.float32)[0] == 3.0 and raw[36:40].view(np.float32)[0] == 4.0
    assert raw[40:44].view(np.int32)[0] == 9
    addrs = np.frombuffer(np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint64 * 4).from_address(pb.address)),
                          dtype=np.uint64)
    assert list(addrs) == [pb.values.ctypes.data + o for o in (0, 8, 32, 36)]  # one void* per parameter
    with pytest.raises(QMoEInputError, match="k.y"):
        ParamBlock(kd, dict(n=7, a=-1, p=0xABC0, f=2.0, g=3.0, x=4.0))
    twice = KernelDef("k", "k", (a, Struct("t", "B", (Scalar("x", "float32"), Scalar("p", "int32")))))
    with pytest.raises(QMoEAttributeError, match="distinct leaf names"):
        ParamBlock(twice, dict(a=1, p=0xABC0, f=1.0, x=1.0))


def test_get_family_unknown():
    from qmoe_rtc.errors import QMoEUnsupportedError

    with pytest.raises(QMoEUnsupportedError):
        get_family("no_such_family")


def test_wgmma_probe_compiles_its_heaviest_variant():
    """tools/wgmma_probe.py builds its kernel from the engines' own headers (core/wgmma.cuh, core/mma_pair.cuh):
    a header change that breaks the probe fails here, on the CPU, not on a lent GPU."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "wgmma_probe.py"
    spec = importlib.util.spec_from_file_location("wgmma_probe", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    assert (2, 256, 1, 1, 1) in probe.VARIANTS and all(v[1] == 128 for v in probe.VARIANTS if v[0] >= 3)
    fp8 = max((v for v in probe.FP8_VARIANTS if v[9]), key=lambda v: (v[5], v[3]))  # the e4m3 ring with promotion
    assert probe.name_of(fp8).endswith("_fp8_prom") and len({probe.name_of(v) for v in probe.all_variants()}) == len(
        probe.all_variants())
    for v in ((2, 256, 1, 1, 1), max(probe.LOAD_VARIANTS, key=lambda v: v[5]), fp8):
        cubin = probe.compile_variant(v)
        assert cubin[:4] == b"\x7fELF" and b"wgmma_rate" in cubin, probe.name_of(v)


def test_split_compile_knob_options_key_and_machine_code(cache):
    """Tuning knob split_compile: its options reach the key; 'all' is the default; 'ptxas' leaves every
    kernel's machine code as 'off' has it (ptxas only compiles the kernels side by side); a value it cannot
    take is refused by name."""
    from qmoe_rtc.errors import KnobError
    from qmoe_rtc.jit import compiler
    from qmoe_rtc.jit.unit import unit_key
    from qmoe_rtc.settings import knobs

    unit = spec_unit(dequant_spec("bfloat16", 4, 128, "packed", "bfloat16"))
    assert knobs.get("split_compile") == "all"
    with knobs.scope(split_compile="off"):
        assert not {"-Xptxas", "--split-compile=0"} & set(compiler.base_options("sm_90"))
        plain = get_cubin(unit, "sm_90")
    with knobs.scope(split_compile="ptxas"):
        assert compiler.base_options("sm_90")[4:6] == ("-Xptxas", "--split-compile=0")
        assert unit_key(unit, "sm_90") != plain.key
        split = get_cubin(unit, "sm_90")
    assert split.key != plain.key
    assert text_sections(split.cubin) == text_sections(plain.cubin) != {}
    assert compiler.base_options("sm_90")[4:7] == ("-Xptxas", "--split-compile=0", "--split-compile=0")
    assert get_cubin(unit, "sm_90").key not in (plain.key, split.key)
    with pytest.raises(KnobError, match=r"QMOE_RTC_TUNE\[split_compile\]"), knobs.scope(split_compile="yes"):
        compiler.base_options("sm_90")


def test_key_follows_an_edited_template_and_each_kernel_spec(tmp_path, monkeypatch):
    """The key's template digest re-reads each file's size and mtime on every key (the listing is read once
    a process), and its kernels field (memoised per kernels tuple) still tells two argument specs apart."""
    import os

    from qmoe_rtc.jit import CompileUnit, compiler
    from qmoe_rtc.jit.unit import unit_key

    (tmp_path / "core").mkdir()
    tpl = tmp_path / "core" / "a.cuh"
    tpl.write_text("// one\n")
    monkeypatch.setattr(compiler, "cuda_src_dir", lambda: tmp_path)
    first = compiler.cuda_src_digest()
    assert compiler.cuda_src_digest() == first
    tpl.write_text("// two, longer\n")
    os.utime(tpl, ns=(1, 1))  # mtime back too: the size alone tells
    assert compiler.cuda_src_digest() != first
    src = "__global__ void f(float* out, int n) {}"
    a = CompileUnit("u", src, (KernelDef("f", "f", (Ptr("out", "float32"), Scalar("n", "int32"))),))
    b = CompileUnit("u", src, (KernelDef("f", "f", (Ptr("out", "float32"), Scalar("n", "int64"))),))
    assert unit_key(a, "sm_90") != unit_key(b, "sm_90") and unit_key(a, "sm_90") == unit_key(a, "sm_90")
