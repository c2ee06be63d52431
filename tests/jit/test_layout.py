"""Layout / ModuleSpec identity and validation, cache-key sensitivity, knobs (CPU only, no compile)."""

from __future__ import annotations

import dataclasses

import pytest

from qmoe_rtc.errors import KnobError, QMoEAttributeError
from qmoe_rtc.jit import unit_key
from qmoe_rtc.kernels import family_names, get_family, modules_for, spec_unit
from qmoe_rtc.kernels.dequant import dequant_spec
from qmoe_rtc.settings import knobs
from qmoe_rtc.specialize import Layout, ModelConfig, ModuleSpec


def cache_key(spec, arch):
    return unit_key(spec_unit(spec), arch)


def config(layout, hidden=256, inter=128):
    """A ModelConfig around ``layout`` (unaligned shapes when the layout says so)."""
    if not layout.aligned:
        hidden, inter = 80, 48
    return ModelConfig(hidden=hidden, inter=inter, experts=8, k=2, layout=layout)

BASE = Layout(dtype="float16", scale_dtype="float32", fc1_bits=4, fc2_bits=4, activation="swiglu", swiglu_fusion=1)

# one valid alternative value per Layout field (relative to BASE)
ALTERNATIVES = {
    "dtype": dict(dtype="bfloat16"),
    "scale_dtype": dict(scale_dtype="float16"),
    "fc1_bits": dict(fc1_bits=3),
    "fc2_bits": dict(fc2_bits=8),
    "fc3_bits": dict(fc3_bits=2, has_fc3=True, swiglu_fusion=0),
    "block_size": dict(block_size=64),
    "fc1_zp": dict(fc1_zp="packed"),
    "fc2_zp": dict(fc2_zp="offset"),
    "fc3_zp": dict(fc3_bits=4, fc3_zp="packed", has_fc3=True, swiglu_fusion=0),
    "fc1_format": dict(fc1_format="fp8_e4m3", fc1_bits=8),
    "fc2_format": dict(fc2_format="nvfp4", block_size=16),
    "fc3_format": dict(fc3_format="fp8_e4m3", fc3_bits=8, has_fc3=True, swiglu_fusion=0),
    "activation": dict(activation="geglu"),
    "swiglu_fusion": dict(swiglu_fusion=2),
    "has_fc3": dict(has_fc3=True, fc3_bits=8, swiglu_fusion=0),
    "aligned": dict(aligned=False),
    "tiled": dict(tiled=True),
}


def test_every_layout_field_has_an_alternative():
    assert set(ALTERNATIVES) == set(Layout.field_names())


@pytest.mark.parametrize("field", sorted(ALTERNATIVES))
def test_every_layout_field_changes_name_and_digest(field):
    other = dataclasses.replace(BASE, **ALTERNATIVES[field])
    assert other != BASE
    assert other.digest != BASE.digest
    assert other.name != BASE.name


def test_equal_layouts_equal_identity():
    a = Layout(dtype="float16", scale_dtype="float16")
    b = Layout(dtype="float16")
    assert a == b and hash(a) == hash(b) and a.digest == b.digest and a.name == b.name
    assert ModuleSpec.make("x", p=1, q="a") == ModuleSpec.make("x", q="a", p=1)


@pytest.mark.parametrize("bad", [
    dict(dtype="float64"), dict(scale_dtype="float16", dtype="bfloat16"), dict(fc1_bits=5), dict(fc2_bits=0),
    dict(block_size=8), dict(block_size=48), dict(fc1_zp="yes"), dict(fc1_zp="fp8"), dict(activation="tanh"),
    dict(fc1_format="fp8"), dict(fc1_format="fp8_e4m3"), dict(fc1_format="mxfp4", scale_dtype="float32"),
    dict(fc1_format="fp8_e4m3", fc1_bits=8, fc1_zp="packed"), dict(fc3_format="mxfp4"),
    dict(swiglu_fusion=3), dict(swiglu_fusion=1, activation="relu"), dict(fc3_bits=4),
    dict(has_fc3=True, fc3_bits=0), dict(activation="swiglu"), dict(has_fc3=1), dict(aligned=1), dict(tiled=1),
    dict(fc1_bits=True),
])
def test_layout_refuses_bad_values(bad):
    with pytest.raises(QMoEAttributeError):
        Layout(**bad)


