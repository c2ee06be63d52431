"""Measured choices per device architecture, as data: one table per arch (``kernels/tuning/sm_90.py`` ...), read
through the call's :class:`~qmoe_rtc.kernels.arch.ArchSpec` (``problem.device.tuning``) when a plan is made.

A table (:class:`Tuning`) holds the thresholds the engines' launch rules and the engine choice compare with
(routes per expert, rounds of blocks, token counts ...), each measured on that arch (the table's module says where).
An arch with no table of its own takes the table named ``default`` (``kernels/tuning/default.py``: the values
measured on sm_90), with one WARNING per arch saying so; an unknown device (the warm tool, CPU tests: target '')
takes it silently. Which engine runs a call of 1 to 512 tokens is data too, in ``kernels/engine_choice.py``.

A new arch gets its table as a module ``kernels/tuning/sm_XY.py`` defining ``TABLE`` (a :class:`Tuning` named
after its family); ``python -m qmoe_rtc bench ab ... --write-table FILE`` writes the fastest setting of each knob
it measured in the table's form (docs/runtime-compilation.md, "A new GPU").
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
from dataclasses import dataclass

from ..arch import ArchSpec

__all__ = ["ARCH_KNOBS", "DEFAULT_TABLE", "Tuning", "knob", "table", "table_name"]

log = logging.getLogger("qmoe_rtc")

#: The table an arch without its own takes (kernels/tuning/default.py).
DEFAULT_TABLE = "default"
#: Tuning knobs whose defaults are measured choices read at plan time, where the call's arch is known: every table
#: gives each a value (:attr:`Tuning.knobs`). The knobs read when a module spec is built from a layer (ring depths,
#: register budgets, warpgroups, the x rings, the expert flow ...) know no arch and keep the knob table's portable
#: default; so do the operational ones.
ARCH_KNOBS = ("mma_one_wave", "mma_deep_split", "prefill_wg_overlap")


@dataclass(frozen=True)
class Tuning:
    """One arch's measured thresholds (the fields' meaning; the values and their measurements: the table modules).

    Path switch (kernels/pipelines.py decode_limit): ``decode_rows`` tokens up to which tensor-core layers decode
    where no crossover was measured; ``simt_decode_rows`` / ``simt_decode_rows_big`` those of layers only the SIMT
    engines run, the second on experts of ``simt_big_expert_bytes`` or more.
    Decode engine (kernels/mma_decode.py): ``x_ring_tokens`` (calls of up to this many tokens run the x-ring
    kernels), ``target_warps_per_sm``, ``one_wave_chunks``, ``deep_chunks`` (the K split's rules).
    Batched engine (kernels/mma_batched.py): ``batched_max_routes`` / ``batched_max_routes_many`` (routes per expert
    up to which it runs, by row tiles per warp, for calls whose routes reach up to ``batched_few_experts`` experts /
    more).
    mma.sync prefill (kernels/mma_prefill.py): ``mma_tile16_routes`` / ``mma_tile32_routes`` (routes per expert up
    to which a call takes 16- / 32-route tiles).
    wgmma prefill (kernels/wgmma_prefill.py, wgmma_geometry.py): ``wgmma_min_routes`` (routes per expert it runs
    from where no crossover was measured), ``wgmma_narrow_routes`` / ``wgmma_tile64_routes`` /
    ``wgmma_tile128_routes`` (routes per expert up to which a call takes 32- / 64- / 128-route tiles),
    ``wgmma_third_block_rounds`` (rounds of two FC1 blocks an SM from which a third starts), ``wgmma_pair_min_fc1_tiles``
    (FC1 weight tiles a route tile from which 128-route tiles run as pairs), ``wgmma_fc2_split_rounds`` /
    ``wgmma_fc2_split_chunks`` (FC2 may split K in halves up to that many rounds of tiles, from that many chunks of K),
    ``wgmma_fc2_part_rounds`` / ``wgmma_fc2_part_chunks`` / ``wgmma_fc2_part_bytes`` (FC2 runs K in as many parts as
    the call's expected tiles fit whole in that many rounds, each of at least that many chunks, their planes' traffic
    within that share of FC2's codes; 0 rounds: never; wgmma_geometry.fc2_parts).
    ``knobs``: the defaults of the tuning knobs :data:`ARCH_KNOBS` measured on the arch (name -> value; the knob
    table keeps each one's portable default and its doc, ``QMOE_RTC_TUNE`` overrides either: :func:`knob`).
    """

    name: str
    measured_on: str  # the device(s) the values were measured on
    decode_rows: int
    simt_decode_rows: int
    simt_decode_rows_big: int
    simt_big_expert_bytes: int
    x_ring_tokens: int
    target_warps_per_sm: int
    one_wave_chunks: int
    deep_chunks: int
    batched_max_routes: dict[int, int]
    batched_max_routes_many: dict[int, int]
    batched_few_experts: int
    mma_tile16_routes: int
    mma_tile32_routes: int
    wgmma_min_routes: int
    wgmma_narrow_routes: int
    wgmma_tile64_routes: int
    wgmma_tile128_routes: int
    wgmma_third_block_rounds: int
    wgmma_pair_min_fc1_tiles: int
    wgmma_fc2_split_rounds: int
    wgmma_fc2_split_chunks: int
    wgmma_fc2_part_rounds: float
    wgmma_fc2_part_chunks: int
    wgmma_fc2_part_bytes: float
    knobs: dict[str, object]

    def __hash__(self) -> int:  # its dicts are data, never mutated: one table per name
        return hash(self.name)

    def __post_init__(self) -> None:
        from ...errors import QMoEUnsupportedError
        from ...settings.knob_table import KNOBS

        missing = [n for n in ARCH_KNOBS if n not in self.knobs]
        other = [n for n in self.knobs if n not in ARCH_KNOBS]
        if missing or other:
            raise QMoEUnsupportedError(f"tuning table {self.name!r}: knobs must give each of {list(ARCH_KNOBS)} "
                                       f"(missing {missing}; not arch knobs: {other})")
        for n, v in self.knobs.items():
            KNOBS[n].coerce(v)  # a value the knob takes (KnobError otherwise)


def table_name(device: ArchSpec) -> str:
    """The name of the table ``device`` reads: its family's where ``kernels/tuning/<family>.py`` exists, else
    :data:`DEFAULT_TABLE`."""
    return _name(device.family)


@functools.lru_cache(maxsize=32)
def _name(family: str) -> str:
    if family and family != DEFAULT_TABLE and importlib.util.find_spec(f"{__name__}.{family}") is not None:
        return family
    return DEFAULT_TABLE


@functools.lru_cache(maxsize=32)
def _for_family(family: str) -> Tuning:
    name = _name(family)
    tab = importlib.import_module(f"{__name__}.{name}").TABLE
    if name == DEFAULT_TABLE and family:  # once per arch (cached)
        log.warning("qmoe_rtc: no tuning table for %s: its thresholds and measured knob defaults are the %r table's, "
                    "measured on %s (qmoe_rtc/kernels/tuning/; `python -m qmoe_rtc bench ab --write-table` measures "
                    "one)", family, DEFAULT_TABLE, tab.measured_on)
    return tab


def table(device: ArchSpec) -> Tuning:
    """The tuning table of ``device`` (one WARNING per arch that has none: see the module docstring)."""
    return _for_family(device.family)


def knob(name: str, device: ArchSpec):
    """Tuning knob ``name`` (one of :data:`ARCH_KNOBS`) for a call on ``device``: as set (``QMOE_RTC_TUNE``, a
    scope), else its arch table's measured default."""
    from ...settings import knobs

    return knobs.get(name, table(device).knobs[name])
