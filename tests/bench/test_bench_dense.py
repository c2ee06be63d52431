"""`bench dense` on the CPU: its routing and FLOP count (the benches' flop_count), and its help (the GPU run is a device step)."""

import pytest

from qmoe_rtc.bench import dense


def test_balanced_routes_and_flops():
    assert dense.routes_per_expert(4096, 2, 8) == 1024        # mixtral-8x7b at 4096 tokens
    assert dense.routes_per_expert(1, 8, 128) == 1             # fewer routes than experts: one each
    # the count it prints (the benches' flop_count over E·R routes): mixtral 4096's 6·T·k·H·I = 2.886 TFLOP,
    # 3653 µs at 790 TFLOP/s (the peers' FLOP floor)
    from qmoe_rtc.bench.report import flop_count

    assert flop_count(8 * 1024, 1, 4096, 14336) == 6 * 4096 * 2 * 4096 * 14336
    assert abs(flop_count(8 * 1024, 1, 4096, 14336) / 790e12 * 1e6 - 3653) < 1

def test_help_needs_no_gpu(capsys):
    with pytest.raises(SystemExit) as e:
        dense.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--preset" in out and out.startswith("usage: python -m qmoe_rtc bench dense")
