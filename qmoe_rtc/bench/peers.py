"""Run the peers benchmark (qmoe_rtc side by side with other MoE kernels) from its script, which lives
outside this repository: a maintainer passes its path. The script runs with this Python; every argument
after ``--script PATH`` goes to it unchanged, plus ``--qmoe-path`` (this repository's root) unless they
give one. Nothing is downloaded; the exit status is the script's.

    python -m qmoe_rtc bench peers --script .peers/bench_peers.py --humming-site /tmp/hsite \\
        --peers humming,humming_g,gmm,qmoe_rtc --tokens 1,8,64,4096 --out out/peers.json
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m qmoe_rtc bench peers", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="%(prog)s --script PATH [ARGS...]")
    p.add_argument("--script", metavar="PATH", help="the peers benchmark script (e.g. bench_peers.py); required")
    return p


def repo_root() -> Path:
    """The directory holding this ``qmoe_rtc`` package (what the peers script imports it from)."""
    return Path(__file__).resolve().parent.parent.parent


def script_argv(script: str, args: list[str]) -> list[str]:
    """The command line: this Python, the script, ``args``, and ``--qmoe-path ROOT`` unless ``args`` give it."""
    given = any(a == "--qmoe-path" or a.startswith("--qmoe-path=") for a in args)
    return [sys.executable, script, *args, *([] if given else ["--qmoe-path", str(repo_root())])]


def main(argv=None) -> int:
    parser = build_parser()
    a, rest = parser.parse_known_args(argv)
    if not a.script:
        parser.error("--script PATH is required: the path of the peers benchmark script (bench_peers.py, kept "
                     "outside this repository); got none")
    if not Path(a.script).is_file():
        parser.error(f"--script {a.script}: expected the path of the peers benchmark script (a file); "
                     "no such file")
    return subprocess.run(script_argv(a.script, rest), check=False).returncode
