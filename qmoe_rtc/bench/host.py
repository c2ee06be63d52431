"""Where the host time of one eager call goes (GPU needed): the whole call, and its parts measured
alone, median of many repetitions, in µs.

    python -m qmoe_rtc bench host
"""

from __future__ import annotations

import argparse
import sys
import time


def med_us(fn, n: int = 3000) -> float:
    import cupy as cp
    import numpy as np

    for _ in range(50):
        fn()
    t = []
    for i in range(n):
        if i % 64 == 0:
            cp.cuda.Device().synchronize()
        t0 = time.perf_counter_ns()
        fn()
        t.append(time.perf_counter_ns() - t0)
    return float(np.median(t)) / 1e3


def build_parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog="python -m qmoe_rtc bench host", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def main(argv=None) -> int:
    build_parser().parse_args(argv)
    from ..jit.driver import _drv, probe

    probe(0)  # no driver, no GPU: one line (a DeviceError) before CuPy is asked
    import ctypes

    import cupy as cp
    import numpy as np

    from ..contract.random_layer import random_inputs, random_layer
    from ..executor import QMoE
    from ..runtime.interop import data_ptr, signature

    rng = np.random.default_rng(0)
    w, a = random_layer(rng, E=8, H=256, I=128, k=2, bits=4, block_size=128, dtype="float16",
                        activation_type="swiglu", swiglu_fusion=1)
    moe = QMoE(**{n: cp.asarray(v) for n, v in w.items()}, **a)
    from ..runtime.eager_graph import GraphedLaunches
    from ..settings import knobs

    with knobs.scope(eager_graphs=False):
        plain = QMoE(**{n: cp.asarray(v) for n, v in w.items()}, **a)
    rows = {}
    for T in (1, 8):
        x, lg, _ = random_inputs(rng, T, 256, 8, "float16")
        x, lg = cp.asarray(x), cp.asarray(lg)
        out = cp.empty_like(x)
        moe(x, lg, out=out)
        plain(x, lg, out=out)
        rows[f"call T={T}, out="] = med_us(lambda: moe(x, lg, out=out))
        rows[f"call T={T}, allocating"] = med_us(lambda: moe(x, lg))
        rows[f"call T={T}, out=, plain launches"] = med_us(lambda: plain(x, lg, out=out))
        y1 = cp.asnumpy(moe(x, lg)).copy()
        y2 = cp.asnumpy(plain(x, lg)).copy()
        rows[f"T={T}: graph-launched output == plain (1 = yes)"] = float(np.array_equal(y1, y2))
    key = (signature(x), signature(lg), signature(None), signature(out))
    call = moe._calls[key]
    stream = call.stream(moe.device_id)
    bound = call.plan.bind(moe._pools[stream], moe._table, stream)
    ptrs = (data_ptr(x), data_ptr(lg), 0, data_ptr(out))
    rows["4 signatures"] = med_us(lambda: (signature(x), signature(lg), signature(None), signature(out)))
    rows["call-cache lookup"] = med_us(lambda: moe._calls.get(key))
    rows["current stream"] = med_us(lambda: call.stream(moe.device_id))
    rows["4 data_ptr"] = med_us(lambda: (data_ptr(x), data_ptr(lg), data_ptr(None), data_ptr(out)))
    rows[f"bound launches ({len(bound.items)})"] = med_us(lambda: bound.launch(stream, ptrs))
    graphed = GraphedLaunches(bound, moe.device_id)
    rows["the same as one graph launch"] = med_us(lambda: graphed.launch(stream, ptrs))
    fn, gx, gy, gz, bx, by, bz, smem, vals, address, slots, kern, _p = bound.items[0]
    drv = _drv()
    rows["1 cuLaunchKernel (cuda-bindings)"] = med_us(lambda: drv.cuLaunchKernel(fn, gx, gy, gz, bx, by, bz, smem,
                                                                                 stream, address, 0))
    side = cp.cuda.Stream(non_blocking=True)
    rows["1 cuLaunchKernel, non-blocking stream"] = med_us(lambda: drv.cuLaunchKernel(fn, gx, gy, gz, bx, by, bz, smem,
                                                                                      side.ptr, address, 0))
    rows["bound launches, non-blocking stream"] = med_us(lambda: bound.launch(side.ptr, ptrs))
    lib = ctypes.CDLL("libcuda.so.1")
    launch = lib.cuLaunchKernel
    launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    launch.restype = ctypes.c_int
    fptr = int(fn)
    rows["1 cuLaunchKernel (ctypes)"] = med_us(lambda: launch(fptr, gx, gy, gz, bx, by, bz, smem, stream, address, None))
    try:
        import torch

        tx, tl = torch.from_dlpack(x), torch.from_dlpack(lg)
        to = torch.empty_like(tx)
        moe(tx, tl, out=to)
        rows["call T=8, torch, out="] = med_us(lambda: moe(tx, tl, out=to))
        rows["torch signature"] = med_us(lambda: signature(tx))
        raw = torch._C._cuda_getCurrentRawStream
        rows["torch raw stream"] = med_us(lambda: raw(0))
    except Exception as exc:  # torch is optional here
        print(f"torch part skipped: {exc}")
    cp.cuda.Device().synchronize()
    for k, v in rows.items():
        print(f"{k:<40} {v:8.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
