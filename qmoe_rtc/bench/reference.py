"""The performance reference's tables, generated from what the peers benchmark wrote
(``python -m qmoe_rtc bench peers ... --out F``: ``meta``, ``rows``, ``errors``); GPU-free.

    python -m qmoe_rtc bench reference docs/reference/decode-peers.json docs/reference/prefill-peers.json \\
        --write docs/performance.md

Each JSON becomes one Markdown table: per shape and token count the bytes and FLOP floors, each peer's µs,
qmoe_rtc's µs, qmoe_rtc / the best peer (bold where qmoe_rtc is ahead of every peer) and the share of the floor
qmoe_rtc reaches; above it a line naming the device, the date, the command and the source file, below it the
errors the run recorded. A point or a peer the JSON lacks prints as a dash. Without ``--write`` the tables are
printed; with it each replaces the text between its markers in the document, which must hold them:

    <!-- NAME table: python -m qmoe_rtc bench reference ... -->
    ...
    <!-- end of NAME table -->

NAME is the JSON file's name without ``.json`` and a trailing ``-peers`` (``decode-peers.json`` fills the
``decode`` table). A document without a table's markers is refused and left as it was.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

from ..errors import QMoEInputError

__all__ = ["DASH", "build_parser", "fill_markers", "format_us", "load_run", "main", "markers", "peer_names",
           "render_table", "source_label", "table_name"]

DASH = "—"
REPO = Path(__file__).resolve().parent.parent.parent
#: How the tables name a peer (the JSON's key otherwise).
PEER_WORDS = {"marlin": "Marlin", "fbgemm_w4": "FBGEMM W4", "gmm": "torch gmm"}
#: Peer entries that are not peers: the float64 loop reference and qmoe_rtc itself.
NOT_PEERS = ("loop", "qmoe_rtc")
#: Timing modes other than CUDA-graph replay, as a cell's suffix says them.
MODE_WORDS = {"e": "eager", "c": "CPU wall"}


def load_run(path: str | Path) -> dict:
    """The peers benchmark's JSON at ``path`` (a dict with a ``rows`` list); refused when it is not one."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise QMoEInputError(str(path), "the JSON file `bench peers --out` writes",
                             f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise QMoEInputError(str(path), "a peers benchmark JSON (an object with a 'rows' list)",
                             f"keys {sorted(data)[:6]}" if isinstance(data, dict) else type(data).__name__)
    return data


def table_name(path: str | Path) -> str:
    """The table a JSON fills: its file name without ``.json`` and a trailing ``-peers``."""
    stem = Path(path).name.removesuffix(".json")
    return stem.removesuffix("-peers") or stem


def source_label(path: str | Path) -> str:
    """The source file as the header names it: relative to the repository root when inside it."""
    p = Path(path).resolve()
    return p.relative_to(REPO).as_posix() if p.is_relative_to(REPO) else str(path)


def markers(name: str) -> tuple[str, str]:
    """The two marker comments of table ``name`` (the first is followed, up to ``-->``, by the command)."""
    return f"<!-- {name} table:", f"<!-- end of {name} table -->"


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def format_us(value) -> str:
    """Microseconds: two decimals under 10, one under 1000, none from 1000; a dash for no number."""
    v = _number(value)
    if v is None:
        return DASH
    return f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def _ratio(value: float) -> str:
    text = f"{value:.2f}"
    return f"{value:.3f}" if text == "1.00" else text


def peer_names(data: dict) -> list[str]:
    """The peers of a run, qmoe_rtc and the loop reference left out: the order of its ``--peers``, then any other
    peer its rows hold."""
    args = (data.get("meta") or {}).get("args") or {}
    named = [p for p in str(args.get("peers") or "").split(",") if p and p not in NOT_PEERS]
    for row in data["rows"]:
        for p in _entries(row):
            if p not in NOT_PEERS and p not in named:
                named.append(p)
    return named


def _grid(data: dict) -> list[tuple[str, int, dict | None]]:
    """(shape, T, row or None) in the order of the run's ``--shapes`` and ``--tokens`` (the points it was asked
    for, a missing one with None), then any other row in the order the JSON holds them."""
    rows = {(r.get("shape"), r.get("T")): r for r in data["rows"] if isinstance(r, dict)}
    args = (data.get("meta") or {}).get("args") or {}
    shapes = [s for s in str(args.get("shapes") or "").split(",") if s]
    tokens = sorted({int(t) for t in re.split(r"[,\s]+", str(args.get("tokens") or "")) if t.isdigit()})
    out = [(s, t, rows.pop((s, t), None)) for s in shapes for t in tokens]
    return out + [(s, t, r) for (s, t), r in rows.items()]


def _entries(row) -> dict:
    """A row's peer entries (an empty dict for a missing row or one without peers)."""
    entries = row.get("peers") if isinstance(row, dict) else None
    return entries if isinstance(entries, dict) else {}


def _differs(entry) -> bool:
    """Whether qmoe_rtc's entry says its graph replay differed from its eager call."""
    return isinstance(entry, dict) and entry.get("replay_eq_eager") is False


def _peer_cell(entry) -> tuple[str, float | None]:
    """A peer's cell and its µs (None when it has none)."""
    us = _number(entry.get("us")) if isinstance(entry, dict) else None
    if us is None:
        return DASH, None
    mode = entry.get("mode")
    return format_us(us) + (f" ({MODE_WORDS.get(mode, mode)})" if mode and mode != "g" else ""), us


