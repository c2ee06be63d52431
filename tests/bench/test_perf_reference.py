"""The performance reference (docs/performance.md) and its generator (``python -m qmoe_rtc bench reference``): the
page's tables are what the JSON in docs/reference/ gives (one source, so the page cannot drift from its data), the page
stays short, and the raw-data index lists files that git history holds. GPU-free."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qmoe_rtc.bench import reference
from qmoe_rtc.errors import QMoEInputError

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "performance.md"
SOURCES = sorted((REPO / "docs" / "reference").glob("*.json"))
INDEX = REPO / "docs" / "perf-data" / "README.md"


def between_markers(doc: str, name: str) -> str:
    """The text between table ``name``'s markers in ``doc`` (the test's own reading of them)."""
    begin, end = reference.markers(name)
    m = re.search(rf"^{re.escape(begin)}[^\n]*-->\n(.*?)^{re.escape(end)}$", doc, flags=re.M | re.S)
    assert m, f"no markers for the {name} table"
    return m.group(1)


def drift(doc: str) -> list[str]:
    """The tables of ``doc`` that differ from what their JSON in docs/reference/ gives."""
    return [j.name for j in SOURCES if between_markers(doc, reference.table_name(j))
            != reference.render_table(reference.load_run(j), reference.source_label(j))]


def run(**peers_by_point) -> dict:
    """A small peers JSON: ``run(**{"s 1": {"a": 10, "qmoe_rtc": 8}})`` (µs per peer; a dict is the entry itself)."""
    rows = []
    for point, peers in peers_by_point.items():
        shape, t = point.split()
        rows.append({"shape": shape, "T": int(t), "floorB_us": 4.0, "floorF_us": 1.0, "floor_us": 4.0,
                     "peers": {p: (v if isinstance(v, dict) else {"us": v, "mode": "g"}) for p, v in peers.items()}})
    return {"meta": {"device": "GPU X", "started": "2030-01-01 00:00:00", "argv": ["--tokens", "1"],
                     "args": {"peers": "a,b,qmoe_rtc", "shapes": "s", "tokens": "1,2", "iters": 30, "dtype": "bf16",
                              "bits": 4, "bw": 4.3e12, "flops": 7.9e14}},
            "rows": rows, "errors": []}


def body_rows(text: str) -> list[list[str]]:
    """The table's data rows, as cells."""
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| shape")]


# -- the page and its sources -------------------------------------------------------------------
def test_the_reference_has_its_two_sources():
    assert [j.name for j in SOURCES] == ["decode-peers.json", "prefill-peers.json"]
    assert [reference.table_name(j) for j in SOURCES] == ["decode", "prefill"]


def test_the_pages_tables_are_what_their_json_gives():
    """Each table between its markers is the generator's output for its JSON: rerun `bench reference --write`
    after replacing a JSON (the markers' first line says the command)."""
    assert drift(DOC.read_text()) == []


def test_the_drift_check_fails_on_an_edited_page():
    doc = DOC.read_text()

    def edit_first_row(name: str) -> str:  # one digit of the first data row of the table NAME, whatever its numbers
        start = doc.index(f"<!-- {name} table:")
        row = doc.index("\n| qwen3-30b-a3b |", start) + 1
        end = doc.index("\n", row)
        line = doc[row:end]
        i = max(j for j, c in enumerate(line) if c.isdigit())
        return doc[:row] + line[:i] + str((int(line[i]) + 1) % 10) + line[i + 1:] + doc[end:]

    edited = edit_first_row("decode")
    assert edited != doc and drift(edited) == ["decode-peers.json"]
    assert drift(edit_first_row("prefill")) == ["prefill-peers.json"]


def test_write_reproduces_the_page(tmp_path):
    """`bench reference --write` on a copy of the page changes nothing (it is what the page holds), and on a page whose
    table was edited puts the generated one back."""
    page = tmp_path / "performance.md"
    page.write_text(DOC.read_text().replace("| **31.9** |", "| **30.9** |", 1))
    assert reference.main([*map(str, SOURCES), "--write", str(page)]) == 0
    assert page.read_text() == DOC.read_text()


