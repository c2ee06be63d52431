"""The command line as a new user meets it: one-line errors (bad knobs, no GPU), complete ``--help``,
``demo`` progress, the slower-path WARNING, and no reference pointing outside the repository."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from qmoe_rtc.cli import warm
from qmoe_rtc.errors import DeviceError

REPO = Path(__file__).resolve().parents[2]


def _run(*args, env=None, timeout=120):
    e = {k: v for k, v in os.environ.items() if not k.startswith("QMOE_RTC_")}
    e.update(PYTHONPATH=str(REPO), **(env or {}))
    return subprocess.run([sys.executable, "-m", "qmoe_rtc", *args], capture_output=True, text=True, env=e,
                          timeout=timeout, cwd=REPO)


@pytest.mark.parametrize("var, value, allowed", [("QMOE_RTC_STRICT", "maybe", "1/0/true/false"),
                                                 ("QMOE_RTC_JOBS", "two", "an integer"),
                                                 ("QMOE_RTC_NO_DISK_CACHE", "sometimes", "1/0/true/false")])
def test_bad_knob_value_is_one_line_naming_variable_value_and_allowed(tmp_path, var, value, allowed):
    r = _run("warm", "--preset", "qwen3-30b-a3b", "--arch", "sm_80", "--cache-dir", str(tmp_path / "c"),
             env={var: value})
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert var in lines[0] and repr(value) in lines[0] and allowed in lines[0] and "Traceback" not in r.stderr
    assert r.stdout == ""  # refused before any work


def test_warm_help_is_complete_and_plain():
    parser = warm.build_parser()
    for action in parser._actions:
        assert action.help and action.help.strip(), f"{action.option_strings} has no help"
    text = parser.format_help()
    for markup in ("``", ":func:", ":class:", ":mod:"):
        assert markup not in text, markup
    assert "examples:" in text and "exit status" in text
    r = _run("warm", "--help")
    assert r.returncode == 0 and r.stdout == text.replace("usage: python -m qmoe_rtc warm", "usage: python -m qmoe_rtc warm")


def test_missing_arch_hint_speaks_cli(monkeypatch, capsys):
    from qmoe_rtc.jit import compiler, driver

    def no_gpu(device=None):
        raise DeviceError("cannot take the GPU architecture from this machine: simulated; " + compiler.ARCH_HINT)

    monkeypatch.setattr(compiler, "default_arch", no_gpu)
    monkeypatch.setattr("qmoe_rtc.jit.default_arch", no_gpu)
    monkeypatch.setattr(driver, "probe", lambda device_id=None: (13000, 0))
    assert warm.main(["--preset", "qwen3-30b-a3b", "--list"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--arch sm_XX" in err[0] and "arch='" not in err[0], err


def test_demo_shows_quantization_progress(monkeypatch, capsys):
    """The demo's layer takes seconds to quantize: it says how far it is, on stderr (a small layer here)."""
    from qmoe_rtc import __main__ as cli
    from qmoe_rtc.contract import random_layer as rl

    seen = []
    real = rl.random_layer

    def small(rng, **kw):
        seen.append(kw.get("progress"))
        return real(rng, **{**kw, "E": 8, "H": 128, "I": 128})

    monkeypatch.setattr(rl, "random_layer", small)
    monkeypatch.setattr(cli, "_gpu_present", lambda: False)
    monkeypatch.setattr("qmoe_rtc.contract.reference.qmoe", lambda x, logits, **kw: np.zeros_like(x))
    assert cli.main(["demo", "--tokens", "1"]) == 0
    err = capsys.readouterr().err
    assert seen and seen[0] is not None and "quantizing fc1" in err and "quantizing fc2" in err and "100 %" in err


def test_progress_does_not_change_the_layer(rng):
    from qmoe_rtc.contract.random_layer import random_layer

    seed = int(rng.integers(1 << 30))
    a, _ = random_layer(np.random.default_rng(seed), E=9, H=64, I=32, bits=4, block_size=32)
    calls = []
    b, _ = random_layer(np.random.default_rng(seed), E=9, H=64, I=32, bits=4, block_size=32,
                        progress=lambda *c: calls.append(c))
    assert calls and calls[-1] == ("fc2", 9, 9)
    for n in a:
        np.testing.assert_array_equal(a[n], b[n])


def test_slower_path_reason_is_one_warning(caplog):
    """A faster engine that cannot run is said once as a WARNING (visible with no logging set up)."""
    from qmoe_rtc.executor import QMoE

    msg = "qmoe_rtc: decode path runs decode-gemv instead of the faster decode-mma: simulated reason"
    with caplog.at_level(logging.WARNING, logger="qmoe_rtc"):
        QMoE._say(msg)
        QMoE._say(msg)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.WARNING, msg)]


