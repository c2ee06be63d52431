"""Which engine runs a call of 1 to 512 tokens, as data measured per device architecture.

Three tensor-core engines serve the decode range: decode-mma (one block per output tile and expert, the routes
scanned in the block), prefill-batched (the same weight stream over routes grouped by expert) and prefill-wgmma
(warpgroup MMA on 128-row weight tiles streamed by bulk copies). Which one is fastest depends on two numbers
the host knows before any launch:

- the **routes per expert hit**, expected under uniform routing (:func:`routes_per_expert`): a token picks k of
  the layer's ``logit_count`` experts, so T tokens hit ``E·(1 − (1 − k/L)^T)`` of the E held ones;
- the **packed bytes of one expert** (:func:`expert_code_bytes`): a large expert gives the wgmma engine enough
  weight tiles to fill the device even at one or two routes per expert.

:data:`MEASURED` holds the sweeps behind the rule (every engine forced at every token count, one process, graph
replay, L2 flushed, the peers' layer: bf16, int4, uniform codes, ``swiglu_fusion=2``); :data:`CROSSOVERS` holds
the rule's constants per arch, read off them; ``tests/kernels/test_engine_choice.py`` checks on the CPU that the rule picks,
at every measured point, an engine within 3 % of the fastest measured there (:data:`KNOWN_MISSES` names the one
exception and why it stays). An arch with no entry keeps the rule measured before (decode up to its tuning table's
``decode_rows`` tokens, wgmma from its ``wgmma_min_routes`` routes per expert: kernels/tuning/), which the sweeps
replaced on sm_90.
"""

from __future__ import annotations

from dataclasses import dataclass

from .arch import ArchSpec

__all__ = ["CROSSOVERS", "KNOWN_MISSES", "MEASURED", "MEASURED_SHAPES", "Crossovers", "crossovers", "decode_tokens",
           "expected_experts", "expert_code_bytes", "routes_per_expert", "wgmma_passed_for_batched"]


@dataclass(frozen=True)
class Crossovers:
    """The rule's constants for one arch (see the module docstring for what they compare).

    - ``decode_per_expert``: on experts of ``big_expert_bytes`` or more, the decode path runs while the expected
      routes per expert hit stay at or under this (then the wgmma engine);
    - ``decode_tokens_small``: on smaller experts the decode path runs up to this many tokens (then the batched
      engine);
    - ``big_expert_bytes``: from this many packed code bytes per expert the wgmma engine follows the decode path
      directly;
    - ``batched_per_expert``: below ``big_expert_bytes``, the batched engine runs up to this many routes per
      expert, the wgmma engine beyond;
    - ``source``: the measurement the numbers were read from;
    - ``x_ring_per_expert``: on experts of ``big_expert_bytes`` or more, calls the decode kernels serve with their
      x rings (the tuning table's ``x_ring_tokens`` tokens or fewer) take the decode path up to this
      many expected routes per expert (0: no further than ``decode_per_expert``).
    """

    decode_per_expert: float
    decode_tokens_small: int
    big_expert_bytes: int
    batched_per_expert: float
    source: str
    x_ring_per_expert: float = 0.0


#: Per arch ('sm_90' covers sm_90a), read off :data:`MEASURED` (``tests/kernels/test_engine_choice.py`` checks them):
#: - decode_per_expert 1.09: gpt-oss-120b at 6 tokens (1.08) decodes 1.7 % faster than wgmma, at 8 (1.11) wgmma is
#:   4 % faster (call 4); mixtral-8x7b at 2 tokens (1.14) wgmma 5 % faster than decode;
#: - decode_tokens_small 2: ort-2048 at 2 tokens decodes 9 % faster than batched, qwen3-30b-a3b at 2 within 2.1 % of
#:   the fastest; at 3 tokens ort ties and qwen3 runs batched 7 % faster (call 4);
#: - big_expert_bytes 9 MiB: experts of 6.3 MB (ort-2048) run batched up to 4 routes per expert 4 % faster than
#:   wgmma, experts of 12.4 MB (gpt-oss-120b) and 88 MB (mixtral-8x7b) run wgmma faster from 1.28 / 1.14 routes
#:   per expert (mixtral at 2 tokens: 145.3 µs against decode 156.8 and batched 149.0);
#: - batched_per_expert 4.5: ort-2048 at 16 tokens (4.04) batched 4 % ahead, qwen3-30b-a3b at 64 (4.07) a tie
#:   (0.8 %), both engines' next points (8.0 / 8.1 routes per expert) wgmma 15 % / 8 % ahead; nothing was
#:   measured between.
#: - x_ring_per_expert 1.2 (the decode kernels with x rings at 1-4 tokens): mixtral-8x7b at 2
#:   tokens (1.14) decodes 3.8 % faster than wgmma (142.2 µs against 147.8), at 3 (1.30) batched is 6 % faster
#:   than decode (201.8 against 214.0); nothing was measured between.
#: The one point measured off the rule by more than 3 %: mixtral-8x7b at 3 tokens (call 4: batched 202.6 µs, wgmma
#: 226.2, decode 225.1; with the x rings: batched 201.8, wgmma 225.4), where the rule runs wgmma (:data:`KNOWN_MISSES`).
CROSSOVERS: dict[str, Crossovers] = {
    "sm_90": Crossovers(decode_per_expert=1.09, decode_tokens_small=2, big_expert_bytes=9 << 20,
                        batched_per_expert=4.5, x_ring_per_expert=1.2,
                        source="H100 80GB HBM3 sweeps of 2026-12-06: docs/perf-data/2026-12-06-s35-call{2,4}-*, "
                               "docs/perf-data/2026-12-06-s36-call2-*"),
}

