"""Compile-only (NVRTC, no GPU): the FP8 activation quantizer's kernel (kernels/act_quant.py,
cuda_src/activations/quantize_fp8.cuh) for each activation dtype on sm_89 and sm_90, and its launch geometry."""

from __future__ import annotations

import pytest

from qmoe_rtc.errors import QMoEInputError
from qmoe_rtc.jit import get_cubins
from qmoe_rtc.kernels import get_family, spec_unit

from support.cubin_sections import text_sections


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("arch", ["sm_89", "sm_90"])
def test_the_kernel_compiles(cache, dtype, arch):
    spec = get_family("act_quant").spec_for(dtype)
    (mod,) = get_cubins(spec_unit(spec), arch)
    assert len(text_sections(mod.cubin)) == 1 and spec["dtype"] == dtype


def test_geometry_is_a_block_per_group_and_row():
    fam = get_family("act_quant")
    spec = fam.spec_for("bfloat16")
    assert fam.geometry(spec, rows=7, K=300, group=128).grid == (3, 7, 1)
    assert fam.geometry(spec, rows=7, K=300, group=0).grid == (1, 7, 1)
    assert fam.geometry(spec, rows=7, K=300, group=0).block == (256, 1, 1)
    assert fam.specs(None) == []  # no layer loads it yet
    with pytest.raises(QMoEInputError, match="dtype"):
        fam.spec_for("float64")
