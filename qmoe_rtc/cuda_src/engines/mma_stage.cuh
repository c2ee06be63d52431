// engines/mma_stage.cuh: the shape of the tensor-core decode kernels' per-warp ring (engines/mma_ring.cuh): a
// block's warps and chunk, the host's decisions the device reads and only checks (stages, blocks an SM by route
// tile, each GEMM's ring bytes), and one stage's layout (MmaStage).
#pragma once

#include "core/lane_meta.cuh"
#include "core/types.cuh"

namespace qmoe {

inline constexpr int kMmaWarps = 4;
inline constexpr int kMmaThreads = 32 * kMmaWarps;
inline constexpr int kMmaMaxRoutes = 512;  // route ids a block scans (R = rows·k; the host refuses more)
inline constexpr int kMmaChunk = 128;      // codes of K per warp step (4 lanes × 32)
inline constexpr int kMmaPrefetchRoutes = 64;  // up to this many routes, blocks warm L2 before the route scan

// The host's decisions (kernels/mma_decode.py ring_decisions), which the device reads and only checks: the
// pipeline stages per warp (QMOE_MMA_STAGES, a define: the cp.async ring in dynamic shared memory), the blocks per
// SM each route tile's kernels set their registers for (QMOE_MMA_BLOCKS {BR, blocks} in the generated unit: more
// routes per pass need more accumulators), and the bytes of each GEMM's four rings (QMOE_MMA_FC1_RING,
// QMOE_MMA_FC2_RING), which its stage layout must give (mma_ring_is).
#if !defined(QMOE_MMA_STAGES) || !defined(QMOE_MMA_BLOCKS) || !defined(QMOE_MMA_FC1_RING) || !defined(QMOE_MMA_FC2_RING)
#error "QMOE_MMA_STAGES, QMOE_MMA_BLOCKS, QMOE_MMA_FC1_RING and QMOE_MMA_FC2_RING come from the host (kernels/mma_decode.py)"
#endif
inline constexpr int kMmaStages = QMOE_MMA_STAGES;
template <int BR> constexpr int mma_min_blocks() {
  constexpr int rows[][2] = {QMOE_MMA_BLOCKS};
  int n = 0;
  for (const auto& r : rows)
    if (r[0] == BR) n = r[1];
  return n;
}

// One stage of a warp's ring: KST chunks of its 2·RT lane rows (RT 16-row tiles), as copied (not decoded).
//   codes [KST][2·RT rows][32 lanes][4·B bytes]    (KST = 8/(B·RT), at least 1: 2 KiB of codes per stage,
//                                                  1.5 KiB for 3-bit, 2·RT KiB for 8-bit)
//   meta  [KST][2·RT rows][kWords][32 lanes] u32   the aligned words holding the lane's scale(s)
//                                                  and zero-point byte (decoded at compute time)
// Scale / zp words are the 4-byte-aligned words containing the element: they may reach up to 3
// bytes past a tensor's last element, inside the same allocation granule (CuPy / torch allocate in
// 512-byte units); those bytes are never used. The host sizes launches with the same layout (kernels/mma_decode.py
// ring_bytes; the kernels check its bytes: mma_ring_is).
template <int B, typename ScaleT, int BLOCK, bool ZPW, int RT = 1> struct MmaStage {
  static constexpr int KST = B >= 8 || 8 / B / RT < 1 ? 1 : 8 / B / RT;
  static constexpr int kRows = 2 * RT;  // lane rows a chunk holds
  static constexpr int NSB = MetaLayout<ScaleT, BLOCK, ZPW>::NSB;  // scale blocks per lane chunk
  static constexpr int kWords = MetaLayout<ScaleT, BLOCK, ZPW, B>::kWords;
  static constexpr int kCodeBytes = 4 * B;  // per lane, row, chunk
  static constexpr int kCodes = KST * kRows * 32 * kCodeBytes;
  static constexpr int kBytes = kCodes + KST * kRows * kWords * 32 * 4;
};

}  // namespace qmoe
