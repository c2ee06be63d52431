"""Registers, local memory (spills) and static shared memory of every decode kernel of a preset
(GPU needed: the modules are loaded). Usage: python tools/kernel_info.py [--preset qwen3-30b-a3b] [--dtype float16]"""

from __future__ import annotations

import argparse


def main(argv=None) -> int:
    from cupy_backends.cuda.api import driver

    from qmoe_rtc.jit import load_module
    from qmoe_rtc.presets import PRESETS
    from qmoe_rtc.specialize import modules_for

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--dtype", default="float16")
    args = p.parse_args(argv)
    cfg = PRESETS[args.preset].config(dtype=args.dtype)
    # CUfunction_attribute values (cuda.h): shared 1, local 3, registers 4
    attrs = {"regs": 4, "local B": 3, "smem B": 1}
    for spec in modules_for(cfg, ("decode",), families=("gemv", "mma")):
        for key, kern in load_module(spec, 0).kernels.items():
            vals = ", ".join(f"{n} {driver.funcGetAttribute(a, kern.function.ptr)}" for n, a in attrs.items())
            print(f"{spec.family}.{key}: {vals}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
