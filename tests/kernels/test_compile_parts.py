"""Compile-only (NVRTC, no GPU): modules built as several NVRTC programs (CompileUnit.parts), compiled side
by side and cached piece by piece -- what keeps a tensor-core module's cold compile near its largest
kernel's (docs/runtime-compilation.md). The GPU side (the pieces loaded as one module) runs in every GPU
suite: each tensor-core module the executor loads has parts."""

from __future__ import annotations

import pytest

from qmoe_rtc.errors import CacheMissError, CompileError
from qmoe_rtc.jit import CompileUnit, KernelDef, Ptr, check_stored, compiler, disk_entry_dir, get_cubin, get_cubins, store_cubins
from qmoe_rtc.jit.unit import unit_key
from qmoe_rtc.kernels import get_family, spec_unit
from qmoe_rtc.settings import knobs
from qmoe_rtc.specialize import Layout, ModelConfig

from support.cubin_sections import text_sections

SMALL = ModelConfig(hidden=256, inter=128, experts=8, k=2,
                    layout=Layout(dtype="bfloat16", fc1_bits=4, fc2_bits=4, block_size=128, activation="swiglu",
                                  swiglu_fusion=2, tiled=True))

SOURCE = """
template <int N> __global__ void fill(float* out) { out[threadIdx.x] = N; }
"""


def _toy(parts=()):
    kernels = tuple(KernelDef(f"k{n}", f"fill<{n}>", (Ptr("out", "float32"),)) for n in (1, 2, 3))
    return CompileUnit(name="toy", source=SOURCE, kernels=kernels, parts=parts)


def test_parts_must_name_every_kernel_once():
    for bad in ((("k1",), ("k2",)), (("k1", "k2"), ("k2", "k3")), (("k1", "k2", "k3"), ()), (("k1", "k2", "k3", "k4"),)):
        with pytest.raises(CompileError, match="exactly once"):
            _toy(bad)


def test_pieces_names_kernels_and_keys():
    whole, parted = _toy(), _toy((("k2",), ("k1", "k3")))
    assert whole.pieces() == (whole,) and _toy((("k1", "k2", "k3"),)).pieces() == (_toy((("k1", "k2", "k3"),)),)
    a, b = parted.pieces()
    assert (a.name, b.name) == ("toy.p0", "toy.p1")
    assert [k.key for k in a.kernels] == ["k2"] and [k.key for k in b.kernels] == ["k1", "k3"]
    assert a.source == b.source == whole.source and a.parts == b.parts == ()
    assert dict(a.meta)["part"] == "1/2" and dict(b.meta)["part"] == "2/2"
    keys = {unit_key(u, "sm_90") for u in (whole, parted, a, b, _toy((("k1",), ("k2", "k3"))))}
    assert len(keys) == 5  # the parts are in the key


def test_one_piece_calls_refuse_a_unit_with_parts(cache):
    from qmoe_rtc.jit import store_cubin

    parted = _toy((("k2",), ("k1", "k3")))
    for call, instead in ((get_cubin, "get_cubins"), (store_cubin, "store_cubins")):
        with pytest.raises(CompileError, match=instead):
            call(parted, "sm_90")
    assert not any(cache.rglob("*.cubin"))  # refused before any compile


def test_pieces_are_cached_one_by_one_and_checked_together(cache):
    parted = _toy((("k2",), ("k1", "k3")))
    mods = store_cubins(parted, "sm_90")
    assert [m.origin for m in mods] == ["compiled", "compiled"]
    assert [sorted(m.lowered) for m in mods] == [["k2"], ["k1", "k3"]]
    check_stored(parted, "sm_90")
    assert [m.origin for m in get_cubins(parted, "sm_90")] == ["memory", "memory"]
    # one piece's entry gone: the module is not stored
    (json,) = disk_entry_dir("sm_90").glob("toy.p1-*.json")
    json.unlink()
    with pytest.raises(CacheMissError, match="toy.p1"):
        check_stored(parted, "sm_90")


