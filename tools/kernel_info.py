"""Registers, local memory (spills) and static shared memory of every kernel a preset's layer loads
(GPU needed: the modules are loaded). Usage: python tools/kernel_info.py [--preset qwen3-30b-a3b] [--dtype float16]"""

from __future__ import annotations

import argparse


def main(argv=None) -> int:
    from qmoe_rtc.jit import load_module
    from qmoe_rtc.kernels import modules_for, spec_unit
    from qmoe_rtc.specialize.presets import PRESETS

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--dtype", default="float16")
    args = p.parse_args(argv)
    cfg = PRESETS[args.preset].config(dtype=args.dtype)
    for spec in modules_for(cfg):
        for key, kern in load_module(spec_unit(spec), 0).kernels.items():
            vals = ", ".join(f"{n} {kern.attribute(a)}" for n, a in
                             (("regs", "registers"), ("local B", "local_bytes"), ("smem B", "shared_bytes")))
            print(f"{spec.family}.{key}: {vals}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