_OUTSIDE = re.compile(r"\.\./shared|\bCONTRACT\b|DESIGN-NOTES|METHOD\.md")


def test_no_reference_points_outside_the_repository():
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "qmoe_rtc").rglob("*.py")),
             *sorted((REPO / "qmoe_rtc").rglob("*.cuh")), *sorted((REPO / "tools").glob("*")),
             *sorted((REPO / "tests").glob("*.py"))]
    bad = [f"{p.relative_to(REPO)}:{i + 1}" for p in files if p.is_file() and p.name != "test_cli.py"
           for i, line in enumerate(p.read_text(errors="replace").splitlines()) if _OUTSIDE.search(line)]
    assert not bad, bad
    for doc in re.findall(r"`(docs/[\w./-]+\.md)`", (REPO / "README.md").read_text()):
        assert (REPO / doc).is_file(), doc


def readme_python() -> list[str]:
    """The README's Python examples, in order (later ones may use what earlier ones made)."""
    return re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)


def test_readme_examples_define_every_name_they_use():
    """Copied into a session in order, the README's examples run as written: every name they read is
    imported, assigned or a builtin (their GPU run is tools/device_check.sh's 'readme' section)."""
    import ast
    import builtins

    blocks = readme_python()
    assert len(blocks) >= 3
    defined = set(dir(builtins))
    for i, block in enumerate(blocks):
        tree = ast.parse(block)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                defined |= {(a.asname or a.name).split(".")[0] for a in node.names}
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):  # a class or function an example defines
                defined.add(node.name)
            elif isinstance(node, ast.arg):  # its parameters (``self``, ``x``)
                defined.add(node.arg)
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        assert used <= defined, f"README example {i + 1} uses undefined {sorted(used - defined)}"


@pytest.mark.parametrize("argv, says", [(["demo", "--tokens", "-1"], "--tokens: expected a positive integer"),
                                        (["demo", "--tokens", "two"], "--tokens: expected a positive integer"),
                                        (["stress", "--engines", "decode-fast"], "unknown engine decode-fast")])
def test_bad_cli_numbers_and_names_are_usage_errors(argv, says):
    r = _run(*argv)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_info_and_gpu_test_skips_say_what_the_layer_would_say(monkeypatch):
    """Without a driver, `info` and the GPU tests' skip reason give the driver probe's words (the ones
    QMoE() raises), not CuPy's 'driver version is insufficient'."""
    from conftest import gpu_available

    from qmoe_rtc import __main__ as cli
    from qmoe_rtc.jit import driver

    def no_driver(device_id=None):
        raise DeviceError("no NVIDIA driver found (test)")

    monkeypatch.setattr(driver, "probe", no_driver)
    assert cli._gpu_lines() == ["GPU                 none usable: no NVIDIA driver found (test)"]
    gpu_available.cache_clear()
    try:
        assert gpu_available() == (False, "no usable GPU: no NVIDIA driver found (test)")
    finally:
        gpu_available.cache_clear()


def test_warm_for_a_gpu_too_old_is_one_refusal(tmp_path):
    """sm_75 is refused before any compile, in one line (not a ptxas error per kernel)."""
    r = _run("warm", "--preset", "qwen3-30b-a3b", "--arch", "sm_75", "--cache-dir", str(tmp_path / "c"))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "sm_80 or newer" in lines[0] and "'sm_75'" in lines[0], r.stderr
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").rglob("*.cubin"))


def test_a_tree_named_on_pythonpath_but_shadowed_is_said(tmp_path):
    """``PYTHONPATH=oldtree python -m qmoe_rtc ...`` from a directory holding another qmoe_rtc runs that one
    (python -m puts the working directory first): the CLI says so on stderr, naming both; the tree it runs,
    or a PYTHONPATH without another tree, draws no warning."""
    from qmoe_rtc.__main__ import shadowed_trees

    root = REPO
    old = tmp_path / "old" / "qmoe_rtc"
    old.mkdir(parents=True)
    (old / "__init__.py").write_text("")
    here = str(root / "qmoe_rtc")
    assert shadowed_trees(os.pathsep.join([str(tmp_path / "old"), str(tmp_path)]), here) == [str(old)]
    assert shadowed_trees(str(root), here) == [] and shadowed_trees("", here) == []
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "old"))
    run = subprocess.run([sys.executable, "-m", "qmoe_rtc", "warm", "--help"], cwd=root, env=env, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0 and f"not {old} that PYTHONPATH names" in run.stderr, run.stderr
