"""tools/stamps.py chain on the CPU: its arguments, and that a part of a plan's launches launches exactly that slice,
its first launch never overlapped, and leaves the bound launches as they were (the GPU timing itself needs a GPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "stamps.py"


def _tool():
    spec = importlib.util.spec_from_file_location("stamps_chain_tool", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Bound:
    def __init__(self):
        self.items, self.overlapped, self.seen = ("r", "g", "p", "f1", "f2", "c"), (None, "o", "o", "o", "o", "o"), []

    def launch(self, stream, ptrs):
        self.seen.append((self.items, self.overlapped, stream, ptrs))


def test_a_part_launches_its_slice_first_launch_plain_and_restores_the_bound_launches():
    tool, b = _tool(), _Bound()
    tool.Part(b, 3, 6).launch(7, (1, 2, 0, 4))
    tool.Part(b, 0, 2).launch(7, (1, 2, 0, 4))
    assert b.seen[0][:2] == (("f1", "f2", "c"), (None, "o", "o")) and b.seen[0][2:] == (7, (1, 2, 0, 4))
    assert b.seen[1][:2] == (("r", "g"), (None, "o"))
    assert b.items == ("r", "g", "p", "f1", "f2", "c") and b.overlapped == (None, "o", "o", "o", "o", "o")


def test_chain_is_a_mode_of_the_stamps_tool(monkeypatch):
    tool, seen = _tool(), []
    monkeypatch.setattr(tool, "chain", lambda args: seen.append(args) or 0)
    assert tool.main(["chain", "--preset", "gpt-oss-120b", "--tokens", "8,64", "--knob", "route_in_group=off"]) == 0
    a = seen[0]
    assert (a.engine, a.preset, a.tokens, a.iters, a.knob) == ("chain", "gpt-oss-120b", "8,64", 20, ["route_in_group=off"])
