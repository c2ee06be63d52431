"""`bench stream`: the bytes it reads (the bench floor's, the experts uniform routing is expected to hit), its refusals
before the GPU, and on the GPU that its kernel reads every byte once (checksum) and prints a time."""

import numpy as np
import pytest

from qmoe_rtc.bench import stream
from qmoe_rtc.bench.report import BENCH_SHAPES, expert_bytes
from qmoe_rtc.errors import QMoEInputError


def test_layer_bytes_count_the_experts_uniform_routing_hits():
    qwen = BENCH_SHAPES["qwen3-30b-a3b"]
    per = expert_bytes(qwen.H, qwen.I, (4, 4), qwen.block_size, False, 2)
    # 8 tokens: 128·(1 − (15/16)^8) = 51.9 experts, 52 read; a simulation (distinct top-8 of random logits) agrees
    rng = np.random.default_rng(0)
    hits = [np.unique(np.argsort(-rng.standard_normal((8, 128)), axis=1)[:, :8]).size for _ in range(400)]
    assert abs(np.mean(hits) - 128 * (1 - (15 / 16) ** 8)) < 0.5
    assert stream.layer_bytes(qwen, 8) == 52 * per + 2 * 8 * qwen.H * 2 + 8 * qwen.E * 4
    assert stream.layer_bytes(qwen, 4096) == 128 * per + 2 * 4096 * qwen.H * 2 + 4096 * qwen.E * 4  # every expert


def test_layer_bytes_are_the_bench_floor_bytes():
    mix = BENCH_SHAPES["mixtral-8x7b"]
    per = expert_bytes(mix.H, mix.I, (4, 4), mix.block_size, False, 2)
    # one token: two experts, the input and output rows, the float32 logits
    assert stream.layer_bytes(mix, 1) == 2 * per + 2 * mix.H * 2 + mix.E * 4
    assert 181e6 < stream.layer_bytes(mix, 1) < 182e6  # the table's 42.3 µs floor at 4.30 TB/s
    gpt = BENCH_SHAPES["gpt-oss-120b"]
    assert gpt.block_size == 32 and stream.layer_bytes(gpt, 1) == 4 * expert_bytes(
        gpt.H, gpt.I, (4, 4), 32, False, 2) + 2 * gpt.H * 2 + gpt.E * 4


@pytest.mark.parametrize("argv, name", [
    (["--bytes", "0"], "bytes"), (["--bytes", "1e6,x"], "bytes"), (["--preset", "llama"], "preset"),
    (["--tokens", "0"], "tokens"), (["--chunk", "1000"], "chunk"), (["--stages", "1"], "stages"),
    (["--stages", "16", "--chunk", "4096"], "stages"), (["--run", "3000"], "run"),
])
def test_bad_arguments_are_refused_before_the_gpu(capsys, argv, name):
    with pytest.raises(SystemExit) as e:
        stream.main(argv)
    assert e.value.code == 2 and f"input '{name}'" in capsys.readouterr().err


def test_geometry_errors_name_the_value():
    with pytest.raises(QMoEInputError, match="'run'.*multiple of chunk"):
        stream.check_geometry(2048, 4, 3000)


@pytest.mark.gpu
def test_the_kernel_reads_every_byte_once_and_prints_a_time(capsys):
    import cupy as cp

    reader = stream.StreamRead(cp, chunk=1024, stages=3, run=4096)
    blocks = reader.blocks(1 << 20)
    words = blocks * 4 * 4096 // 4
    src = cp.asarray(np.random.default_rng(1).integers(0, 1 << 32, size=words, dtype=np.uint32))
    reader.sum.fill(0)
    reader(src, blocks)
    assert int(reader.sum.get()[0]) == int(np.bitwise_xor.reduce(src.get()))
    reader.sum.fill(0)
    reader(src, blocks - 1)  # a read of fewer blocks gives another checksum: the test can fail
    assert int(reader.sum.get()[0]) != int(np.bitwise_xor.reduce(src.get()))
    assert stream.main(["--bytes", "4e6,20e6", "--iters", "3"]) == 0
    out = capsys.readouterr().out
    assert "copy" in out and out.count(" MB ") >= 2