def test_a_unit_with_parts_loads_as_one_module(cache, monkeypatch):
    """load_module: one cubin per piece, every kernel found in its own piece's module (CPU: the driver is faked)."""
    from qmoe_rtc.jit import cache as jit_cache
    from qmoe_rtc.jit import load_module

    loaded = []
    monkeypatch.setattr(compiler, "default_arch", lambda device=None: "sm_90a")
    monkeypatch.setattr(jit_cache.driver, "load_cubin", lambda cubin, dev: loaded.append(cubin) or len(loaded))
    monkeypatch.setattr(jit_cache.driver, "get_function", lambda module, name: (module, name))
    lm = load_module(_toy((("k2",), ("k1", "k3"))), 0)
    assert len(lm.parts) == len(lm.modules) == len(loaded) == 2 and lm.name == "toy"
    assert {key: kern.function[0] for key, kern in lm.kernels.items()} == {"k2": 1, "k1": 2, "k3": 2}
    assert lm["k3"].function[1] == lm.parts[1].lowered["k3"]
    assert load_module(_toy((("k2",), ("k1", "k3"))), 0) is lm and len(loaded) == 2


def test_load_modules_compiles_every_units_pieces_side_by_side(cache, monkeypatch):
    """load_modules: the pieces of every unit not loaded yet go through NVRTC together (threads), then each
    unit loads as load_module would (CPU: the driver is faked, the compiles counted by thread)."""
    import threading

    from qmoe_rtc.jit import cache as jit_cache
    from qmoe_rtc.jit import load_module, load_modules

    threads, real = [], compiler.compile_unit

    def counting(*args, **kwargs):
        threads.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(compiler, "compile_unit", counting)
    monkeypatch.setattr(compiler, "default_arch", lambda device=None: "sm_90a")
    monkeypatch.setattr(jit_cache.driver, "load_cubin", lambda cubin, dev: object())
    monkeypatch.setattr(jit_cache.driver, "get_function", lambda module, name: (module, name))
    one = CompileUnit(name="one", source=SOURCE, kernels=(KernelDef("k5", "fill<5>", (Ptr("out", "float32"),)),))
    parted = _toy((("k2",), ("k1", "k3")))
    mods = load_modules([parted, one], 0)
    assert [m.name for m in mods] == ["toy", "one"] and len(threads) == 3  # three programs
    assert threading.main_thread() not in threads  # in the pool's threads, side by side
    assert mods[0] is load_module(parted, 0) and set(mods[0].kernels) == {"k1", "k2", "k3"}
    threads.clear()
    keyed, real_key = [], jit_cache.unit_key
    monkeypatch.setattr(jit_cache, "unit_key", lambda unit, arch: keyed.append(unit.name) or real_key(unit, arch))
    assert load_modules([one, parted], 0) == (mods[1], mods[0]) and not threads  # loaded: nothing compiled
    assert keyed == ["one", "toy"]  # a loaded unit costs its key once (a plan for every size: QMoE.reserve)


def test_load_modules_loads_only_the_pieces_holding_the_named_kernels(cache, monkeypatch):
    """kernels=: a plan loads the pieces its steps launch (one route tile's GEMMs); a later call adds the
    rest to the same module; a kernel of a piece not loaded, or of no piece, is refused by name (CPU: the
    driver is faked, the compiles counted by piece name)."""
    from qmoe_rtc.jit import cache as jit_cache
    from qmoe_rtc.jit import load_module, load_modules

    built, real = [], compiler.compile_unit
    monkeypatch.setattr(compiler, "compile_unit", lambda name, *a, **kw: built.append(name) or real(name, *a, **kw))
    monkeypatch.setattr(compiler, "default_arch", lambda device=None: "sm_90a")
    monkeypatch.setattr(jit_cache.driver, "load_cubin", lambda cubin, dev: object())
    monkeypatch.setattr(jit_cache.driver, "get_function", lambda module, name: (module, name))
    parted = _toy((("k2",), ("k1",), ("k3",)))
    (lm,) = load_modules([parted], 0, [{"k3"}])
    assert built == ["toy.p2"] and set(lm.kernels) == {"k3"} and len(lm.parts) == len(lm.modules) == 1
    with pytest.raises(KeyError, match="'k1' is in a piece not loaded yet"):
        lm["k1"]
    with pytest.raises(KeyError, match=r"no kernel \['k9'\]"):
        load_modules([parted], 0, [{"k9"}])
    assert load_modules([parted], 0, [{"k3", "k2"}]) == (lm,) and built == ["toy.p2", "toy.p0"]
    assert load_module(parted, 0) is lm and built == ["toy.p2", "toy.p0", "toy.p1"]  # the rest, same module
    assert set(lm.kernels) == {"k1", "k2", "k3"} and [p.name for p in lm.parts] == ["toy.p0", "toy.p1", "toy.p2"]
    with pytest.raises(ValueError, match="1 entries for 2 units"):
        load_modules([parted, parted], 0, [None])


