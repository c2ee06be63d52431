"""Code health, checked in CI from the source: the layers point down only (a function-local import
counts), no import circles, source files stay near 400 lines, the linter passes, every knob is documented, the device
headers' namespace-scope constants are ``inline constexpr`` (reproducible cubins)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "qmoe_rtc"

#: the layer objects a caller builds, and qmoe_rtc.torch (the custom op and module around them)
_ENTRIES = ("qmoe_rtc.executor", "qmoe_rtc.oneshot", "qmoe_rtc.distributed", "qmoe_rtc.torch")
_COMMANDS = ("qmoe_rtc.cli", "qmoe_rtc.bench")  # what the command line runs: on top, nothing below imports them
#: transformers models: checkpoints into their blocks through qmoe_rtc.torch; above the entries and the checkpoints
_MODELS = ("qmoe_rtc.hf",)
_ABOVE_CODE = ("qmoe_rtc.jit", "qmoe_rtc.kernels", "qmoe_rtc.runtime", "qmoe_rtc.tiled", "qmoe_rtc.checkpoints",
               *_ENTRIES, *_MODELS, *_COMMANDS)
#: layer (a folder of the package, or one module: ``tiled/transform.py``) -> modules it must never import, directly
#: or through others. Bottom up: settings know only errors; values (formats, specialize, contract) know no code and
#: no knob; the tiled transform knows only errors (the kernels read its shapes); machinery (jit) knows no kernel,
#: layout or value; the kernel families no runtime; the runtime no entry; tiled/given (a layer's codes tiled
#: ahead) sits on the runtime; checkpoints build no layer; qmoe_rtc.torch (the custom op) sits on the entries and
#: takes any layer object; qmoe_rtc.hf (transformers models) sits on it and the checkpoints; the commands sit on top.
FORBIDDEN = {
    "settings": ("qmoe_rtc._arrays", "qmoe_rtc.formats", "qmoe_rtc.specialize", "qmoe_rtc.contract", *_ABOVE_CODE),
    "formats": ("qmoe_rtc.settings", "qmoe_rtc.specialize", "qmoe_rtc.contract", *_ABOVE_CODE),
    "specialize": ("qmoe_rtc.settings", "qmoe_rtc.contract", *_ABOVE_CODE),
    "contract": ("qmoe_rtc.settings", *_ABOVE_CODE),
    "tiled/transform.py": ("qmoe_rtc._arrays", "qmoe_rtc.settings", "qmoe_rtc.formats", "qmoe_rtc.specialize",
                           "qmoe_rtc.contract", "qmoe_rtc.tiled.given", *_ABOVE_CODE),
    "jit": ("qmoe_rtc.formats", "qmoe_rtc.specialize", "qmoe_rtc.contract", "qmoe_rtc.kernels", "qmoe_rtc.runtime",
            "qmoe_rtc.tiled", "qmoe_rtc.checkpoints", *_ENTRIES, *_MODELS, *_COMMANDS),
    "kernels": ("qmoe_rtc.contract", "qmoe_rtc.runtime", "qmoe_rtc.tiled.given", "qmoe_rtc.checkpoints", *_ENTRIES,
                *_MODELS, *_COMMANDS),
    "runtime": ("qmoe_rtc.tiled.given", "qmoe_rtc.checkpoints", *_ENTRIES, *_MODELS, *_COMMANDS),
    "tiled": ("qmoe_rtc.checkpoints", *_ENTRIES, *_MODELS, *_COMMANDS),
    "executor.py": ("qmoe_rtc.oneshot", "qmoe_rtc.distributed", "qmoe_rtc.torch", "qmoe_rtc.tiled.given",
                    "qmoe_rtc.checkpoints", *_MODELS, *_COMMANDS),
    "distributed.py": ("qmoe_rtc.torch", *_MODELS, *_COMMANDS),
    "torch": ("qmoe_rtc.oneshot", "qmoe_rtc.checkpoints", *_MODELS, *_COMMANDS),
    "checkpoints": (*_ENTRIES, *_MODELS, "qmoe_rtc.bench", "qmoe_rtc.cli.warm", "qmoe_rtc.cli.stress",
                    "qmoe_rtc.cli.stress_gpu"),
    "hf": ("qmoe_rtc.oneshot", *_COMMANDS),
}


def _layer_name(layer: str) -> str:
    """``tiled/transform.py`` -> ``qmoe_rtc.tiled.transform``; ``jit`` -> ``qmoe_rtc.jit``."""
    return "qmoe_rtc." + layer.removesuffix(".py").replace("/", ".")


def _in(module: str, names) -> bool:
    return any(module == n or module.startswith(n + ".") for n in names)


def imported_modules(source: str, module: str) -> set[str]:
    """Every module an import statement anywhere in ``source`` names, relative ones resolved against
    ``module`` (``a.b.c``); ``from X import y`` also yields ``X.y`` (y may be a submodule)."""
    package = module.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            out.add(name)
            out.update(f"{name}.{a.name}" for a in node.names)
    return out


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = [*parts[:-1], "__init__"]
    return ".".join(parts)


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layers_point_down_only(layer):
    paths = [PKG / layer] if layer.endswith(".py") else sorted((PKG / layer).rglob("*.py"))
    assert paths and all(p.exists() for p in paths), f"no layer {layer}"
    bad = []
    for path in paths:
        for name in imported_modules(path.read_text(), _module_name(path)):
            if _in(name, FORBIDDEN[layer]):
                bad.append(f"{path.relative_to(REPO)} imports {name}")
    assert not bad, "\n".join(bad)


def test_the_import_check_sees_function_local_and_relative_imports():
    src = "def f():\n    from ..kernels import get_family\n    import qmoe_rtc.runtime.plan\n"
    names = imported_modules(src, "qmoe_rtc.jit.cache")
    assert "qmoe_rtc.kernels" in names and "qmoe_rtc.kernels.get_family" in names and "qmoe_rtc.runtime.plan" in names
    assert "qmoe_rtc.settings.knobs" in imported_modules("from ..settings import knobs\n", "qmoe_rtc.jit.cache")


def test_source_files_stay_near_400_lines():
    long = [f"{p.relative_to(REPO)}: {n}" for p in sorted(PKG.rglob("*")) if p.suffix in (".py", ".cuh")
            for n in [len(p.read_text().splitlines())] if n > 410]
    assert not long, long


def test_ruff_passes():
    try:
        import ruff  # noqa: F401
    except ImportError:
        pytest.fail("ruff is part of the test dependencies: pip install -e '.[test]'")
    res = subprocess.run([sys.executable, "-m", "ruff", "check", "qmoe_rtc", "tools", "tests"], cwd=REPO,
                         capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


def test_every_knob_is_documented():
    """Each knob appears in the knob tables of docs/runtime-compilation.md: an operational one by its variable, a
    tuning one by its name (a row of the QMOE_RTC_TUNE table)."""
    from qmoe_rtc.settings.knobs import KNOBS

    doc = (REPO / "docs" / "runtime-compilation.md").read_text()
    tune = doc[doc.index("| `QMOE_RTC_TUNE` name |"):].split("\n\n")[0]
    missing = [k.env for k in KNOBS.values() if (f"`{k.name}`" not in tune if k.tuning else f"`{k.var}`" not in doc)]
    assert not missing, missing


def test_device_constants_are_inline():
    """A namespace-scope ``constexpr`` (internal linkage) gets a per-compile symbol id from NVRTC, so the
    same unit compiled twice gave different cubins: the headers declare ``inline constexpr``
    (cuda_src/core/types.cuh; test_compile_executor.py compiles modules twice and compares the bytes)."""
    import re

    bad = [f"{p.relative_to(REPO)}:{i}: {line.strip()}" for p in sorted((PKG / "cuda_src").rglob("*.cuh"))
           for i, line in enumerate(p.read_text().splitlines(), 1) if re.match(r"(static\s+)?constexpr\s", line)]
    assert not bad, "\n".join(bad)


def test_no_engine_includes_another():
    """An engine (a header under cuda_src/engines with kernels) includes shared pieces (headers without
    kernels: the decode ring, the tile engines' rows, the SIMT dot products), never another engine."""
    import re

    engines = PKG / "cuda_src" / "engines"
    has_kernels = {p.name for p in engines.glob("*.cuh") if "__global__" in p.read_text()}
    bad = [f"{p.name} includes {m}" for p in sorted(engines.glob("*.cuh")) if p.name in has_kernels
           for m in re.findall(r'#include "engines/([\w.]+)"', p.read_text()) if m in has_kernels]
    assert len(has_kernels) >= 6 and not bad, (sorted(has_kernels), bad)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (anywhere: function-local imports count); a package's
    ``__init__`` (a re-export hub that imports its submodules lazily) is neither a source nor a target."""
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    modules = {n for n in files if not n.endswith(".__init__")}
    graph = {}
    for name in modules:
        seen = imported_modules(files[name].read_text(), name)
        graph[name] = {m for m in seen if m in modules and m != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    """No two modules of the package import each other, directly or through others, not even by a
    function-local import (which only hides a circle)."""
    assert not _cycles(_import_graph()), _cycles(_import_graph())


def test_the_circle_check_can_fail():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layers_point_down_through_other_modules_too(layer):
    """What a layer imports does not import a forbidden module either, however many modules lie between
    (``jit`` → ``_arrays`` → ``specialize`` was such a leak): each path found is printed."""
    graph = _import_graph()
    bad = []
    for start in sorted(m for m in graph if _in(m, [_layer_name(layer)])):
        parent, todo = {start: None}, [start]
        while todo:
            v = todo.pop()
            for w in sorted(graph[v]):
                if w not in parent:
                    parent[w] = v
                    todo.append(w)
        for w in parent:
            if _in(w, FORBIDDEN[layer]) and not _in(w, [_layer_name(layer)]):
                path = [w]
                while parent[path[-1]] is not None:
                    path.append(parent[path[-1]])
                bad.append(" -> ".join(reversed(path)))
    assert not bad, "\n".join(sorted(bad))


CITATION = r"\b[Ss]essions? \d+|\b[Ii]ssues? \d+"


def _citations(text: str) -> list[str]:
    import re

    return re.findall(CITATION, text)


def test_package_code_cites_measurements_not_sessions_or_issues():
    """A comment or docstring says what was measured and where its numbers are (docs/performance-log.md), not which
    work session or issue it came from: those numbers mean nothing to a reader of the code."""
    found = [f"{p.relative_to(REPO)}: {c}" for p in sorted(PKG.rglob("*")) if p.suffix in (".py", ".cuh")
             for c in _citations(p.read_text())]
    assert not found, found


def test_the_citation_check_can_fail():
    assert _citations("measured on the H200 (session 29)") == ["session 29"]
    assert _citations("issue 23's layer; sessions 11 and 12") == ["issue 23", "sessions 11"]
    assert _citations("2026-12-06-s35-call2 (a file name), 4 sessions") == []