def _header(data: dict, source: str) -> list[str]:
    meta = data.get("meta") or {}
    args = meta.get("args") or {}
    argv = meta.get("argv")
    command = "bench_peers.py " + " ".join(str(a) for a in argv) if isinstance(argv, list) else DASH
    timing = ["eager" if args.get("no_graph") else "CUDA-graph replay", f"median of {args.get('iters', DASH)}"]
    if not args.get("no_flush"):
        timing.append("L2 flushed")
    layer = f"{args['dtype']} activations, int{args['bits']} weights; " if "dtype" in args and "bits" in args else ""
    bw, flops = _number(args.get("bw")), _number(args.get("flops"))
    floors = (f"floors at {bw / 1e12:.2f} TB/s and {flops / 1e12:.0f} TFLOP/s" if bw and flops
              else "floors as the run computed them")
    return [f"{meta.get('device', DASH)}, {meta.get('started', DASH)}: `{command}` (source: `{source}`)",
            "",
            f"µs per layer ({layer}{', '.join(timing)}); {floors}; **bold**: qmoe_rtc ahead of every peer; % of floor: "
            "the larger floor over qmoe_rtc's µs.",
            ""]


def _error_lines(data: dict, grid: list[tuple[str, int, dict | None]]) -> list[str]:
    """The run's recorded errors: its ``errors`` list, then each peer's error with the points it refused."""
    lines = []
    for e in data.get("errors") or []:
        text = json.dumps(e, sort_keys=True) if not isinstance(e, str) else e
        lines.append(f"- error: {' '.join(text.split())}")
    refused: dict[tuple[str, str], list[str]] = {}
    for shape, t, row in grid:
        for peer, entry in _entries(row).items():
            if isinstance(entry, dict) and entry.get("error"):
                refused.setdefault((peer, " ".join(str(entry["error"]).split())), []).append(f"{shape} {t}")
    for (peer, text), points in refused.items():
        lines.append(f"- {PEER_WORDS.get(peer, peer)} at {', '.join(points)}: {text}")
    if any(_differs(_entries(row).get("qmoe_rtc")) for _, _, row in grid):
        lines.append("- `!`: qmoe_rtc's graph replay differed from its eager call on the same inputs")
    return ["", "Errors recorded in the run:", "", *lines] if lines else []


def render_table(data: dict, source: str) -> str:
    """The Markdown block of one run (header, table, its errors), ending in a newline."""
    peers = peer_names(data)
    grid = _grid(data)
    head = ["shape", "T", "bytes floor", "FLOP floor", *(PEER_WORDS.get(p, p) for p in peers), "qmoe_rtc",
            "qmoe_rtc / best peer", "% of floor"]
    lines = [*_header(data, source), "| " + " | ".join(head) + " |",
             "|---|" + "---:|" * (len(head) - 3) + "---|---:|"]
    for shape, t, row in grid:
        row, entries = row or {}, _entries(row)
        cells = [_peer_cell(entries.get(p)) for p in peers]
        mine, us = _peer_cell(entries.get("qmoe_rtc"))
        if _differs(entries.get("qmoe_rtc")):
            mine += " !"
        timed = [(u, p) for (_, u), p in zip(cells, peers) if u]  # a zero time gives no ratio
        ratio = pct = DASH
        if us and timed:
            best, who = min(timed)
            ratio = f"{_ratio(us / best)}× {PEER_WORDS.get(who, who)}"
            if us < best:
                mine, ratio = f"**{mine}**", f"**{_ratio(us / best)}×** {PEER_WORDS.get(who, who)}"
        floors = [_number(row.get(k)) for k in ("floorB_us", "floorF_us")]
        floor = _number(row.get("floor_us")) or max((f for f in floors if f is not None), default=None)
        if us and floor is not None:
            pct = f"{100 * floor / us:.0f}"
        lines.append("| " + " | ".join([str(shape), str(t), *map(format_us, floors), *(c for c, _ in cells), mine,
                                        ratio, pct]) + " |")
    return "\n".join(lines + _error_lines(data, grid)) + "\n"


def fill_markers(doc: str, name: str, block: str, where: str = "the document") -> str:
    """``doc`` with the text between table ``name``'s markers replaced by ``block``; refused when the markers are
    missing, repeated or out of order."""
    begin, end = markers(name)
    starts = [m.end() for m in re.finditer(rf"^{re.escape(begin)}[^\n]*-->\n", doc, flags=re.M)]
    ends = [m.start() for m in re.finditer(rf"^{re.escape(end)}$", doc, flags=re.M)]
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        raise QMoEInputError(where, f"one '{begin} ... -->' line and, after it, one '{end}' line",
                             f"{len(starts)} opening and {len(ends)} closing markers",
                             hint="add the two marker lines where the table goes")
    return doc[:starts[0]] + block + doc[ends[0]:]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m qmoe_rtc bench reference", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", nargs="+", metavar="JSON", help="a peers benchmark JSON (bench peers --out F)")
    p.add_argument("--write", metavar="DOC", help="replace each table between its markers in DOC (nothing printed)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    tables = {table_name(j): render_table(load_run(j), source_label(j)) for j in args.json}
    if len(tables) < len(args.json):
        raise QMoEInputError("JSON", "files that fill different tables (names differ without .json and -peers)",
                             ", ".join(args.json))
    if not args.write:
        print("\n".join(tables.values()), end="")
        return 0
    doc_path = Path(args.write)
    try:
        doc = doc_path.read_text()
    except OSError as exc:
        raise QMoEInputError(args.write, "a readable Markdown file", f"{type(exc).__name__}: {exc}") from exc
    for name, block in tables.items():
        doc = fill_markers(doc, name, block, where=args.write)
    doc_path.write_text(doc)
    return 0
