"""Summarise an ncu source-page export (`ncu -i REPORT --page source --csv --print-source sass > F.csv`,
collected with `--section SourceCounters`): warp-stall samples by reason, the instructions that hold most
samples, and the executed instruction mix per tensor-core MMA (HGMMA, or HMMA for mma.sync kernels).

    python tools/ncu_source_summary.py F.csv [--top 40]
"""

from __future__ import annotations

import argparse
import collections
import csv
import re

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def _num(v: str) -> float:
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return 0.0


def summarise(path: str, top: int = 40) -> str:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    start = next(i for i, r in enumerate(rows) if SAMPLES in r)  # the header row (a kernel-name row may precede it)
    hdr, data = rows[start], rows[start + 1:]
    ix = {h: i for i, h in enumerate(hdr)}
    stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(_num(r[ix[SAMPLES]]) for r in data) or 1.0
    out = [f"{path}: {total:.0f} samples over {len(data)} instructions"]
    by = sorted(((sum(_num(r[ix[s]]) for r in data), s[6:]) for s in stalls), reverse=True)
    out.append("stall reasons: " + ", ".join(f"{k} {v / total:.1%}" for v, k in by if v / total >= 0.005))
    out.append(f"top {top} instructions by samples (index, share, SASS, two largest reasons):")
    order = sorted(range(len(data)), key=lambda i: -_num(data[i][ix[SAMPLES]]))[:top]
    for i in sorted(order):
        r = data[i]
        why = sorted(((_num(r[ix[k]]), k[6:]) for k in stalls), reverse=True)[:2]
        out.append(f"{i:6d} {_num(r[ix[SAMPLES]]) / total:6.1%}  {r[ix['Source']].strip()[:72]:<72} "
                   + " ".join(f"{k}:{v / total:.1%}" for v, k in why if v))
    ops: collections.Counter = collections.Counter()
    for r in data:
        src = re.sub(r"^@!?U?P\w+\s+", "", r[ix["Source"]].strip())
        ops[src.split(" ")[0].split(".")[0]] += _num(r[ix[EXECUTED]])
    mma = ops.get("HGMMA") or ops.get("HMMA") or 0.0
    if mma:
        out.append(f"executed warp instructions per {'HGMMA' if ops.get('HGMMA') else 'HMMA'}: "
                   f"{sum(ops.values()) / mma:.1f}; by opcode:")
        out.append("  " + ", ".join(f"{op} {n / mma:.2f}" for op, n in ops.most_common(24)))
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv")
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args(argv)
    print(summarise(args.csv, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
