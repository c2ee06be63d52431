#!/usr/bin/env python3
"""Warm the qmoe_rtc kernel cache (same as ``python -m qmoe_rtc warm``).

    python tools/warm_cache.py --preset qwen3-30b-a3b --arch sm_90 --dtype float16,bfloat16
    python tools/warm_cache.py --hidden 4096 --inter 14336 --experts 8 --k 2 --bits 4 --arch sm_90 --list
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from qmoe_rtc.warm import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
