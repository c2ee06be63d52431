"""The kernel-argument structs (cuda_src/core/args.cuh) against the Python argument specs that mirror them.

A launch packs each struct parameter from its ``Struct`` spec (jit/args.py: member order, C layout), so a
spec whose members are out of step with the C++ declaration would shift every value after the slip. The
compile tests check the top-level parameters through the mangled names (tests/kernel_signatures.py);
mangling does not show a struct's members, so this test reads them from the header itself: member count,
order, names (a spec's leaf name is the member name, or ends with ``_`` + it: ``fc1_scales`` for
``scales`` of member ``fc1``) and types, for every struct parameter of every expert family's kernels.
CPU only: nothing is compiled.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from qmoe_rtc.jit import Ptr, Scalar, Struct
from qmoe_rtc.kernels import get_family
from qmoe_rtc.specialize import Layout, ModelConfig

ARGS_CUH = Path(__file__).resolve().parents[1] / "qmoe_rtc" / "cuda_src" / "core" / "args.cuh"

#: C++ scalar and pointee spellings of the dtype names the specs use (T and S resolve per module).
C_NAMES = {"u8": "uint8", "i32": "int32", "u32": "uint32", "float": "float32", "i64": "int64"}

FAMILIES = ("gemv", "gemm", "mma_decode", "mma_batched", "mma_prefill", "wgmma_prefill")


def declared_structs(text: str) -> dict[str, list[tuple[str, str]]]:
    """``{struct name: [(member type, member name), ...]}`` of every struct in ``text``, comments dropped."""
    text = re.sub(r"//[^\n]*", "", text)
    out = {}
    for m in re.finditer(r"(?:template\s*<[^>]*>\s*)?struct\s+(\w+)\s*\{(.*?)\};", text, re.S):
        members = []
        for decl in m.group(2).split(";"):
            decl = " ".join(decl.split())
            if not decl:
                continue
            head, name = re.match(r"(.*?)\s*\b(\w+)$", decl).groups()
            members.append((head.strip(), name))
        out[m.group(1)] = members
    return out


def member_mismatches(spec: Struct, structs: dict, template: dict[str, str]) -> list[str]:
    """Where ``spec`` and the declaration of ``struct spec.ctype`` disagree (recursing into members)."""
    if spec.ctype not in structs:
        return [f"{spec.name}: no struct {spec.ctype} in core/args.cuh"]
    decl = structs[spec.ctype]
    out = []
    if len(decl) != len(spec.fields):
        out.append(f"{spec.ctype}: {len(decl)} members {[n for _, n in decl]}, spec has {len(spec.fields)} "
                   f"{[f.name for f in spec.fields]}")
    for (ctype, cname), field in zip(decl, spec.fields):
        where = f"{spec.ctype}.{cname}"
        if field.name != cname and not field.name.endswith("_" + cname):
            out.append(f"{where}: spec member named {field.name!r}")
        if isinstance(field, Struct):
            if ctype.split("<")[0] != field.ctype:
                out.append(f"{where}: declared {ctype}, spec Struct({field.ctype})")
            out += member_mismatches(field, structs, template)
        elif isinstance(field, Ptr):
            pointee = ctype.removeprefix("const ").removesuffix("*").strip()
            if not ctype.endswith("*") or template.get(pointee, C_NAMES.get(pointee)) != field.dtype:
                out.append(f"{where}: declared {ctype}, spec Ptr({field.dtype})")
        elif isinstance(field, Scalar):
            if C_NAMES.get(ctype) != field.ctype:
                out.append(f"{where}: declared {ctype}, spec Scalar({field.ctype})")
    return out


def struct_params(args):
    for a in args:
        if isinstance(a, Struct):
            yield a


LAYOUTS = {
    "bf16-int4-swiglu": Layout(dtype="bfloat16", block_size=128, activation="swiglu", swiglu_fusion=1),
    "f16-int4-zp-silu-fc3": Layout(dtype="float16", block_size=32, fc1_zp="packed", fc2_zp="packed", fc3_zp="packed",
                                   activation="silu", has_fc3=True, fc3_bits=4),
    "f32-int8-fp32scales-relu": Layout(dtype="float32", scale_dtype="float32", fc1_bits=8, fc2_bits=8,
                                       block_size=0, activation="relu"),
}


def test_the_header_declares_the_structs_the_specs_name():
    structs = declared_structs(ARGS_CUH.read_text())
    assert {"Proj", "Fc1Weights", "Fc2Weights", "RouteGroups", "ActParams"} <= set(structs)
    assert [n for _, n in structs["Proj"]] == ["w", "scales", "zp", "bias"]
    assert structs["ActParams"][-1] == ("i32", "limit_after")


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_struct_specs_match_their_declarations(name):
    structs = declared_structs(ARGS_CUH.read_text())
    cfg = ModelConfig(hidden=256, inter=128, experts=8, k=2, layout=LAYOUTS[name])
    checked = set()
    for fam_name in FAMILIES:
        fam = get_family(fam_name)
        if fam.supports(cfg) is not None:
            continue
        for spec in fam.specs(cfg):
            template = {"T": spec["dtype"], "S": spec["scale_dtype"]}
            for kd in fam.kernels(spec):
                for st in struct_params(kd.args):
                    assert not member_mismatches(st, structs, template), (kd.key, member_mismatches(st, structs, template))
                    checked.add(st.ctype)
    assert checked >= {"Fc1Weights", "Fc2Weights", "ActParams"}, checked


def test_a_slip_is_caught():
    """The check can fail: swapped members, a wrong type, a missing member."""
    structs = declared_structs(ARGS_CUH.read_text())
    tmpl = {"T": "float16", "S": "float16"}
    good = Struct("ap", "ActParams", (Scalar("alpha", "float32"), Scalar("beta", "float32"),
                                      Scalar("limit", "float32"), Scalar("limit_after", "int32")))
    assert member_mismatches(good, structs, tmpl) == []
    swapped = Struct("ap", "ActParams", (good.fields[1], good.fields[0], *good.fields[2:]))
    assert len(member_mismatches(swapped, structs, tmpl)) == 2
    wrong = Struct("p", "Proj", (Ptr("fc1_w", "uint8"), Ptr("fc1_scales", "float32"), Ptr("fc1_zp", "uint8"),
                                 Ptr("fc1_bias", "float32")))
    assert member_mismatches(wrong, structs, tmpl) == ["Proj.scales: declared const S*, spec Ptr(float32)"]
    assert "4 members" in member_mismatches(Struct("p", "Proj", wrong.fields[:3]), structs, tmpl)[0]
