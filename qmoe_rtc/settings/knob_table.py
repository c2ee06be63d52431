"""Every knob of qmoe_rtc, declared: the :class:`Knob` type and :data:`KNOBS`, the table of operational knobs (each
its own ``QMOE_RTC_*`` variable) and tuning knobs (set through ``QMOE_RTC_TUNE``). Reading them is
:mod:`qmoe_rtc.settings.knobs`'s."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import KnobError

__all__ = ["KNOBS", "TUNE_ENV", "Knob"]

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})

#: The one variable of every tuning knob: ``name=value[,name=value]``.
TUNE_ENV = "QMOE_RTC_TUNE"


@dataclass(frozen=True)
class Knob:
    """One knob: ``name``, its own environment variable ``var`` (operational knobs) or None (a tuning knob, set in
    ``QMOE_RTC_TUNE``), value ``kind`` ('bool' | 'int' | 'path' | 'str'). Every int knob counts something, 0
    meaning the built-in choice: negative values are refused. ``allowed``, where given, is every value the knob
    accepts (a str knob's words; an int knob's values, 0 among them): anything else is refused when the knob is
    read, naming where it was set, the values it accepts and the value given
    (:class:`~qmoe_rtc.errors.KnobError`). Its consumer may refuse more where the value depends on the layer (e.g.
    a route tile one engine has and another has not)."""

    name: str
    var: str | None
    kind: str
    default: Any
    doc: str
    allowed: tuple | None = None

    @property
    def env(self) -> str:
        """Where a user sets it, as errors name it: its variable, or ``QMOE_RTC_TUNE[name]``."""
        return self.var or f"{TUNE_ENV}[{self.name}]"

    @property
    def tuning(self) -> bool:
        return self.var is None

    def accepts(self) -> str:
        """What the knob accepts, in words (the ``expected`` of its :class:`KnobError`)."""
        if self.kind == "bool":
            return "one of 1/0/true/false/yes/no/on/off"
        if self.allowed is not None:
            return f"one of {list(self.allowed)}" + (" (0: the built-in choice)" if self.kind == "int" else "")
        if self.kind == "int":
            return "an integer >= 0"
        return f"a {self.kind}"

    def _check(self, value: Any, given: str) -> Any:
        if (self.kind == "int" and value < 0) or (self.allowed is not None and value not in self.allowed):
            raise KnobError(self.env, self.accepts(), given)
        return value

    def parse(self, raw: str) -> Any:
        """The value of the environment variable's text ``raw``; :class:`KnobError` when the knob does not
        accept it."""
        if self.kind == "bool":
            v = raw.strip().lower()
            if v in _TRUE:
                return True
            if v in _FALSE:
                return False
            raise KnobError(self.env, self.accepts(), repr(raw))
        if self.kind == "int":
            try:
                n = int(raw.strip())
            except ValueError:
                raise KnobError(self.env, self.accepts(), repr(raw)) from None
            return self._check(n, repr(raw))
        if self.kind == "path":
            return Path(raw).expanduser() if raw.strip() else None
        return self._check(raw, repr(raw))

    def coerce(self, value: Any) -> Any:
        """Type-check an override value (a string is parsed like the environment variable) and refuse one
        the knob does not accept, as :meth:`parse` does."""
        if isinstance(value, str) and self.kind != "str":
            return self.parse(value)
        if value is None:
            return None
        if self.kind == "bool" and isinstance(value, bool):
            return value
        if self.kind == "int" and isinstance(value, int) and not isinstance(value, bool):
            return self._check(value, repr(value))
        if self.kind == "path" and isinstance(value, os.PathLike):
            return Path(value)
        if self.kind == "str" and isinstance(value, str):
            return self._check(value, repr(value))
        raise KnobError(self.name, f"a {self.kind}", f"{type(value).__name__} {value!r}")


#: The values of the knobs that take a few (0: the built-in choice), as their consumers accept them
#: (tests/settings/test_knobs.py checks these against the consumers' own constants).
_ON_OFF = ("auto", "on", "off")
_STAGES_2_6 = (0, 2, 3, 4, 5, 6)

KNOBS: dict[str, Knob] = {
    k.name: k
    for k in (
        Knob("cache_dir", "QMOE_RTC_CACHE_DIR", "path", None,
             "On-disk kernel cache directory (default: $XDG_CACHE_HOME/qmoe_rtc or ~/.cache/qmoe_rtc)."),
        Knob("no_disk_cache", "QMOE_RTC_NO_DISK_CACHE", "bool", False,
             "Memory-only mode: never read or write the on-disk cache."),
        Knob("strict", "QMOE_RTC_STRICT", "bool", False,
             "Strict mode: raise CacheMissError instead of compiling a module that is not on disk."),
        Knob("debug", "QMOE_RTC_DEBUG", "bool", False,
             "Log every compile (options, generated source, NVRTC log) at INFO instead of DEBUG."),
        Knob("dump", "QMOE_RTC_DUMP", "bool", False,
             "Write the generated .cu, the NVRTC log and a PTX listing next to each new cache entry "
             "(the entry itself is the raw .cubin: `cuobjdump -sass` it)."),
        Knob("lineinfo", "QMOE_RTC_LINEINFO", "bool", False,
             "Compile with -lineinfo (for profilers); changes the options, hence the cache key."),
        Knob("split_compile", None, "str", "all",
             "'all' (default): the NVVM optimiser and ptxas both work on a module's kernels in parallel "
             "(--split-compile=0 and -Xptxas --split-compile=0); 'ptxas': ptxas only (machine code as 'off'); "
             "'off': one thread. Cold, on the 16-core H200 host, an engine module took 0.9-1.7 s 'all', "
             "1.2-2.8 s 'ptxas', 1.5-4.1 s 'off'; 'all' changes some kernels' code, measured the same speed "
             "(docs/performance-log.md). In the options, hence the key.",
             allowed=("all", "ptxas", "off")),
        Knob("compile_parts", None, "bool", True,
             "Build each tensor-core module as several NVRTC programs, one per GEMM kernel and one for the rest, "
             "compiled side by side and loaded as one module (default 1): a cold module then takes about as long as "
             "its largest kernel. 0: one program a module. In the unit's parts, hence the key."),
        Knob("eager_graphs", "QMOE_RTC_EAGER_GRAPHS", "bool", True,
             "Launch an eager call's kernels as one CUDA graph (one driver launch per call instead of one per "
             "kernel; read when a layer is built). 0: plain launches."),
        Knob("pdl", "QMOE_RTC_PDL", "bool", True,
             "Programmatic dependent launch on sm_90+: a forward's kernels that declare it start while the previous "
             "one finishes (read when a plan is bound to its scratch). 0: every launch waits for the previous one."),
        Knob("jobs", "QMOE_RTC_JOBS", "int", 0,
             "Worker processes of the warm tool (0 = number of CPUs)."),
        Knob("mma_stages", None, "int", 0,
             "Tuning only: cp.async ring depth of the tensor-core decode kernels (0 = the built-in 3); "
             "a -D option, hence part of the cache key.",
             allowed=(0, 2, 3, 4, 5, 6, 7, 8)),
        Knob("mma_min_blocks", None, "int", 0,
             "Tuning only: resident blocks per SM the registers of the decode kernels for up to 8 tokens are set for "
             "(4..8, 0 = the built-in 5; with 3 stages at most 7 fit in shared memory); a -D option, hence part of "
             "the cache key.",
             allowed=(0, 4, 5, 6, 7, 8)),
        Knob("batched_stages", None, "int", 0,
             "Tuning only: cp.async ring depth of the batched-decode kernels (0 = kernels/mma_batched.py's: 3, 4 on "
             "layers of 64 experts or more); a -D option, hence part of the cache key.",
             allowed=(0, 2, 3, 4, 5, 6)),
        Knob("batched_min_blocks", None, "int", 0,
             "Tuning only: resident blocks per SM the registers of the batched-decode kernels at 8 routes a pass are "
             "set for (0 = kernels/mma_batched.py's: 5, 4 on layers of 64 experts or more); a -D option, hence part of "
             "the cache key.",
             allowed=(0, 4, 5, 6, 7, 8)),
        Knob("mma_expert_flow", None, "bool", True,
             "Tuning only: the decode FC2 blocks of an expert start when that expert's FC1 blocks have counted "
             "themselves done, instead of waiting for the whole FC1 grid (on: 1.6-3.2 % faster at 1 token on "
             "mixtral, gpt-oss, ort, +0.7 % qwen3; 8 tokens within 2 %); 0: the whole-grid wait; a -D "
             "option, hence part of the cache key."),
        Knob("mma_target_warps", None, "int", 0,
             "Tuning only: warps the decode K-split aims for (0 = 24 per SM of the device: 3168 on an H200)."),
        Knob("mma_one_wave", None, "bool", True,
             "Tuning only: the decode K-split's one-wave rule (kernels/mma_decode.py k_split); 0: the warp target alone. "
             "Unset: the arch's tuning table's (kernels/tuning/)."),
        Knob("mma_deep_split", None, "bool", True,
             "Tuning only: the decode K-split's deep-K rule (kernels/mma_decode.py k_split: a grid of one to two "
             "waves over a long K splits twice as deep); 0: without it. A launch scalar, not a code change. Unset: the "
             "arch's tuning table's (kernels/tuning/)."),
        Knob("mma_prefetch_chunks", None, "int", 0,
             "Tuning only: 128-code chunks of its rows a decode warp warms L2 with before the route scan (FC2: while "
             "FC1 finishes; 0 = the built-in 4); a launch scalar, not a code change."),
        Knob("mma_x_ring", None, "bool", True,
             "Tuning only: the decode module holds kernels that stage the activations in shared memory with the "
             "weights (engines/x_ring.cuh), run by calls of up to 4 tokens (kernels/mma_decode.py x_staged); 0: those "
             "calls run the kernels that load them from global memory as they compute; in the spec, hence the key."),
        Knob("prefill_stages", None, "int", 0,
             "Tuning only: cp.async pipeline depth of the tensor-core prefill kernels (0 = the built-in 3); "
             "a -D option, hence part of the cache key.",
             allowed=_STAGES_2_6),
        Knob("prefill_warps", None, "int", 0,
             "Tuning only: warps per prefill block, 4 or 8 (0 = the built-in); a -D option, part of the key.",
             allowed=(0, 4, 8)),
        Knob("prefill_min_blocks", None, "int", 0,
             "Tuning only: blocks per SM the prefill kernels' register budget is set for (1-4; 0 = the built-in); "
             "a -D option, part of the key.",
             allowed=(0, 1, 2, 3, 4)),
        Knob("prefill_group", None, "int", 0,
             "Tuning only: route tiles the prefill grid launches side by side per weight tile (0 = the built-in 8)."),
        Knob("prefill_fc2_split", None, "str", "auto",
             "Tuning (and tests) only: whether the wgmma prefill FC2 may split K in two over two blocks a tile ('on', "
             "'off'; 'auto' = up to a few rounds of tiles per SM). Where it may, the device splits when the halves "
             "fill the last round better.",
             allowed=_ON_OFF),
        Knob("prefill_fc2_parts", None, "int", 0,
             "Tuning (and tests) only: the parts the wgmma prefill FC2 runs K in, each part a block storing into its "
             "own plane of the per-route output, which the combine adds in order (0 = the arch's rule: few tiles a "
             "round; 1 = none; n = n parts, at most K's 128-value chunks).",
             allowed=tuple(range(9))),
        Knob("prefill_wg_overlap", None, "bool", True,
             "Tuning only: the wgmma prefill steps after the routing (grouping, permute, FC1, FC2, combine) launched "
             "overlapping the kernel before them (programmatic dependent launch, sm_90+, with QMOE_RTC_PDL on); 0: each "
             "waits for the one before. Unset: the arch's tuning table's (kernels/tuning/)."),
        Knob("prefill_route_tile", None, "int", 0,
             "Tuning only: force the prefill route tile (16, 32 or 64 routes for mma.sync, 32, 64, 128 or 256 for "
             "wgmma; 0 = chosen from the routes per expert).",
             allowed=(0, 16, 32, 64, 128, 256)),
        Knob("prefill_engine", None, "str", "auto",
             "Tuning only: 'batched' runs the batched-decode engine at every size, 'wgmma' the Hopper prefill "
             "engine at every size it supports, 'mma' the mma.sync tile engine (neither of the others); "
             "'auto' (default) picks by the routes per expert.",
             allowed=("auto", "batched", "wgmma", "mma")),
        Knob("batched_route_tile", None, "int", 0,
             "Tuning only: routes the batched-decode engine serves per pass over the weights (8, 16 or 32; "
             "0 = from the routes per expert).",
             allowed=(0, 8, 16, 32)),
        Knob("route_in_group", None, "str", "auto",
             "Tuning (and tests) only: whether a grouped engine's first launch routes the call itself and groups it "
             "in one block (routing/route_group.cuh; the wgmma engine's also permutes x), one launch instead of two "
             "or three: 'auto' for calls of up to 64 routes (kernels/route.py routes_in_group), 'on' wherever it can "
             "(softmax routing a warp a row, at most 2048 routes, no router GEMM, router weights or expert "
             "statistics), 'off' never.",
             allowed=_ON_OFF),
        Knob("route_in_decode", None, "str", "off",
             "Tuning (and tests) only: whether the tensor-core decode kernels route the call themselves, every block "
             "from the logits (engines/self_route.cuh), instead of a routing launch before them: 'auto' and 'on' for "
             "calls of up to 4 rows and 64 routes on layers routed a warp a row without a router GEMM, router weights "
             "or expert statistics (kernels/route.py routes_in_decode); 'off' (the default until its GPU tests and "
             "timings have run) never.",
             allowed=_ON_OFF),
        Knob("batched_x_block", None, "str", "auto",
             "Tuning (and tests) only: whether the batched-decode engine's blocks copy their routes' activations once "
             "into shared memory, where every warp reads them (engines/x_block.cuh): 'auto' where the blocks an SM its "
             "registers allow still fit beside them (kernels/mma_batched.py x_block), 'on' wherever a block fits, "
             "'off' never (each warp loads its own from global memory). A kernel choice per call.",
             allowed=_ON_OFF),
        Knob("batched_row_tiles", None, "int", 0,
             "Tuning only: 16-row tiles per warp of the batched-decode engine (1 or 2; 0 = 2 on tiled codes with "
             "a scale per 128-code chunk, else 1; contract codes take only 1); a -D option, part of the key.",
             allowed=(0, 1, 2)),
        Knob("prepack", "QMOE_RTC_PREPACK", "str", "auto",
             "The default of QMoE(prepack=...): 'auto' tiles the codes for the tensor-core engines when the layer's "
             "scales or biases say its activations are float16/bfloat16; 'on' always (float32 calls refused); 'off' "
             "keeps the contract layout (qmoe_rtc/tiled/transform.py).",
             allowed=_ON_OFF),
        Knob("prefill_wg_groups", None, "int", 0,
             "Tuning only: warpgroups per block of the wgmma prefill engine (2 or 4 for every route tile; 0 = by route "
             "tile and layout: 2 at 64 routes where two such blocks' rings fit an SM, else 4); a -D option, part of "
             "the key.",
             allowed=(0, 2, 4)),
        Knob("prefill_wg_stages", None, "int", 0,
             "Tuning only: most pipeline stages of the wgmma prefill engine (2-6, fewer when they do not fit; "
             "0 = the built-in 4); a -D option, part of the key.",
             allowed=_STAGES_2_6),
        Knob("prefill_wg_fc1_blocks", None, "int", 0,
             "Tuning only: blocks of the wgmma prefill engine's FC1 an SM holds at 32-route tiles (2; 3 with its "
             "registers set for three; 0 = a third block from four rounds of blocks where its registers allow, else "
             "2); a -D option, part of the key.",
             allowed=(0, 2, 3)),
        Knob("prefill_wg_inflight", None, "int", 0,
             "Tuning only: MMAs a warpgroup of the wgmma prefill engine keeps in flight (1 or 2; 0 = the built-in 1); "
             "a -D option, part of the key.",
             allowed=(0, 1, 2)),
        Knob("prefill_wg_ring", None, "int", 0,
             "Tuning only: the wgmma prefill engine's ring hand-off (1: a block barrier a chunk; 2: barriers with "
             "phases a stage, so warps drift apart; 0 = 2 where a block has 4 warpgroups, its SM alone, else 1); a -D "
             "option, part of the key.",
             allowed=(0, 1, 2)),
        Knob("prefill_wg_pairs", None, "str", "auto",
             "Tuning (and tests) only: whether the wgmma prefill engine runs its 128-route tiles of 4 warpgroups as "
             "pairs of blocks in a cluster, which copy the route tile once for both from a route-tile image ('on', "
             "'off'; 'auto' = from 32 FC1 weight tiles a route tile, where FC2 does not split K).",
             allowed=_ON_OFF),
        Knob("prefill_wg_shrink", None, "int", 0,
             "Tuning only: widths the MMAs of an expert's last route tile of the wgmma prefill engine shrink to "
             "(1: half the tile; 2: half or a quarter, at least 32 routes; 3: as 2, down to 16 routes in blocks of 2 "
             "warpgroups; 0 = the built-in 3). Each width is a copy of the main loop in the kernel (compile time); 1 "
             "measured up to 4 % slower, no faster to compile on the H200 host (docs/performance-log.md); "
             "2 measured 3.5 % slower at gpt-oss-120b 512 tokens than 3. A -D option, part of the key.",
             allowed=(0, 1, 2, 3)),
        Knob("decode_stamps", None, "bool", False,
             "Diagnostics only: the decode engine's two kernels record per block when each step of the chain began "
             "(core/stamps.cuh DecodeStamps; read by tools/stamps.py decode); a -D option, part of the key."),
        Knob("prefill_wg_stamps", None, "bool", False,
             "Diagnostics only: the one-block-per-tile wgmma prefill kernels record per block where their time goes "
             "(core/stamps.cuh; read by tools/stamps.py wgmma); a -D option, part of the key."),
    )
}
