"""``python -m qmoe_rtc checkpoint PATH``: read every MoE layer of a checkpoint (or those of
``--layers``) into contract inputs, as :func:`qmoe_rtc.checkpoints.load_layer` does, with a progress line
per layer, and print what each holds; for an ``.onnx`` model, its QMoE nodes. Nothing goes to a GPU: it
checks a checkpoint before deployment."""

from __future__ import annotations

import argparse
import sys

from ..cli_args import csv


def _progress(layer: int):
    tty = sys.stderr.isatty()

    def progress(done: int, total: int) -> None:
        if tty:
            sys.stderr.write(f"\r  layer {layer}: {done}/{total} experts" + ("\n" if done == total else ""))
            sys.stderr.flush()

    return progress


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m qmoe_rtc checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("path", help="a .safetensors file, or a folder of them with config.json")
    p.add_argument("--layers", type=csv(int), default=None, help="comma list of layer indices (default: every MoE layer)")
    p.add_argument("--scheme", default=None, help="naming scheme (default: found from the tensor names)")
    p.add_argument("--int-layout", default="auto", choices=("auto", "raw", "cuda"),
                   help=".onnx only: how 4/8-bit QMoE nodes without weights_prepacked store their codes "
                        "(default: from their shapes)")
    a = p.parse_args(argv)
    if str(a.path).endswith(".onnx"):
        return _onnx(a.path, a.int_layout)
    from .layer import load_layer, moe_layers
    from .source import Checkpoint

    with Checkpoint(a.path) as ckpt:  # each file's header parsed once for every layer
        return _layers(ckpt, a, load_layer, moe_layers)


def _layers(ckpt, a, load_layer, moe_layers) -> int:
    layers = a.layers if a.layers is not None else moe_layers(ckpt, a.scheme)
    if not layers:
        print(f"{a.path}: no MoE expert tensors found", file=sys.stderr)
        return 1
    for L in layers:
        got = load_layer(ckpt, L, scheme=a.scheme, progress=_progress(L))
        w, at = got.weights, got.attributes
        E, N1 = w["fc1_experts_weights"].shape[:2]
        H = w["fc2_experts_weights"].shape[1]
        nbytes = sum(v.nbytes for v in w.values())
        router = "router [E, H]" if got.router_weight is not None else "no router"
        if got.router_bias is not None:
            router += " + bias [E]"
        qt = at.get("quant_type", "int")
        codes = f"int{at['expert_weight_bits']}" if qt == "int" else qt  # fp8 / mxfp4 / nvfp4: no zero points
        zp = "" if qt != "int" else " zero points" if "fc1_zero_points" in w or "fc2_zero_points" in w else " symmetric"
        print(f"layer {L}: E={E} H={H} I={N1 // 2} k={at['k']} {codes} "
              f"block {at['block_size'] or 'row-wise'}{zp}, {router}, {nbytes / 2**20:.1f} MiB")
    return 0


def _onnx(path, int_layout: str = "auto") -> int:
    from ..contract import QMoEAttributes, describe_layer
    from .onnx_nodes import qmoe_nodes

    nodes = qmoe_nodes(path, int_layout=int_layout)
    if not nodes:
        print(f"{path}: no com.microsoft::QMoE nodes", file=sys.stderr)
        return 1
    for node in nodes:
        layer = describe_layer(node.weights, QMoEAttributes.from_kwargs(**node.attributes))
        nbytes = sum(v.nbytes for v in node.weights.values())
        print(f"{node.name}: E={layer.E} H={layer.H} I={layer.I} k={layer.attrs.k} {layer.attrs.activation_type}, "
              f"{layer.attrs.quant_type} ({node.layout}), inputs {node.inputs}, {nbytes / 2**20:.1f} MiB")
    return 0
