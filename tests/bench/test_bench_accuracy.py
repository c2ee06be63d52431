"""``bench accuracy`` (GPU-free): its forms agree with the float64 reference's FP8 activations, and its table."""

from __future__ import annotations

import numpy as np

from qmoe_rtc.bench import accuracy
from qmoe_rtc.contract import reference
from qmoe_rtc.contract.random_layer import random_inputs, random_layer


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def test_the_fp8_forms_are_the_references_fp8_activations(rng):
    w, a = random_layer(rng, E=2, H=256, I=192, k=2, bits=4, block_size=64, dtype="float32", activation_type="swiglu",
                        swiglu_fusion=2)
    x, logits, _ = random_inputs(rng, 6, 256, 2, dtype="float32")
    errs = accuracy.errors_of(w, a, x, logits)
    plain = reference.qmoe(x, logits, **w, **a).astype(np.float64)
    for form, group in (("fp8-row", 0), ("fp8-g128", 128)):
        fp8 = reference.qmoe(x, logits, **w, **a, activation_quant="fp8_e4m3", activation_quant_group=group)
        assert np.isclose(errs[form][0], _rel(fp8, plain), rtol=1e-3), form  # the reference's output is float32
    assert 0 < errs["a16"][0] < errs["fp8-row"][0] < 0.1
    assert all(0 < l2 <= mx * 10 for l2, mx in errs.values())


def test_the_table_names_each_shape_and_refuses_an_unknown_one(capsys):
    assert accuracy.main(["--preset", "ort-2048", "--tokens", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("| shape | H | I | block | a16 L2 / max") and out[3].startswith("| ort-2048 | 2048 | 2048 | 128 |")
    assert accuracy.main(["--preset", "nope"]) == 2