@pytest.mark.parametrize("family", ["mma_decode", "mma_batched", "mma_prefill", "wgmma_prefill"])
def test_tensor_core_families_compile_each_gemm_alone(family):
    fam = get_family(family)
    spec = fam.spec(SMALL)
    keys = [k.key for k in fam.kernels(spec)]
    parts = spec_unit(spec).parts
    gemms = [k for k in keys if k.startswith(("fc1_", "fc2_"))]
    assert len(gemms) >= 2 and [p for p in parts if p[0] in gemms] == [(k,) for k in gemms]
    assert sorted(k for p in parts for k in p) == sorted(keys)


def test_the_knob_builds_every_module_as_one_program():
    fam = get_family("wgmma_prefill")
    parted = spec_unit(fam.spec(SMALL))
    with knobs.scope(compile_parts=False):
        whole = spec_unit(fam.spec(SMALL))
    assert parted.parts and whole.parts == () and whole.name == parted.name
    assert unit_key(whole, "sm_90") != unit_key(parted, "sm_90")


def test_the_stamped_wgmma_build_is_one_program():
    with knobs.scope(prefill_wg_stamps=True):
        spec = get_family("wgmma_prefill").spec(SMALL)
    assert spec_unit(spec).parts == () and len(spec_unit(spec).pieces()) == 1


def test_the_stamped_decode_build_is_one_program_with_its_table(cache):
    """tools/stamps.py decode: knob decode_stamps builds the decode engine with -DQMOE_DECODE_STAMPS=1 as one program
    (FC1 and FC2 write one table, which the cubin defines), under a key of its own; off, the spec, hence every key,
    is the one without the knob."""
    fam = get_family("mma_decode")
    plain = fam.spec(SMALL)
    with knobs.scope(decode_stamps=True):
        spec = fam.spec(SMALL)
    unit = spec_unit(spec)
    assert plain.get("stamps") is None and spec["stamps"] is True
    assert unit.parts == () and "-DQMOE_DECODE_STAMPS=1" in unit.defines
    assert "-DQMOE_DECODE_STAMPS=1" not in spec_unit(plain).defines and spec_unit(plain).parts
    assert unit_key(unit, "sm_90") != unit_key(spec_unit(plain), "sm_90")
    (mod,) = get_cubins(unit, "sm_90")
    assert b"qmoe_decode_stamps" in mod.cubin and len(text_sections(mod.cubin)) == len(unit.kernels)


