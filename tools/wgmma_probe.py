"""The rate of warpgroup MMAs with A from registers on one SM of the device (tools/probes/wgmma_rate.cu):
a floor for the Hopper prefill engines' main loops, without and with their copies.

Each variant (the kernel's defines P_WG warpgroups, P_N routes, P_INF MMAs in flight, P_DEQ dequantization,
P_SYNC chunk hand-off, and for the copy variants P_LOAD KB copied a chunk, P_SHARE blocks reading the same
bytes, P_SPAN_MB the source region; P_FP8 float8 e4m3 MMAs, P_PROMOTE a scale per chunk applied outside the
MMA; printed as wg{P_WG}_n{P_N}_inf…[_ld…_sh…_mb…][_fp8][_prom]) runs one block per SM for --chunks chunks of
128 codes and prints cycles per chunk against the tensor pipe's ideal (bfloat16: P_WG · 8 · P_N/2 cycles, an
m64nNk16 being 64·N·16 multiply-adds at 2048 a cycle per SM; e4m3: 4 k32 steps at twice that rate, P_WG · 4 ·
P_N/2), and for the copy variants the bytes per cycle the whole device copied. Cycles come from clock64, so the
clock speed drops out.

  python tools/wgmma_probe.py --compile-to DIR      # compile every variant here (no GPU needed)
  python tools/wgmma_probe.py --cubins DIR          # run them on the GPU (compiles what DIR lacks)
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

SRC = Path(__file__).with_name("probes") / "wgmma_rate.cu"
DEFINES = ("P_WG", "P_N", "P_INF", "P_DEQ", "P_SYNC", "P_LOAD", "P_SHARE", "P_SPAN_MB", "P_FP8", "P_PROMOTE")
#: (P_WG, P_N, P_INF, P_DEQ, P_SYNC) measured by default, without copies
VARIANTS = [v for v in itertools.product((1, 2, 3, 4), (128, 256), (0, 1), (0, 1), (0, 1))
            if not (v[0] >= 3 and v[1] == 256)]  # 3-4 warpgroups × 128 accumulators exceed the register file
#: the `tiles` engine's block (4 warpgroups × 128 routes, dequantized, chunk hand-off) fed through a ring:
#: (…, P_LOAD KB a chunk, P_SHARE, P_SPAN_MB). It copies 48 KB a chunk (16 of codes, 32 of route tile).
#: (2 warpgroups × 256 routes would need 69 KB stages: fewer than three fit, so it has no copy variant.)
LOAD_VARIANTS = [(4, 128, 1, 1, 1, kb, share, span) for kb in (16, 32, 48) for share in (1, 16)
                 for span in (16, 1024)]
#: the engines' dequantization (P_DEQ 2: each of a lane's two rows its own codes), with and without copies
REAL_DEQ_VARIANTS = [(nwg, n, inf, 2, 1) for nwg, n in ((4, 128), (2, 256), (3, 128)) for inf in (0, 1)] + \
    [(4, 128, 1, 2, 1, 48, 16, 16)]
#: FP8 (e4m3) MMAs for W4A8 prefill (issue 57): the pure rate (fixed A), int4 codes made e4m3 in registers
#: (P_DEQ 2) or prepacked e4m3 read from shared memory (P_DEQ 3), each without and with a scale per chunk applied
#: outside the MMA (P_PROMOTE), and fed through a ring (32 KB a chunk: 128 routes' e4m3 and 256 rows' int4
#: codes; 48 KB: their e4m3 codes). Beside them the same engines' block in bfloat16 (REAL_DEQ_VARIANTS). With 4
#: warpgroups the promoted variants' two accumulator sets spill (ptxas, NVRTC 13.5: 92-304 bytes): their cycles
#: measure the spills, not the scale.
FP8_VARIANTS = [(nwg, n, 1, deq, 1, 0, 1, 16, 1, prom) for nwg, n in ((4, 128), (3, 128), (2, 256))
                for deq in (0, 2, 3) for prom in (0, 1) if not (prom and n == 256)] + \
    [(4, 128, 1, deq, 1, kb, 16, 16, 1, prom) for deq, kb in ((2, 32), (3, 48)) for prom in (0, 1)]
SPAN_MAX_MB = 1024


def name_of(v) -> str:
    base = "wg{}_n{}_inf{}_deq{}_sync{}".format(*v[:5])
    if len(v) > 5 and v[5]:
        base += "_ld{}_sh{}_mb{}".format(*v[5:8])
    return base + ("_fp8" if len(v) > 8 and v[8] else "") + ("_prom" if len(v) > 9 and v[9] else "")


def all_variants():
    return VARIANTS + LOAD_VARIANTS + REAL_DEQ_VARIANTS + FP8_VARIANTS


def compile_variant(v, arch: str = "sm_90a") -> bytes:
    from qmoe_rtc.jit import compiler
    defines = tuple(f"-D{k}={x}" for k, x in zip(DEFINES, v))
    cubin, _, _ = compiler.compile_unit(name_of(v), SRC.read_text(), {"k": "wgmma_rate"}, arch,
                                        compiler.base_options(arch, defines))
    return cubin


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compile-to", type=Path, help="compile every variant into this folder and stop")
    p.add_argument("--cubins", type=Path, help="folder of precompiled variants")
    p.add_argument("--chunks", type=int, default=4000)
    p.add_argument("--only", default="", help="run only the variants whose name contains this")
    args = p.parse_args(argv)
    if args.compile_to:
        args.compile_to.mkdir(parents=True, exist_ok=True)
        for v in all_variants():
            (args.compile_to / f"{name_of(v)}.cubin").write_bytes(compile_variant(v))
        print(f"compiled {len(all_variants())} variants into {args.compile_to}")
        return 0
    import cupy as cp
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    src = cp.full(SPAN_MAX_MB << 18, 0x3C003C00, cp.uint32)  # small bf16 values
    print(f"{'variant':<44} {'cycles/chunk':>12} {'ideal':>6} {'of ideal':>8} {'B/cycle':>8}")
    for v in all_variants():
        if args.only not in name_of(v):
            continue
        nwg, n = v[0], v[1]
        path = args.cubins / f"{name_of(v)}.cubin" if args.cubins else None
        if path is None or not path.exists():
            path = Path("/tmp") / f"{name_of(v)}.cubin"
            path.write_bytes(compile_variant(v))
        fn = cp.RawModule(path=str(path)).get_function("wgmma_rate")
        load_kb = v[5] if len(v) > 5 else 0
        fp8 = len(v) > 8 and v[8]
        stage = max(load_kb * 1024, n * (128 if fp8 else 256) + 4096)
        smem = (min(4, 200 * 1024 // stage) if load_kb else 1) * stage + 1024
        fn.max_dynamic_shared_size_bytes = smem
        out = cp.zeros(sms * nwg * 128, cp.float32)
        cyc = cp.zeros(sms, cp.int64)
        for _ in range(2):  # the first launch warms the clocks
            fn((sms,), (nwg * 128,), (cp.int32(args.chunks), cp.uint32(12345), src, out, cyc), shared_mem=smem)
        cp.cuda.Device().synchronize()
        per = float(cp.median(cyc.astype(cp.float64))) / args.chunks
        ideal = nwg * (4 if fp8 else 8) * n / 2
        rate = f"{sms * load_kb * 1024 / per:8.0f}" if load_kb else f"{'':8}"
        print(f"{name_of(v):<44} {per:12.1f} {ideal:6.0f} {ideal / per:8.1%} {rate}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
