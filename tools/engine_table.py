"""The engine table of README.md ("Which kernels run") is generated from ``qmoe_rtc.kernels.pipelines.PIPELINES``:
this prints it, or with ``--write`` puts it into README.md between its markers (``tests/test_pipelines.py`` checks the
README holds exactly this text, so a new pipeline or a changed one shows up in the table or fails CI).

    PYTHONPATH=. python tools/engine_table.py [--write]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

README = Path(__file__).resolve().parent.parent / "README.md"
BEGIN, END = "<!-- engine table: tools/engine_table.py -->\n", "<!-- end of engine table -->\n"


def readme_with_table(text: str, table: str) -> str:
    """``text`` (README.md) with the part between the markers replaced by ``table``."""
    head, begin, rest = text.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise SystemExit(f"README.md lacks the markers {BEGIN.strip()!r} ... {END.strip()!r}")
    return head + BEGIN + table + END + tail


def main(argv=None) -> int:
    from qmoe_rtc.kernels.pipelines import engine_table

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", action="store_true", help="write the table into README.md")
    args = p.parse_args(argv)
    if not args.write:
        print(engine_table(), end="")
        return 0
    README.write_text(readme_with_table(README.read_text(), engine_table()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