def test_each_kernel_has_the_machine_code_of_the_whole_module(cache):
    """The wgmma module (the largest) as its pieces and as one program: the same kernels, each with the same
    machine code without NVVM's split (NVRTC instantiates only the kernels a program names; ptxas compiles
    each kernel alone). Under the default split ('all'), NVVM's partitions of a whole module change FC2's
    code; a GEMM alone in its program gets the code of the unsplit compile again, but for FC1 of interleaved
    gate / linear tile rows at 32 routes (SMALL's swiglu_fusion=2 codes are tiled so) and FC1's pair form at 128
    routes, whose code NVVM's split changes even alone: another schedule (docs/runtime-compilation.md,
    tuning knob compile_parts)."""
    unit = spec_unit(get_family("wgmma_prefill").spec(SMALL))
    assert len(unit.pieces()) >= 3
    solo = [p[0] for p in unit.parts if len(p) == 1]

    def compiled(mode, pieces):
        with knobs.scope(split_compile=mode):
            opts = compiler.base_options("sm_90", unit.defines)
        out = {}
        for piece in pieces:
            cubin = compiler.compile_unit(piece.name, piece.source, piece.name_exprs(), "sm_90", opts)[0]
            sections = text_sections(cubin)
            assert len(sections) == len(piece.kernels)  # only its part's kernels
            out.update(sections)
        return out

    whole = compiled("off", (unit,))
    assert compiled("off", unit.pieces()) == whole and len(whole) == len(unit.kernels)
    lowered, default = {}, {}
    for mod in get_cubins(unit, "sm_90"):  # the default knobs, as the executor loads them
        assert mod.cubin[:4] == b"\x7fELF"
        lowered.update(mod.lowered)
        default.update(text_sections(mod.cubin))
    assert set(default) == set(whole)
    changed = {"fc1_br32", "fc1_br128_pair"}  # another schedule (session 32: fc1_br32 25472 bytes vs 25600)
    for key in solo:
        ours, theirs = default[f".text.{lowered[key]}"], whole[f".text.{lowered[key]}"]
        assert (ours == theirs) == (key not in changed), key


def test_compile_times_tool_compiles_what_a_first_call_loads(capsys):
    """tools/compile_times.py --rows: a first call at 512 tokens of gpt-oss-120b (16 routes per expert: the wgmma
    engine's 32-route tile) compiles routing, the 32-route GEMMs and the grouping piece, not the others."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "compile_times.py"
    spec = importlib.util.spec_from_file_location("compile_times", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(["--preset", "gpt-oss-120b", "--rows", "512", "--nvrtc-cache"]) == 0
    out = capsys.readouterr().out
    assert "prefill-wgmma: 4 programs side by side" in out and "(fc1_br32)" in out and "(fc2_br32)" in out, out
    assert "br64" not in out and "br128" not in out and "route_" in out, out


def test_a_plan_built_from_the_kernels_launched_names():
    """CPU: runtime.plan.launched names exactly the kernels Plan.build takes from the modules (one route
    tile's GEMMs at gpt-oss 512 on sm_90a), so a plan never asks a module for a piece it did not load."""
    import dataclasses

    from qmoe_rtc.kernels import Problem, choose
    from qmoe_rtc.runtime.plan import Plan, launched
    from qmoe_rtc.specialize.presets import PRESETS

    cfg = PRESETS["gpt-oss-120b"].config(dtype="bfloat16")
    cfg = dataclasses.replace(cfg, layout=dataclasses.replace(cfg.layout, tiled=True))
    problem = Problem(rows=512, E=cfg.experts, H=cfg.hidden, I=cfg.inter, k=cfg.k, dtype="bfloat16", arch="sm_90a",
                      sms=132)
    choice = choose(cfg, problem, "prefill")
    specs = {f: get_family(f).spec(cfg) for f in choice.pipeline.families}
    want = launched(choice.pipeline, specs, cfg, problem)
    assert want[specs["wgmma_prefill"]] == {"group", "permute", "fc1_br32", "fc2_br32", "combine"}
    modules = {spec: {key: f"{spec.family}:{key}" for key in keys} for spec, keys in want.items()}  # only those
    plan = Plan.build(cfg, problem, choice.pipeline, specs, modules)
    assert plan.engine == "prefill-wgmma" and len(plan.steps) == len(choice.pipeline.steps_for(cfg))
    assert [s.kernel for s in plan.steps if s.role in ("fc1", "fc2")] == ["wgmma_prefill:fc1_br32",
                                                                           "wgmma_prefill:fc2_br32"]
