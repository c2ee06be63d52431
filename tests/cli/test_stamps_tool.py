"""tools/stamps.py decode's timeline, on a stamps table written here (what core/stamps.cuh DecodeStamps stores per
block: five %globaltimer readings, then routes served | SM id << 32; rows of blocks that did not run are zero); and its
chain mode's parts of a plan's launches (the GPU timing itself needs a GPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

TOOL = Path(__file__).resolve().parents[2] / "tools" / "stamps.py"


def _tool():
    spec = importlib.util.spec_from_file_location("stamps_tool", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(t0, steps, routes, sm):
    return [t0, *(t0 + d for d in steps), routes | (sm << 32)]


def test_the_timeline_reads_each_step_from_the_first_fc1_entry():
    tab = np.zeros((2, 8, 6), np.int64)
    base = 10_000_000
    tab[0, 0] = _row(base, (1000, 1500, 6000, 6500), 1, 3)         # served one route
    tab[0, 1] = _row(base + 200, (1100, 1700, 8200, 8700), 2, 4)   # served two
    tab[0, 2] = _row(base + 400, (1000, 1200, 1200, 1200), 0, 3)   # a duplicate: left at its scan
    tab[1, 0] = _row(base + 3000, (4000, 7000, 12000, 13000), 1, 5)
    tab[1, 5] = _row(base + 3500, (4200, 9000, 15000, 16000), 2, 6)
    lines = _tool().timeline(tab)
    assert lines[0].startswith("FC1: 3 blocks on 2 SMs, 2 served routes")
    steps = {ln.split()[0]: [float(v) for v in ln.split()[-3:]] for ln in lines[1:6]}
    assert steps["entry"] == [0.0, 0.2, 0.4]       # every block that ran
    assert steps["routed"] == [1.0, 1.3, 1.4]      # every block: its wait for the routing
    assert steps["routes"] == [1.5, 1.7, 1.9]      # the blocks that served routes
    assert steps["loop"] == [6.0, 7.2, 8.4]
    assert lines[6].split()[1] == "5.50"           # loop time a block: 4.5 and 6.5 µs
    fc2 = lines.index(next(ln for ln in lines if ln.startswith("FC2")))
    assert lines[fc2].startswith("FC2: 2 blocks on 2 SMs, 2 served routes")
    assert [float(v) for v in lines[fc2 + 5].split()[-3:]] == [16.0, 17.75, 19.5]  # exits, from FC1's first entry


def test_no_fc1_stamp_says_so():
    assert "no FC1 block" in _tool().timeline(np.zeros((2, 4, 6), np.int64))[0]


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