#: The sweeps behind :data:`CROSSOVERS` per arch: {bench shape: {tokens: (decode-mma, prefill-batched, prefill-wgmma)
#: µs}}, each sweep one process, oldest first; None where the decode engine cannot run (more than 512 routes). A
#: point measured again is judged by its newest sweep (an engine changed in between: the decode kernels' x rings at
#: 1-4 tokens). Shapes as in the benchmark (``qmoe_rtc.bench.report.BENCH_SHAPES``): (H, I, E, k, block size).
MEASURED_SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8, 128), "mixtral-8x7b": (4096, 14336, 8, 2, 128),
                   "gpt-oss-120b": (2880, 2880, 128, 4, 32), "ort-2048": (2048, 2048, 8, 2, 128)}
MEASURED: dict[str, tuple[dict[str, dict[int, tuple]], ...]] = {
    "sm_90": (
        # call 2: 1-512 tokens, 2 rounds of 20 samples (docs/perf-data/2026-12-06-s35-call2-sweep-*)
        {"qwen3-30b-a3b": {1: (30.0, 36.0, 39.4), 2: (44.4, 44.0, 43.7), 4: (62.3, 58.5, 65.6), 8: (101.8, 89.3, 96.3),
                           16: (156.9, 116.9, 123.0), 32: (307.4, 145.8, 155.8), 64: (425.9, 167.2, 165.9),
                           128: (None, 187.3, 172.0), 256: (None, 280.1, 183.2), 512: (None, 434.1, 225.9)},
         "mixtral-8x7b": {1: (109.8, 135.4, 137.4), 2: (156.8, 149.0, 145.3), 4: (271.0, 261.8, 249.5),
                          8: (330.0, 290.4, 265.8), 16: (467.2, 312.1, 293.7), 32: (730.5, 343.0, 295.5),
                          64: (954.5, 517.7, 310.0), 128: (1789.8, 797.1, 379.5), 256: (3419.7, 1410.6, 557.2),
                          512: (None, 2537.6, 779.3)},
         "gpt-oss-120b": {1: (51.5, 85.2, 64.1), 2: (78.0, 91.6, 84.5), 4: (121.7, 129.5, 130.2),
                          8: (185.2, 186.4, 186.2), 16: (364.6, 308.9, 305.5), 32: (789.3, 482.1, 467.5),
                          64: (1144.6, 635.4, 605.8), 128: (1507.8, 741.9, 684.9), 256: (None, 966.0, 711.8),
                          512: (None, 1439.3, 741.9)},
         "ort-2048": {1: (24.4, 27.6, 41.2), 2: (31.6, 34.6, 42.8), 4: (44.1, 40.4, 45.1), 8: (51.9, 46.1, 48.5),
                      16: (72.9, 46.7, 48.6), 32: (134.8, 57.4, 49.0), 64: (189.5, 74.6, 50.4), 128: (373.2, 111.2, 58.9),
                      256: (695.9, 160.9, 77.9), 512: (None, 273.6, 108.4)}},
        # call 4: 1-8 tokens, 4 rounds of 20 samples (docs/perf-data/2026-12-06-s35-call4-ab-*)
        {"qwen3-30b-a3b": {1: (30.1, 35.8, 39.4), 2: (44.0, 44.0, 43.1), 3: (56.0, 52.1, 53.8), 4: (69.2, 62.0, 66.3),
                           6: (82.1, 74.6, 77.9), 8: (90.1, 81.1, 88.2)},
         "mixtral-8x7b": {1: (110.0, 134.8, 138.2), 2: (156.4, 150.8, 148.5), 3: (225.1, 202.6, 226.2),
                          4: (266.8, 256.3, 249.1), 6: (319.5, 295.3, 266.9), 8: (295.8, 268.4, 250.1)},
         "gpt-oss-120b": {1: (51.5, 85.5, 66.5), 2: (78.7, 90.2, 86.1), 3: (106.2, 116.0, 116.9), 4: (117.6, 127.2, 122.1),
                          6: (163.6, 169.1, 166.4), 8: (177.5, 178.2, 169.7)},
         "ort-2048": {1: (24.1, 27.5, 41.2), 2: (31.4, 34.4, 42.4), 3: (37.8, 37.8, 43.8), 4: (44.0, 41.2, 45.4),
                      6: (45.8, 40.9, 44.8), 8: (53.8, 45.8, 48.0)}},
        # 1-4 tokens with the decode kernels' x rings, 2 rounds of 10 samples
        # (docs/perf-data/2026-12-06-s36-call2-crossover.txt)
        {"qwen3-30b-a3b": {1: (28.6, 36.0, 39.3), 2: (43.7, 44.4, 43.2), 3: (57.4, 52.4, 53.9), 4: (64.7, 62.3, 66.5)},
         "mixtral-8x7b": {1: (100.8, 135.0, 138.0), 2: (142.2, 150.4, 147.8), 3: (214.0, 201.8, 225.4),
                          4: (259.7, 252.6, 249.8)},
         "gpt-oss-120b": {1: (50.7, 85.1, 63.9), 2: (78.4, 90.7, 85.7), 3: (103.6, 117.0, 115.3), 4: (117.6, 127.0, 123.5)},
         "ort-2048": {1: (24.2, 27.6, 41.2), 2: (29.7, 34.3, 42.6), 3: (42.7, 37.9, 43.6), 4: (42.5, 41.2, 45.0)}},
    ),
}
#: Measured points where the rule's engine is more than 3 % slower than the fastest, and why they stay.
KNOWN_MISSES: dict[tuple[str, str, int], str] = {
    ("sm_90", "mixtral-8x7b", 3): "batched 10 % faster than wgmma at 3 tokens only (2 and 4 tokens: wgmma ahead); "
                                  "one call, the rule left as the neighbours measure it",
}