def test_the_page_stays_short():
    lines = DOC.read_text().splitlines()
    assert len(lines) <= 200, f"docs/performance.md has {len(lines)} lines: move history to docs/performance-log.md"


def test_the_command_prints_the_tables():
    r = subprocess.run([sys.executable, "-m", "qmoe_rtc", "bench", "reference", *map(str, SOURCES)], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "\n".join(reference.render_table(reference.load_run(j), reference.source_label(j))
                                 for j in SOURCES)
    assert "(source: `docs/reference/decode-peers.json`)" in r.stdout and "NVIDIA H200" in r.stdout


def test_a_bad_json_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("[1, 2]")
    r = subprocess.run([sys.executable, "-m", "qmoe_rtc", "bench", "reference", str(bad)], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "QMoEInputError" in r.stderr, r.stderr


# -- the generator ------------------------------------------------------------------------------
def test_the_header_names_device_date_command_and_source():
    head = reference.render_table(run(**{"s 1": {"a": 10, "b": 12, "qmoe_rtc": 8}}), "docs/reference/x.json")
    first = head.splitlines()[0]
    assert first == "GPU X, 2030-01-01 00:00:00: `bench_peers.py --tokens 1` (source: `docs/reference/x.json`)"


def test_bold_only_where_qmoe_rtc_is_ahead_of_every_peer():
    data = run(**{"s 1": {"a": 10, "b": 12, "qmoe_rtc": 8}, "s 2": {"a": 10, "b": 9, "qmoe_rtc": 9.5}})
    ahead, behind = body_rows(reference.render_table(data, "x.json"))
    assert ahead == ["s", "1", "4.00", "1.00", "10.0", "12.0", "**8.00**", "**0.80×** a", "50"]
    assert behind == ["s", "2", "4.00", "1.00", "10.0", "9.00", "9.50", "1.06× b", "42"]


def test_a_tie_shows_three_decimals():
    data = run(**{"s 1": {"a": 4951.2, "qmoe_rtc": 4950.8}, "s 2": {"a": 100.0, "qmoe_rtc": 100.2}})
    tie_ahead, tie_behind = body_rows(reference.render_table(data, "x.json"))
    assert tie_ahead[6:8] == ["**4951**", "**1.000×** a"] and tie_behind[6:8] == ["100.2", "1.002× a"]


def test_a_missing_peer_row_or_number_prints_a_dash():
    data = run(**{"s 1": {"a": 10, "qmoe_rtc": 8}})  # b never ran; point s 2 (asked for) is absent
    data["rows"].append({"shape": "t", "T": 7, "peers": {"a": {"us": None}, "qmoe_rtc": {"us": float("nan")}}})
    one, two, other = body_rows(reference.render_table(data, "x.json"))
    assert one[5] == reference.DASH and one[7] == "**0.80×** a"
    assert two[:2] == ["s", "2"] and set(two[2:]) == {reference.DASH}
    assert other[:2] == ["t", "7"] and set(other[2:]) == {reference.DASH}
    zero = run(**{"s 1": {"a": 0.0, "qmoe_rtc": 0.0}})
    assert body_rows(reference.render_table(zero, "x.json"))[0][4:] == ["0.00", reference.DASH, "0.00", reference.DASH,
                                                                  reference.DASH]
    empty = {"rows": []}
    assert body_rows(reference.render_table(empty, "x.json")) == []  # the header alone, no crash without meta


def test_recorded_errors_are_listed_under_the_table():
    refusal = {"error": "PeerUnavailable: unsupported\nhere", "err": None}
    data = run(**{"s 1": {"a": 10, "b": refusal, "qmoe_rtc": 8}, "s 2": {"a": 10, "b": refusal, "qmoe_rtc": 9}})
    data["errors"] = ["s 4: qmoe_rtc failed", {"shape": "s", "T": 8, "error": "boom"}]
    text = reference.render_table(data, "x.json")
    table, errors = text.split("Errors recorded in the run:")
    assert all(row[5] == reference.DASH for row in body_rows(table))
    assert errors.strip().splitlines() == [
        "- error: s 4: qmoe_rtc failed",
        '- error: {"T": 8, "error": "boom", "shape": "s"}',
        "- b at s 1, s 2: PeerUnavailable: unsupported here"]
    assert "Errors recorded" not in reference.render_table(run(**{"s 1": {"a": 1, "qmoe_rtc": 2}}), "x.json")


def test_eager_timings_and_a_replay_that_differs_are_marked():
    data = run(**{"s 1": {"a": {"us": 10.0, "mode": "e"},
                          "qmoe_rtc": {"us": 8.0, "mode": "g", "replay_eq_eager": False}}})
    text = reference.render_table(data, "x.json")
    row, _absent = body_rows(text)
    assert row[4] == "10.0 (eager)" and row[6] == "**8.00 !**" and "graph replay differed" in text


def test_peers_follow_the_runs_order_then_any_other():
    data = run(**{"s 1": {"z": 3, "b": 2, "a": 1, "loop": {}, "qmoe_rtc": 1}})
    assert reference.peer_names(data) == ["a", "b", "z"]


def test_write_refuses_a_page_without_the_markers(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# no markers\n<!-- decode table: x -->\n")  # an opening marker alone is refused too
    before = page.read_text()
    source = tmp_path / "decode-peers.json"
    source.write_text(json.dumps(run(**{"s 1": {"a": 1, "qmoe_rtc": 2}})))
    with pytest.raises(QMoEInputError, match="1 opening and 0 closing markers"):
        reference.main([str(source), "--write", str(page)])
    assert page.read_text() == before
    with pytest.raises(QMoEInputError, match="0 opening"):
        reference.fill_markers("text\n", "prefill", "block\n")
    doubled = "<!-- d table: a -->\n<!-- end of d table -->\n" * 2
    with pytest.raises(QMoEInputError, match="2 opening and 2 closing"):
        reference.fill_markers(doubled, "d", "block\n")


def test_write_fills_only_between_the_markers():
    doc = "a\n<!-- d table: python -m qmoe_rtc bench reference d.json -->\nold\n<!-- end of d table -->\nz\n"
    assert reference.fill_markers(doc, "d", "new\n") == doc.replace("old\n", "new\n")
    assert reference.table_name("x/2026-12-06-s35-call7-peers.json") == "2026-12-06-s35-call7"


def test_two_json_for_one_table_are_refused(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "decode-peers.json").write_text(json.dumps(run()))
    with pytest.raises(QMoEInputError, match="different tables"):
        reference.main([str(a / "decode-peers.json"), str(b / "decode-peers.json")])


def test_the_generator_leaves_its_input_alone():
    data = json.loads(SOURCES[0].read_text())
    kept = copy.deepcopy(data)
    reference.render_table(data, "x.json")
    assert data == kept


# -- the raw-data index ---------------------------------------------------------------------------
def test_only_the_index_stays_in_perf_data():
    assert [p.name for p in (REPO / "docs" / "perf-data").iterdir()] == ["README.md"]


def test_every_file_the_index_lists_is_in_its_archive_commit():
    """The index's per-session lines name files that `git show <commit>:docs/perf-data/<name>` reads, <commit> one of
    its archive commits; every file those commits hold there is listed."""
    text = INDEX.read_text()
    commits = re.findall(r"^\| `([0-9a-f]{40})` \|", text, flags=re.M)
    assert commits and len(set(commits)) == len(commits)
    listed = set()
    for line in re.findall(r"^- \*\*.*$", text, flags=re.M):
        prefix = re.search(r"`([^`]+)` \+ ", line)
        names = line.split(" + ", 1)[1] if prefix else line.split(": ", 1)[1]
        listed |= {(prefix.group(1) if prefix else "") + n for n in names.split(", ")}
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("no git checkout here: the archive commit cannot be read")
    archived = set()
    for commit in commits:
        r = subprocess.run(["git", "ls-tree", "--name-only", commit, "docs/perf-data/"], cwd=REPO, capture_output=True,
                           text=True, timeout=60)
        if r.returncode != 0:
            pytest.skip(f"this clone lacks the archive commit {commit} (shallow?): {r.stderr.strip()}")
        archived |= {n.removeprefix("docs/perf-data/") for n in r.stdout.split()} - {"README.md"}
    assert listed == archived
