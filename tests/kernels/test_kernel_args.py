"""The kernels' C++ parameters (every ``__global__`` under cuda_src, and the argument structs of
cuda_src/core/args.cuh) against the Python argument specs that mirror them.

A launch packs each struct parameter from its ``Struct`` spec (jit/args.py: member order, C layout), so a
spec whose members are out of step with the C++ declaration would shift every value after the slip. The
compile tests check the top-level parameters through the mangled names (tests/support/kernel_signatures.py);
mangling does not show a struct's members, so this test reads them from the header itself: member count,
order, names (a spec's leaf name is the member name, or ends with ``_`` + it: ``fc1_scales`` for
``scales`` of member ``fc1``) and types, for every struct parameter of every expert family's kernels.
The top-level parameters of every kernel of every family are read from their ``__global__``
declarations the same way, by name and kind, so two same-typed scalars (``H`` and ``I``) swapped in a
spec fail here although the mangled types agree. CPU only: nothing is compiled.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from qmoe_rtc.jit import KernelDef, Ptr, Scalar, Struct
from qmoe_rtc.kernels import get_family
from qmoe_rtc.kernels.base import family_names
from qmoe_rtc.specialize import Layout, ModelConfig

CUDA_SRC = Path(__file__).resolve().parents[2] / "qmoe_rtc" / "cuda_src"
ARGS_CUH = CUDA_SRC / "core" / "args.cuh"

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


def _closing(text: str, i: int) -> int:
    """Index just past the parenthesis that closes the one opened before ``text[i]``."""
    depth = 1
    while depth:
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
    return i


def declared_kernels(root: Path = CUDA_SRC) -> dict[str, list[tuple[str, str]]]:
    """``{kernel name: [(parameter type, parameter name), ...]}`` of every ``__global__`` function."""
    out = {}
    for path in sorted(root.rglob("*.cuh")):
        text = re.sub(r"//[^\n]*", "", path.read_text())
        for m in re.finditer(r"__global__\s+void\b", text):
            j = m.end()
            if cl := re.match(r"\s*__cluster_dims__\s*\(", text[j:]):
                j = _closing(text, j + cl.end())
            if lb := re.match(r"\s*__launch_bounds__\s*\(", text[j:]):
                j = _closing(text, j + lb.end())
            head = re.match(r"\s*(\w+)\s*\(", text[j:])
            start = j + head.end()
            params, depth, cur = [], 0, ""
            for ch in text[start:_closing(text, start) - 1]:
                depth += {"<": 1, ">": -1}.get(ch, 0)
                if ch == "," and depth == 0:
                    params.append(cur)
                    cur = ""
                else:
                    cur += ch
            decl = []
            for p in params + [cur]:
                p = " ".join(p.replace("__restrict__", "").split())
                if p:
                    decl.append(re.match(r"(.*?)\s*\b(\w+)$", p).groups())
            if head.group(1) in out:
                raise AssertionError(f"two __global__ {head.group(1)} (overloads would need their own check)")
            out[head.group(1)] = decl
    return out


def param_mismatches(kd, decl: list[tuple[str, str]]) -> list[str]:
    """Where a KernelDef's top-level specs and the declared parameters disagree (count, name, kind)."""
    out = [] if len(decl) == len(kd.args) else [f"{kd.key}: {len(decl)} parameters, {len(kd.args)} specs"]
    for (ctype, cname), spec in zip(decl, kd.args):
        if spec.name != cname and not spec.name.endswith("_" + cname):
            out.append(f"{kd.key}: parameter {cname!r} has spec {spec.name!r}")
        kind = "ptr" if ctype.endswith("*") else ("scalar" if ctype.removeprefix("const ") in C_NAMES else "struct")
        want = {Ptr: "ptr", Scalar: "scalar", Struct: "struct"}[type(spec)]
        if kind != want:
            out.append(f"{kd.key}: parameter {cname!r} is {ctype}, spec is a {type(spec).__name__}")
        elif kind == "struct" and ctype.removeprefix("const ").split("<")[0] != spec.ctype:
            out.append(f"{kd.key}: parameter {cname!r} is {ctype}, spec Struct({spec.ctype})")
    return out


def all_kernel_defs():
    """Every family's kernels over layouts that reach each engine and variant (router GEMM, shared experts, tiled
    codes)."""
    cfgs = [ModelConfig(hidden=256, inter=128, experts=8, k=2, layout=lay, shared=1) for lay in LAYOUTS.values()]
    cfgs.append(ModelConfig(hidden=256, inter=128, experts=8, k=2, layout=LAYOUTS["bf16-int4-swiglu"],
                            router_gemm="bfloat16"))
    cfgs.append(ModelConfig(hidden=256, inter=128, experts=512, k=8, layout=LAYOUTS["bf16-int4-swiglu"]))  # block routing
    tiled = ModelConfig(hidden=256, inter=128, experts=8, k=2,
                        layout=Layout(dtype="bfloat16", block_size=128, activation="swiglu", swiglu_fusion=1, tiled=True))
    out = []
    for cfg in cfgs + [tiled]:
        for name in family_names():
            fam = get_family(name)
            if fam.supports(cfg) is None:
                out += [kd for spec in fam.specs(cfg) for kd in fam.kernels(spec)]
    return out


def test_every_kernels_parameters_match_its_specs_by_name():
    decls = declared_kernels()
    kds = all_kernel_defs()
    names = {kd.name_expr.split("<")[0].split("::")[-1] for kd in kds}
    assert {"route_topk", "route_topk_warp", "fc1_prefill", "fc2_wgmma", "wg_prepare_image", "dequant_expert",
            "combine_routes"} <= names
    assert any(n.startswith("router_") or "logits" in n for n in names), sorted(names)  # the router GEMM
    bad = []
    for kd in kds:
        fn = kd.name_expr.split("<")[0].split("::")[-1]
        if fn not in decls:
            bad.append(f"{kd.key}: no __global__ {fn} under cuda_src")
            continue
        bad += param_mismatches(kd, decls[fn])
    assert not bad, sorted(set(bad))


def test_a_swapped_scalar_is_caught():
    decl = [("const T*", "x"), ("i32", "H"), ("i32", "I")]
    good = KernelDef("k", "k", (Ptr("x", "float16"), Scalar("H", "int32"), Scalar("I", "int32")))
    assert param_mismatches(good, decl) == []
    swapped = KernelDef("k", "k", (Ptr("x", "float16"), Scalar("I", "int32"), Scalar("H", "int32")))
    assert len(param_mismatches(swapped, decl)) == 2
    assert "is a Scalar" not in " ".join(param_mismatches(good, decl))
    as_ptr = KernelDef("k", "k", (Ptr("x", "float16"), Ptr("H", "int32"), Scalar("I", "int32")))
    assert param_mismatches(as_ptr, decl) == ["k: parameter 'H' is i32, spec is a Ptr"]
