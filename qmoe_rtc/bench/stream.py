"""How long one kernel takes to read a layer's bytes on this GPU: the floor a single launch reaches.

``python -m qmoe_rtc bench stream`` times a read-only kernel shaped like the decode engines' weight stream (every warp
reads its own run of ``--run`` bytes through a ring of ``--stages`` shared-memory stages of ``--chunk`` bytes, copied
with cp.async, four warps a block) over the bytes a bench shape's layer reads at T tokens (the experts that uniform
routing is expected to hit, their packed codes, scales, input and output: the bytes floor of ``bench run``), or over
``--bytes`` given directly. Each sample is one launch timed with CUDA events, the L2 flushed before it; the median is
printed next to the bytes at the copy rate of a 1 GiB device-to-device copy, so short reads show what ramp-up and
tail cost: on an H100, qwen3-30b-a3b's 19.5 MB at 1 token took 13.4 µs (1.45 TB/s), 1 GB 322.8 µs (3.1 TB/s)
(docs/performance.md, "Floors").

The kernel XORs every 32-bit word it read into a checksum, which is compared with the host's before anything is
printed: a read that skipped bytes is an error, not a fast number.

  python -m qmoe_rtc bench stream --preset qwen3-30b-a3b,mixtral-8x7b --tokens 1,8,64
  python -m qmoe_rtc bench stream --bytes 19e6,176e6,1e9
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence

from ..errors import DeviceError, QMoEInputError
from ..kernels.engine_choice import expected_experts
from .report import BENCH_SHAPES, expert_bytes

__all__ = ["RUN_BYTES", "StreamRead", "check_geometry", "layer_bytes", "main"]

CHUNK_BYTES = 2048  # a stage of one warp's ring: 4 cp.async of 16 bytes a lane
STAGES = 4
RUN_BYTES = 16 << 10  # bytes one warp reads (the decode FC1 warps' run at mixtral-8x7b's 1 token)
WARPS = 4

_SRC = r"""
// One warp a run of `run` bytes from src + (global warp) * run, through a ring of STAGES stages of CHUNK bytes in
// shared memory (cp.async, 16 bytes a lane); every word read is XORed into the grid's checksum.
extern "C" __global__ void __launch_bounds__(128) qmoe_stream_read(const unsigned char* __restrict__ src,
                                                                   long long run, unsigned int* __restrict__ sum) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned char* base = src + ((long long)blockIdx.x * 4 + warp) * run;
  unsigned char* ring = smem + warp * STAGES * CHUNK;
  const unsigned ring0 = (unsigned)__cvta_generic_to_shared(ring);
  const int chunks = (int)(run / CHUNK);
  auto issue = [&](int c) {
    if (c < chunks) {
#pragma unroll
      for (int p = 0; p < CHUNK / 512; ++p) {
        const int off = p * 512 + lane * 16;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(ring0 + (c % STAGES) * CHUNK + off),
                     "l"(base + (long long)c * CHUNK + off));
      }
    }
    asm volatile("cp.async.commit_group;");
  };
  for (int i = 0; i < STAGES - 1; ++i) issue(i);
  unsigned acc = 0;
  for (int c = 0; c < chunks; ++c) {
    asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2));  // chunk c has landed (this lane's copies)
    issue(c + STAGES - 1);
