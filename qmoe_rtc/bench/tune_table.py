"""``bench ab --write-table FILE``: the fastest setting of each knob an A/B measured, per (bench shape, tokens), written
as a tuning table module (qmoe_rtc/kernels/tuning/, docs/runtime-compilation.md "Per-arch tuning tables").

A point's fastest setting (the lowest median) gives each knob the A/B varied its value there (a setting that does
not name a knob ran it at its default: ``defaults``). The table takes, for each knob the tables hold
(:data:`~qmoe_rtc.kernels.tuning.ARCH_KNOBS`), the value fastest at the most points (ties: the lowest summed median
of the points it won), and the default table's value for the others; every measured knob's per-point result is kept
in the module's ``MEASURED``, which is where a knob the tables do not hold is reported.
"""

from __future__ import annotations

from collections import defaultdict

from ..errors import QMoEInputError

__all__ = ["fastest", "table_knobs", "table_source"]


def fastest(rows: list[dict], defaults: dict) -> dict[str, dict[tuple[str, int], tuple]]:
    """{knob: {(shape, tokens): (value, median µs)}}: the value each varied knob had in the fastest row of each point
    (``rows``: ``bench ab``'s, each with shape, T, setting, median_us; ``defaults``: the value a knob ran at where a
    setting did not name it)."""
    varied = sorted({k for r in rows for k in r["setting"] if k in defaults})
    points: dict[tuple[str, int], dict] = {}
    for r in rows:
        key = (r["shape"], int(r["T"]))
        if key not in points or r["median_us"] < points[key]["median_us"]:
            points[key] = r
    return {k: {key: (r["setting"].get(k, defaults[k]), r["median_us"]) for key, r in sorted(points.items())}
            for k in varied}


def table_knobs(measured: dict[str, dict[tuple[str, int], tuple]], base: dict) -> dict:
    """The table's knob defaults: ``base`` (the default table's), each knob of it that was measured taking the value
    fastest at the most points (ties: the lowest summed median over the points it won)."""
    out = dict(base)
    for k, per_point in measured.items():
        if k not in base:
            continue
        wins: dict = defaultdict(lambda: [0, 0.0])
        for value, us in per_point.values():
            wins[value][0] += 1
            wins[value][1] += us
        out[k] = min(wins, key=lambda v: (-wins[v][0], wins[v][1]))
    return out


def table_source(rows: list[dict], defaults: dict, family: str, device: str) -> str:
    """A tuning table module for arch ``family`` ('sm_89' ...) from ``bench ab`` rows measured on ``device``."""
    from ..kernels.tuning.default import TABLE as BASE

    if not family.startswith("sm_") or not family[3:].isdigit():
        raise QMoEInputError("family", "an arch family like 'sm_89'", repr(family))
    measured = fastest(rows, defaults)
    if not measured:
        raise QMoEInputError("settings", "at least one knob varied between the settings", repr(sorted(defaults)))
    knobs = table_knobs(measured, BASE.knobs)
    lines = [f'"""Tuning table of {family}, written by `python -m qmoe_rtc bench ab --write-table` on {device}: the',
             "fastest value of each knob measured per (bench shape, tokens), and the table built from them (the default",
             "table's values where nothing was measured). Review it, say in comments what was measured, and keep it as",
             f'qmoe_rtc/kernels/tuning/{family}.py."""', "", "from __future__ import annotations", "",
             "from dataclasses import replace", "", "from .default import TABLE as _BASE", "",
             "#: {knob: {(bench shape, tokens): (fastest value, its median us)}}; knobs the tables do not hold "
             "(kernels/tuning ARCH_KNOBS) are only reported here", "MEASURED = {"]
    for k, per_point in measured.items():
        lines.append(f"    {k!r}: {{")
        lines += [f"        ({shape!r}, {t}): ({v!r}, {us:.1f})," for (shape, t), (v, us) in per_point.items()]
        lines.append("    },")
    lines += ["}", "", f"TABLE = replace(_BASE, name={family!r}, measured_on={f'{device} (bench ab)'!r},",
              f"                knobs={knobs!r})", ""]
    return "\n".join(lines)
