"""The tuning table of sm_90 (H100, H200; sm_90a): each value with the measurement behind it (docs/performance-log.md,
raw outputs in docs/perf-data). The fields' meaning: :class:`~qmoe_rtc.kernels.tuning.Tuning`."""

from __future__ import annotations

from . import Tuning

TABLE = Tuning(
    name="sm_90",
    measured_on="sm_90 (H200 141GB, H100 80GB HBM3)",
    # Tensor-core layers decode up to 4 tokens where no crossover was measured (kernels/engine_choice.py has sm_90's):
    # H200, before the sweep: at 1 token the decode engine faster than the batched-decode engine, at 8 slower on every
    # shape.
    decode_rows=4,
    # Layers only the SIMT engines run decode up to 8 tokens, 16 on experts of 32 MB or more (H200, "Decode / prefill
    # crossover").
    simt_decode_rows=8,
    simt_decode_rows_big=16,
    simt_big_expert_bytes=32 << 20,
    # x rings at 1-4 tokens took 3-9 % off mixtral-8x7b, qwen3-30b-a3b and ort-2048 (mixtral 1 token 108.9 -> 101.5
    # us), gpt-oss-120b within 1-3 %; at 8 tokens (48 KiB more a block) they cost 24-40 % (H100).
    x_ring_tokens=4,
    # The decode K split aims at ~24 warps in flight per SM (H200, a sweep of mma_target_warps).
    target_warps_per_sm=24,
    # One wave instead of a sliver more while each warp keeps at most 8 chunks: qwen3-30b-a3b FC1 at 1 token 34.4 ->
    # 31.1 us; halving where the half spills or runs longer chunks lost (gpt-oss-120b 56.5 -> 57.9 / 65.8) (H200).
    one_wave_chunks=8,
    # The deep-K rule splits twice as deep where every warp keeps 16 chunks: mixtral-8x7b FC1 at 1 token 126.1 ->
    # 121.6 us, its FC2 at 8 tokens 375.2 -> 366.6; short-K grids measured slower split deeper (ort-2048 FC1 at 8
    # tokens +2.2 %, qwen3-30b-a3b FC1 at 8 tokens +3.4 %) (H200).
    deep_chunks=16,
    # The batched engine up to 12 / 16 routes per expert (one / two row tiles) where the routes reach at most 32
    # experts, 6 / 8 beyond (H200, bf16 int4). One row tile: at 8 routes per expert it beat the tile engines on
    # mixtral-8x7b (469 us vs mma.sync 551) and ort-2048 (52.7 vs 64.2), lost on qwen3-30b-a3b (223 vs 214) and
    # gpt-oss-120b (990 vs 914); at 16 the tile engines won on every shape (7-16 %). Two row tiles: at 16 mixtral
    # 592.5 vs wgmma 649.6, ort-2048 76.6 vs 74.0; at 8 qwen3 186.6 vs mma.sync 191.4; at 32 (mixtral, ort) and 16
    # (qwen3) the tile engines won by 8-51 %.
    batched_max_routes={1: 12, 2: 16},
    batched_max_routes_many={1: 6, 2: 8},
    batched_few_experts=32,
    # mma.sync prefill: 16-route tiles up to 16 routes per expert, 32 up to 40, then 64: the smallest tile the average
    # expert fills (the rule the engine was tuned with on the H200; no sweep of the bounds is recorded).
    mma_tile16_routes=16,
    mma_tile32_routes=40,
    # The wgmma engine from 8 routes per expert where no crossover was measured (H200, 32-route tiles, bf16 int4): at 8
    # faster on every shape (qwen3-30b-a3b 0.96x, mixtral-8x7b 0.92x, gpt-oss-120b 0.93x, ort-2048 0.86x), at 4
    # slower on three (1.10-1.15x; gpt-oss 0.98x).
    wgmma_min_routes=8,
    # 32-route tiles up to 20 routes per expert: at 16 an expert holds more than 32 routes about once in 10^4 under
    # even routing, and a second tile re-reads its weights; gpt-oss-120b at 512 tokens (16 routes an expert) -1.9 %
    # against 64-route tiles, -5.8 % with four stages (H200).
    wgmma_narrow_routes=20,
    # 64-route tiles up to 96 routes per expert, 128 up to 320, then 256 where the module has them (the rule the
    # engine was tuned with on the H200; no sweep of the bounds is recorded).
    wgmma_tile64_routes=96,
    wgmma_tile128_routes=320,
    # FC1's third block at 32-route tiles from 4 rounds of two blocks an SM: 4-5 % faster on gpt-oss-120b,
    # qwen3-30b-a3b and mixtral-8x7b at 8-16 routes per expert, 11 % slower on ort-2048's one round (H200).
    wgmma_third_block_rounds=4,
    # 128-route tiles as pairs from 32 FC1 weight tiles a route tile (H200, 4096 tokens, against single blocks):
    # mixtral-8x7b (112 tiles) -6.7 / -5.7 %; gpt-oss-120b (23) -0.3 / +2.6 % and ort-2048 (16) -0.4 / -0.7 %,
    # within noise; qwen3-30b-a3b (6) +6 %; mixtral at 512 tokens, where FC2 splits K, +2.8 %.
    wgmma_pair_min_fc1_tiles=32,
    # FC2 splits K up to 2 rounds of tiles (past two the device's rule never splits: mixtral-8x7b at 512 tokens, 1.45
    # rounds, -7.8 %; at 1024, 2.4 rounds, +1.3 %) and from 32 chunks of K (ort-2048, 16 chunks, at 1024 / 2048
    # tokens: +3 % / +10 %) (H200).
    wgmma_fc2_split_rounds=2,
    wgmma_fc2_split_chunks=32,
    # FC2's K in as many parts as the expected tiles fit whole in 1.4 rounds, parts of at least 8 chunks, the planes'
    # traffic within a quarter of FC2's codes (ort-2048 at 64 tokens: an eighth; at 512 as much as the codes). H100,
    # bench ab, parts forced, µs: mixtral-8x7b at 4 tokens (0.66 rounds) none / 2 / 3 / 4 / 6 / 8 parts 250.2 / 237.8 /
    # 245.5 / 240.6 / 247.1 / 254.6; at 8 tokens (0.87 rounds) 268.7 / 272.1 / 275.2 / 272.1 / 278.5 / 284.8, at 16 and
    # 64 none the fastest as well (2 parts +0.8 to +1.1 %); ort-2048 at 32 / 64 tokens (0.48 rounds) none / 2 / 4 48.8 /
    # 45.9 / 51.1 and 51.1 / 46.7 / 52.3; gpt-oss-120b at 8 tokens (2.4 rounds) 188.5 / 186.2 with 2, at 16-64 tokens
    # 2 parts +0.4 to +3.6 %.
    wgmma_fc2_part_rounds=1.4,
    wgmma_fc2_part_chunks=8,
    wgmma_fc2_part_bytes=0.25,
    knobs={
        # the decode K split's one-wave rule: qwen3-30b-a3b at 1 token 34.4 -> 31.1 us (H200; one_wave_chunks above)
        "mma_one_wave": True,
        # its deep-K rule: mixtral-8x7b FC1 at 1 token 126.1 -> 121.6 us, FC2 at 8 tokens 375.2 -> 366.6 (H200)
        "mma_deep_split": True,
        # the wgmma steps after the routing launched overlapping the one before: ort-2048 at 512 tokens 112.5 -> 108.9
        # us (-3.2 %), -0.5 to -3 % at the short layers (H200, against prefill_wg_overlap=0)
        "prefill_wg_overlap": True,
    },
)
