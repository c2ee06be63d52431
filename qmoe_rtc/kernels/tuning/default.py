"""The tuning table of an arch without its own (kernels/tuning/__init__.py): the values measured on sm_90
(kernels/tuning/sm_90.py, where each value's measurement is), under its own name."""

from __future__ import annotations

from dataclasses import replace

from .sm_90 import TABLE as SM_90

TABLE = replace(SM_90, name="default")
