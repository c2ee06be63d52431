"""QMoE nodes of an ONNX model into layers (CPU): a model with two QMoE nodes among other nodes, weights
as initializers in external data, is read back to the same arrays and attributes, and each node's layer
computes what onnxruntime (>= 1.32, CPU) computes for the node's inputs; weights that are not in the
model are refused, naming the node and the input; files that are no ONNX model are refused in one line.
(ONNX Runtime's own layouts, fp4 / nvfp4 / prepacked / INT3: tests/checkpoints/test_onnx_layouts.py.)"""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime", minversion="1.32")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from qmoe_rtc.checkpoints.onnx_nodes import qmoe_nodes  # noqa: E402
from qmoe_rtc.contract import INPUT_NAMES, QMoEAttributes, describe_layer  # noqa: E402
from qmoe_rtc.contract.random_layer import random_layer  # noqa: E402
from qmoe_rtc.contract.reference import qmoe as reference  # noqa: E402
from qmoe_rtc.errors import QMoEInputError, QMoEUnsupportedError  # noqa: E402

from support.ort_oracle import run_ort_qmoe  # noqa: E402

H, E = 64, 4
LAYERS = {  # node name -> random_layer kwargs (what ONNX Runtime's CPU QMoE runs: swiglu interleaved, 2/4/8-bit;
    # it renormalises the top k whatever normalize_routing_weights says, tests/support/ort_oracle.py)
    "moe0": dict(I=32, k=2, bits=4, block_size=32, zero_points=True, activation_type="swiglu", swiglu_fusion=1,
                 bias=True, normalize_routing_weights=1),
    "moe1": dict(I=64, k=1, bits=8, block_size=0, activation_type="gelu", normalize_routing_weights=1),
}
#: node-only attributes: moe1 (unfused, I = H) says its codes are raw, as its shapes cannot tell
NODE_ATTRS = {"moe1": dict(weights_prepacked=0)}


def _model(tmp_path, rng, weights_as_inputs=False, node_attrs=NODE_ATTRS):
    """x → QMoE moe0 → Add → QMoE moe1 → y, router probs from graph inputs; returns (path, layers)."""
    layers, nodes, inits, ins = {}, [], [], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, H])]
    prev = "x"
    for name, kw in LAYERS.items():
        w, a = random_layer(rng, E=E, H=H, dtype="float32", **kw)
        layers[name] = (w, a)
        ins.append(helper.make_tensor_value_info(f"{name}_probs", TensorProto.FLOAT, [None, E]))
        names = []
        for slot in INPUT_NAMES[2:14]:
            arr = w.get(slot)
            if arr is None:
                names.append("")
                continue
            tensor = f"{name}.{slot}"
            if weights_as_inputs:
                ins.append(helper.make_tensor_value_info(tensor, helper.np_dtype_to_tensor_dtype(arr.dtype),
                                                         list(arr.shape)))
            else:
                inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), tensor))
            names.append(tensor)
        while names and not names[-1]:
            names.pop()
        nodes.append(helper.make_node("QMoE", [prev, f"{name}_probs", *names], [f"{name}_out"], name=name,
                                      domain="com.microsoft", **a, **node_attrs.get(name, {})))
        nodes.append(helper.make_node("Add", [f"{name}_out", prev], [f"{name}_res"], name=f"{name}_add"))
        prev = f"{name}_res"
    out = helper.make_tensor_value_info(prev, TensorProto.FLOAT, [None, H])
    model = helper.make_model(helper.make_graph(nodes, "two_moe", ins, [out], inits),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    path = tmp_path / "model.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location="weights.bin",
                    size_threshold=0)
    return path, layers


def test_qmoe_nodes_read_back_and_match_onnxruntime(tmp_path, rng):
    path, layers = _model(tmp_path, rng)
    assert (tmp_path / "weights.bin").stat().st_size > 0  # the initializers live in external data
    nodes = qmoe_nodes(path)
    assert [n.name for n in nodes] == list(LAYERS)
    for node in nodes:
        w, a = layers[node.name]
        assert node.inputs == {"input": "x" if node.name == "moe0" else "moe0_res", "router_probs": f"{node.name}_probs"}
        assert set(node.weights) == {n for n, v in w.items() if v is not None}
        for n, arr in node.weights.items():
            np.testing.assert_array_equal(arr, w[n], err_msg=n)
            assert arr.dtype == w[n].dtype
        assert node.attributes == a
        describe_layer(node.weights, QMoEAttributes.from_kwargs(**node.attributes))
        x = rng.standard_normal((5, H)).astype(np.float32)
        probs = rng.standard_normal((5, E)).astype(np.float32)
        ours = reference(x, probs, **node.weights, **node.attributes)
        ort = run_ort_qmoe({"input": x, "router_probs": probs, **node.weights}, **node.attributes)
        rel = np.linalg.norm(ours - ort) / np.linalg.norm(ort)
        assert rel <= 1e-5, f"{node.name}: relative error {rel:.2e} against onnxruntime"


def test_weights_outside_the_model_are_refused(tmp_path, rng):
    path, _ = _model(tmp_path, rng, weights_as_inputs=True)
    with pytest.raises(QMoEInputError, match="moe0 fc1_experts_weights.*graph input"):
        qmoe_nodes(path)
    with pytest.raises(QMoEInputError, match="an existing .onnx file"):
        qmoe_nodes(tmp_path / "absent.onnx")


def test_the_checkpoint_command_lists_the_nodes(tmp_path, rng, capsys):
    from qmoe_rtc.__main__ import main

    path, _ = _model(tmp_path, rng)
    assert main(["checkpoint", str(path)]) == 0
    out = capsys.readouterr().out
    assert "moe0: E=4 H=64 I=32 k=2 swiglu" in out and "moe1: E=4 H=64 I=64 k=1 gelu" in out


def test_unfused_square_layers_without_weights_prepacked_are_refused_unless_told(tmp_path, rng):
    """moe1 (gelu, I = H) without ``weights_prepacked``: raw and CUDA-prepacked codes have the same shape."""
    path, layers = _model(tmp_path, rng, node_attrs={})
    with pytest.raises(QMoEUnsupportedError, match="moe1 weights_prepacked.*int_layout"):
        qmoe_nodes(path)
    nodes = qmoe_nodes(path, int_layout="raw")
    np.testing.assert_array_equal(nodes[1].weights["fc1_experts_weights"], layers["moe1"][0]["fc1_experts_weights"])
    assert nodes[0].layout == nodes[1].layout == "raw"


@pytest.mark.parametrize("content", [b"", b"this is not an onnx model\n" * 3, bytes(range(256))])
def test_files_that_are_no_onnx_model_are_refused_in_one_line(tmp_path, content, capsys):
    from qmoe_rtc.__main__ import main

    path = tmp_path / "model.onnx"
    path.write_bytes(content)
    with pytest.raises(QMoEInputError, match="model.onnx") as info:
        qmoe_nodes(path)
    assert "\n" not in str(info.value)
    assert main(["checkpoint", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "QMoEInputError" in err and "model.onnx" in err, err