def test_model_config_derives_alignment_from_shapes():
    lay = Layout(dtype="float16", activation="relu")
    assert ModelConfig(hidden=256, inter=128, experts=4, k=1, layout=lay).layout.aligned is True
    odd = ModelConfig(hidden=100, inter=36, experts=4, k=1, layout=lay)
    assert odd.layout.aligned is False and "unaligned" in odd.layout.name


SPEC = dequant_spec("float16", 4, 128, "packed", "float32")
SPEC_ALTERNATIVES = {
    "dtype": dict(dtype="bfloat16"),
    "scale_dtype": dict(scale_dtype="float16"),
    "bits": dict(bits=3),
    "block_size": dict(block_size=0),
    "zp": dict(zp="offset"),
    "threads": dict(threads=512),
}


def test_dequant_spec_alternatives_cover_all_params():
    assert set(SPEC_ALTERNATIVES) == set(SPEC.as_dict())


@pytest.mark.parametrize("param", sorted(SPEC_ALTERNATIVES))
def test_every_module_param_changes_the_cache_key(param):
    other = ModuleSpec.make("dequant", **{**SPEC.as_dict(), **SPEC_ALTERNATIVES[param]})
    assert cache_key(other, "sm_90") != cache_key(SPEC, "sm_90")
    assert other.name != SPEC.name and other.digest != SPEC.digest


def test_equal_specs_equal_keys_and_arch_and_lineinfo_change_it():
    again = dequant_spec("float16", 4, 128, "packed", "float32")
    assert cache_key(again, "sm_90") == cache_key(SPEC, "sm_90")
    from qmoe_rtc.jit import check_arch

    archs = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_90a")
    keys = {cache_key(SPEC, a) for a in archs}
    assert len(keys) == len({check_arch(a) for a in archs})  # an alias ('sm_90' -> sm_90a) keys as its target
    with knobs.scope(lineinfo=True):
        k_line = cache_key(SPEC, "sm_90")
    assert k_line != cache_key(SPEC, "sm_90")


def test_readable_module_name():
    assert SPEC.name == "dequant_b4_bs128_zp-packed_f16_s-f32_t256"


@pytest.mark.parametrize("family", family_names())
def test_family_depends_on_exactly_its_fields(family):
    """Changing a field outside depends_on never changes a family's modules; each field inside
    changes them for at least one alternative."""
    fam = get_family(family)
    base = set(fam.specs(config(BASE)))
    for field, change in ALTERNATIVES.items():
        other = set(fam.specs(config(dataclasses.replace(BASE, **change))))
        if field in fam.depends_on:
            assert other != base, f"{family}: changing {field} did not change the modules"
        elif not (set(change) & set(fam.depends_on)):
            assert other == base, f"{family}: {field} is not in depends_on but changed the modules"


def test_layers_differing_in_irrelevant_fields_share_dequant_modules():
    a = Layout(dtype="float16", fc1_bits=4, fc2_bits=4, activation="relu")
    b = Layout(dtype="float16", fc1_bits=4, fc2_bits=4, activation="swiglu", swiglu_fusion=2)
    dq = get_family("dequant")
    assert dq.specs(a) == dq.specs(b)
    # fc1 and fc2 with the same quantization share one module
    assert len(dq.specs(a)) == 1
    c = dataclasses.replace(a, fc2_bits=2, fc2_zp="packed")
    assert len(dq.specs(c)) == 2


def test_modules_for_refuses_unknown_variant():
    with pytest.raises(QMoEAttributeError):
        modules_for(config(BASE), variants=("training",))


def test_modules_for_follows_the_pipeline_choice():
    """Tensor-core layouts warm the tensor-core engines (the three prefill-path engines: which runs depends
    on the call and the device); the others the SIMT ones, never both."""
    fams = {s.family for s in modules_for(config(BASE))}
    assert fams == {"route", "mma_decode", "mma_batched", "mma_prefill", "wgmma_prefill"}
    simt = {s.family for s in modules_for(config(dataclasses.replace(BASE, dtype="float32")))}
    assert simt == {"route", "gemv", "gemm"}
    for zp in ("none", "packed"):  # 3-bit: tensor cores, zero points or not
        assert {s.family for s in modules_for(config(dataclasses.replace(BASE, fc1_bits=3, fc1_zp=zp)))} == fams
    assert {s.family for s in modules_for(config(BASE), variants=("decode",))} == {"route", "mma_decode"}


