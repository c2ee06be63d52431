#!/usr/bin/env python3
"""Benchmark qmoe_rtc on the GPU (same as ``python -m qmoe_rtc bench``; see ``--help``)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from qmoe_rtc.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