def crossovers(arch: str) -> Crossovers | None:
    """The measured constants of ``arch`` ('sm_90a' reads 'sm_90'), None where none were measured."""
    return CROSSOVERS.get(ArchSpec(arch).family)


def expected_experts(rows: int, E: int, k: int, logit_count: int = 0) -> float:
    """Experts of the E held ones that ``rows`` tokens hit on average under uniform routing, each token picking k
    of ``logit_count`` (default E; an expert slice holds E of them)."""
    L = logit_count or E
    return E * (1.0 - (1.0 - min(k, L) / L) ** max(0, rows))


def routes_per_expert(rows: int, E: int, k: int, logit_count: int = 0, shared: int = 0) -> float:
    """Expected routes per expert hit: the routes that reach held experts (k·E/L a token, plus the S shared
    experts, which every token hits) over the experts hit."""
    L = logit_count or E
    routes = rows * (k * E / L + shared)
    hit = expected_experts(rows, E, k, L) + (shared if rows else 0)
    return routes / hit if hit > 0 else 0.0


def expert_code_bytes(H: int, I: int, layout) -> int:  # noqa: E741
    """Packed code bytes of one routed expert: FC1 (2·I rows with a fused gate), FC2, FC3 where present."""
    rows1 = (2 if layout.swiglu_fusion else 1) * I
    n = rows1 * H * layout.fc1_bits + H * I * layout.fc2_bits
    if layout.has_fc3:
        n += I * H * layout.fc3_bits
    return n // 8


def decode_tokens(config, arch: str, grouped_runs: bool) -> int | None:
    """Tokens up to which a tensor-core layer takes the decode path on ``arch``: on experts of ``big_expert_bytes``
    or more while the expected routes per expert stay at or under ``decode_per_expert`` (``x_ring_per_expert`` where
    the decode kernels' x rings serve the call), else up to
    ``decode_tokens_small`` tokens. None where nothing was measured: an arch without constants, or a layer the
    grouped engines the rule hands over to (wgmma, batched) do not run (``grouped_runs`` False: more experts than
    the grouping takes), which keeps the rule before."""
    c = crossovers(arch)
    if c is None or not grouped_runs:
        return None
    L = config.all_experts or config.experts
    if expert_code_bytes(config.hidden, config.inter, config.layout) < c.big_expert_bytes:
        return c.decode_tokens_small
    from .mma_decode import x_ring

    x_tokens = ArchSpec(arch).tuning.x_ring_tokens if x_ring(config) else 0  # calls the decode kernels serve with x rings

    def decodes(rows: int) -> bool:
        rpe = routes_per_expert(rows, config.experts, config.k, L, config.shared)
        return rpe <= c.decode_per_expert or (rows <= x_tokens and rpe <= c.x_ring_per_expert)

    rows = 1
    while rows < 512 and decodes(rows + 1):
        rows += 1
    return rows


def wgmma_passed_for_batched(problem, layout) -> str | None:
    """Why the batched engine beats the wgmma engine at ``problem`` on its arch (the reason a choice prints), None
    where wgmma is the faster or the arch has no measured constants."""
    c = crossovers(problem.arch)
    if c is None:
        return None
    size = expert_code_bytes(problem.H, problem.I, layout)
    rpe = routes_per_expert(problem.rows, problem.E, problem.k, problem.logit_count, problem.shared)
    if size < c.big_expert_bytes and rpe <= c.batched_per_expert:
        return (f"{rpe:.1f} routes per expert on experts of {size / 1e6:.1f} MB (at most {c.batched_per_expert} on "
                f"experts under {c.big_expert_bytes >> 20} MiB: the batched engine is faster on {problem.arch}, "
                "kernels/engine_choice.py)")
    return None
