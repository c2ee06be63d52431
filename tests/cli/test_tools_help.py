"""Every entry point a user or maintainer runs answers ``--help`` without a GPU: the scripts under tools/
(``device_env.sh`` is sourced, not run) and every ``python -m qmoe_rtc bench`` subcommand; and the
bench dispatcher's own rules (no subcommand is ``run``, an unknown one is a usage error, ``peers``
needs its script)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from qmoe_rtc.bench import cli, peers

REPO = Path(__file__).resolve().parents[2]
TOOLS = sorted(p.name for p in (REPO / "tools").iterdir() if p.suffix in (".py", ".sh") and p.name != "device_env.sh")


def _run(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=120, cwd=REPO, env=env)


def test_tools_stay_few():
    assert 4 <= len(TOOLS) <= 8, TOOLS


@pytest.mark.parametrize("tool", TOOLS)
def test_every_tool_has_a_working_help(tool):
    cmd = [sys.executable] if tool.endswith(".py") else ["bash"]
    r = _run(*cmd, f"tools/{tool}", "--help")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() and ("usage" in r.stdout.lower() or tool.endswith(".sh")), r.stdout


@pytest.mark.parametrize("sub", ["", *cli.SUBCOMMANDS])
def test_every_bench_subcommand_has_a_working_help(sub):
    r = _run(sys.executable, "-m", "qmoe_rtc", "bench", *([sub] if sub else []), "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage:") and len(r.stdout.splitlines()) > 2, r.stdout + r.stderr
    if not sub:
        assert all(name in r.stdout for name in cli.SUBCOMMANDS)


def test_without_a_subcommand_the_arguments_go_to_run(monkeypatch):
    import qmoe_rtc.bench.run as run

    seen = []
    monkeypatch.setattr(run, "main", lambda argv: seen.append(argv) or 0)
    assert cli.main(["--preset", "all"]) == 0 and cli.main([]) == 0 and cli.main(["run", "--tokens", "1"]) == 0
    assert seen == [["--preset", "all"], [], ["--tokens", "1"]]


def test_an_unknown_subcommand_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["sweep"])
    assert e.value.code == 2 and "unknown subcommand 'sweep': expected one of run, peers" in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [([], "--script PATH is required"),
                                        (["--script", "no/such/bench_peers.py"], "no such file")])
def test_peers_without_its_script_says_what_it_expects(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        peers.main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_peers_runs_the_script_with_this_python_and_the_repository(tmp_path):
    script = tmp_path / "bench_peers.py"
    script.write_text("import sys\nprint(sys.executable)\nprint(sys.argv[1:])\nsys.exit(3)\n")
    r = _run(sys.executable, "-m", "qmoe_rtc", "bench", "peers", "--script", str(script), "--tokens", "1,8")
    assert r.returncode == 3, r.stderr
    exe, args = r.stdout.splitlines()
    assert exe == sys.executable and args == str(["--tokens", "1,8", "--qmoe-path", str(REPO)])
    assert peers.script_argv("s.py", ["--qmoe-path", "/x"])[2:] == ["--qmoe-path", "/x"]
    assert peers.script_argv("s.py", ["--qmoe-path=/x"])[2:] == ["--qmoe-path=/x"]