@pytest.mark.parametrize("family, knob, field", [
    ("mma_decode", "mma_stages", "stages"), ("mma_prefill", "prefill_stages", "stages"),
    ("mma_decode", "mma_min_blocks", "min_blocks"), ("mma_prefill", "prefill_min_blocks", "min_blocks"),
])
def test_stage_knobs_change_the_spec_and_the_unit_key(family, knob, field):
    """The code-changing tuning knobs are read into the module spec: a new value is a new name and a new
    key (a knob cannot leave a stale module loaded while the launch sizes shared memory or the K split
    from the new value)."""
    fam = get_family(family)
    default = fam.spec(config(BASE))
    with knobs.scope(**{knob: 4}):
        four = fam.spec(config(BASE))
    assert four != default and four.name != default.name and four[field] == 4
    unit = fam.unit(four)  # a define or the generated unit's host decisions
    assert (unit.defines, unit.source) != (fam.unit(default).defines, fam.unit(default).source)
    assert cache_key(four, "sm_90") != cache_key(default, "sm_90")


@pytest.mark.parametrize("knob, field, default_value", [("mma_expert_flow", "expert_flow", True)])
def test_decode_bool_knobs_change_the_spec_and_the_unit_key(knob, field, default_value):
    fam = get_family("mma_decode")
    default = fam.spec(config(BASE))
    with knobs.scope(**{knob: not default_value}):
        on = fam.spec(config(BASE))
    assert on[field] is (not default_value) and default[field] is default_value and on.name != default.name
    assert fam.unit(on).defines != fam.unit(default).defines
    assert cache_key(on, "sm_90") != cache_key(default, "sm_90")


def test_expert_flow_scratch_and_fc1_tiles():
    """The FC1 step declares two zeroed counters per expert (read only with the expert flow) and FC2 is
    told FC1's grid.x."""
    from qmoe_rtc.kernels import Problem

    fam = get_family("mma_decode")
    p = Problem(rows=1, E=8, H=256, I=128, k=2, dtype="float16")
    with knobs.scope(mma_expert_flow=True):
        on = fam.spec(config(BASE))
    sc = fam.scratch(on, "fc1", p)
    assert sc["fc1_done"].zero and sc["fc2_seen"].zero and sc["fc1_done"].nbytes == 4 * p.experts
    assert dict(fam.launch(on, "fc2", p).args)["FC1_TILES"] == fam.launch(on, "fc1", p).grid[0]


def test_knobs_typed_scoped_and_lazy(monkeypatch, tmp_path):
    monkeypatch.setenv("QMOE_RTC_STRICT", "yes")
    assert knobs.get("strict") is True and knobs.cache_mode() == "strict"
    with knobs.scope(strict=False, no_disk_cache=True):
        assert knobs.cache_mode() == "memory"
        with knobs.scope(cache_dir=tmp_path):
            assert knobs.cache_dir() == tmp_path
    assert knobs.cache_mode() == "strict"
    monkeypatch.setenv("QMOE_RTC_STRICT", "maybe")
    with pytest.raises(KnobError):
        knobs.get("strict")
    with pytest.raises(KnobError):
        with knobs.scope(strict=3):
            pass
    with pytest.raises(KnobError):
        knobs.get("no_such_knob")
    monkeypatch.setenv("QMOE_RTC_JOBS", "-2")  # int knobs count things: a negative value is refused
    with pytest.raises(KnobError, match="QMOE_RTC_JOBS.*>= 0"):
        knobs.get("jobs")
    with pytest.raises(KnobError, match=">= 0"):
        with knobs.scope(prefill_group=-1):
            pass
    monkeypatch.delenv("QMOE_RTC_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert knobs.cache_dir() == tmp_path / "xdg" / "qmoe_rtc"
    assert not (tmp_path / "xdg").exists()  # resolving a path creates nothing