#pragma unroll
    for (int p = 0; p < CHUNK / 512; ++p) {
      const uint4 v = *reinterpret_cast<const uint4*>(ring + (c % STAGES) * CHUNK + p * 512 + lane * 16);
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    __syncwarp();  // every lane has read slot c % STAGES before a later issue() refills it
  }
  atomicXor(sum, acc);
}
"""


def layer_bytes(shape, T: int, bits: int = 4, act_itemsize: int = 2) -> int:
    """The bytes floor of ``bench run`` for a bench shape's layer at T tokens, with the experts uniform routing is
    expected to hit (the engine choice's :func:`~qmoe_rtc.kernels.engine_choice.expected_experts`, rounded): their
    packed codes and scales (the shape's block size, activation-dtype scales, no zero points), the input and output
    rows and the float32 logits."""
    per_expert = expert_bytes(shape.H, shape.I, (bits, bits), shape.block_size, False, act_itemsize)
    hit = round(expected_experts(T, shape.E, shape.k))
    return hit * per_expert + 2 * T * shape.H * act_itemsize + T * shape.E * 4


class StreamRead:
    """The read kernel on the current device (compiled by CuPy's NVRTC on first use)."""

    def __init__(self, cp, chunk: int = CHUNK_BYTES, stages: int = STAGES, run: int = RUN_BYTES):
        check_geometry(chunk, stages, run)
        self.cp, self.run, self.smem = cp, run, WARPS * stages * chunk
        mod = cp.RawModule(code=_SRC, options=(f"-DSTAGES={stages}", f"-DCHUNK={chunk}", "-std=c++17"))
        self.kernel = mod.get_function("qmoe_stream_read")
        self.kernel.max_dynamic_shared_size_bytes = self.smem
        self.sum = cp.zeros(1, dtype=cp.uint32)

    def blocks(self, nbytes: int) -> int:
        """Blocks that read at least ``nbytes`` (whole runs of four warps)."""
        return -(-nbytes // (WARPS * self.run))

    def __call__(self, src, blocks: int) -> None:
        self.kernel((blocks,), (32 * WARPS,), (src, self.cp.int64(self.run), self.sum), shared_mem=self.smem)


def check_geometry(chunk: int, stages: int, run: int) -> None:
    """Refuse a ring the kernel cannot run: :class:`QMoEInputError` naming the value."""
    if chunk <= 0 or chunk % 512:
        raise QMoEInputError("chunk", "a positive multiple of 512 bytes (a warp's 16-byte copies)", str(chunk))
    if not 2 <= stages <= 16:
        raise QMoEInputError("stages", "2..16", str(stages))
    if WARPS * stages * chunk > 96 << 10:
        raise QMoEInputError("stages", f"at most {(96 << 10) // (WARPS * chunk)} with chunk {chunk} (96 KiB a block)",
                             str(stages))
    if run <= 0 or run % chunk:
        raise QMoEInputError("run", f"a positive multiple of chunk ({chunk})", str(run))


def _byte_list(text: str) -> list[int]:
    try:
        out = [int(float(v)) for v in text.split(",") if v.strip()]
    except ValueError:
        raise QMoEInputError("bytes", "comma-separated byte counts (1e9 allowed)", repr(text)) from None
    if not out or min(out) <= 0:
        raise QMoEInputError("bytes", "positive byte counts", repr(text))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m qmoe_rtc bench stream", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-30b-a3b,mixtral-8x7b,gpt-oss-120b,ort-2048",
                   help=f"bench shapes, comma-separated ({', '.join(BENCH_SHAPES)})")
    p.add_argument("--tokens", default="1,8,64", help="tokens a call, comma-separated (with --preset)")
    p.add_argument("--bytes", help="byte counts to read instead of the shapes' (e.g. 19e6,1e9)")
    p.add_argument("--chunk", type=int, default=CHUNK_BYTES, help="bytes a stage of a warp's ring")
    p.add_argument("--stages", type=int, default=STAGES, help="stages of a warp's ring")
    p.add_argument("--run", type=int, default=RUN_BYTES, help="bytes one warp reads")
    p.add_argument("--iters", type=int, default=20, help="timed samples (median printed)")
    return p


def _points(args) -> list[tuple[str, int]]:
    if args.bytes:
        return [(f"{n / 1e6:.1f} MB", n) for n in _byte_list(args.bytes)]
    names = [s for s in args.preset.split(",") if s]
    unknown = [s for s in names if s not in BENCH_SHAPES]
    if unknown or not names:
        raise QMoEInputError("preset", f"bench shapes among {', '.join(BENCH_SHAPES)}", repr(args.preset))
    try:
        tokens = [int(t) for t in args.tokens.split(",") if t]
    except ValueError:
        raise QMoEInputError("tokens", "comma-separated integers", repr(args.tokens)) from None
    if not tokens or min(tokens) <= 0:
        raise QMoEInputError("tokens", "positive token counts", repr(args.tokens))
    return [(f"{n} T={T}", layer_bytes(BENCH_SHAPES[n], T)) for n in names for T in tokens]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:  # refused before the GPU is touched
        points = _points(args)
        check_geometry(args.chunk, args.stages, args.run)
    except QMoEInputError as exc:
        parser.error(str(exc))
    import cupy as cp
    import numpy as np

    from .run import COPY_BYTES, Timer, copy_rates

    reader = StreamRead(cp, args.chunk, args.stages, args.run)
    timer = Timer(cp)
    copy = copy_rates(cp, timer)["copy_GBps"]
    most = max(reader.blocks(n) for _, n in points) * WARPS * args.run
    src = cp.arange(most // 4, dtype=cp.uint32) * cp.uint32(2654435761)  # [words] distinct words, mod 2^32
    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()
    print(f"{name}: copy {copy:.0f} GB/s ({COPY_BYTES >> 20} MiB device to device, read + write bytes); read kernel: "
          f"{args.run >> 10} KiB a warp, {args.stages} stages of {args.chunk} B, L2 flushed, median of {args.iters}")
    print(f"{'point':<24} {'MB read':>9} {'copy-rate µs':>13} {'one launch µs':>14} {'GB/s':>7} {'of copy rate':>13}")
    for label, nbytes in points:
        blocks = reader.blocks(nbytes)
        read = blocks * WARPS * args.run
        reader.sum.fill(0)
        reader(src, blocks)
        want = int(np.bitwise_xor.reduce(src[: read // 4].get()))
        got = int(reader.sum.get()[0])
        if got != want:
            raise DeviceError(f"the read kernel's checksum {got:#010x} is not the host's {want:#010x} over {read} "
                              "bytes: it skipped or misread bytes")
        us = statistics.median(timer.samples_us(lambda b=blocks: reader(src, b), args.iters, 3))
        floor = read / (copy * 1e3)
        print(f"{label:<24} {read / 1e6:9.1f} {floor:13.1f} {us:14.1f} {read / us / 1e3:7.0f} {floor / us:12.0%}")
    return 0
