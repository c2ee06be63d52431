#!/usr/bin/env python3
"""Benchmark qmoe_rtc on the GPU (same as ``python -m qmoe_rtc bench``; see ``--help``)."""
import os, sys; sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))  # noqa: E401,E702
from qmoe_rtc.bench import main  # noqa: E402
if __name__ == "__main__": sys.exit(main())  # noqa: E701
