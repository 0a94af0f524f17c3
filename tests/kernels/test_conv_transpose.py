"""Native ConvTranspose against ONNX Runtime: the stride-phase Conv path (constant weights;
blocked when the phase channels allow it) and the direct kernel that dilated kernels and
runtime weights keep."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

import compiler_core
from compiler_core.frontend.onnx import import_model
from compiler_core.passes.pipeline import optimize
from compiler_core.runtime import load
from tests.conftest import FLOAT, assert_close_to_scale, make_model

CASES = {
    # name: (channels, out_channels, spatial, kernel, attrs)
    "unet_k2s2": (40, 6, [9, 7], [2, 2], {"strides": [2, 2]}),  # 6*4 phase channels: blocked
    "gan_k4s2p1": (5, 4, [6, 5], [4, 4], {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
    "k3s2_output_padding": (
        3,
        8,
        [5, 5],
        [3, 3],
        {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]},
    ),
    "k5s3_asymmetric": (4, 3, [4, 7], [5, 3], {"strides": [3, 2], "pads": [2, 0, 1, 2]}),
    "stride1_pad": (7, 9, [6, 5], [3, 3], {"pads": [1, 0, 2, 1]}),
    "output_shape": (3, 5, [3, 4], [3, 3], {"strides": [2, 2], "output_shape": [6, 8]}),
    "grouped": (6, 4, [5, 5], [3, 3], {"strides": [2, 2], "group": 2, "pads": [1, 1, 1, 1]}),
    "depthwise": (4, 4, [5, 6], [4, 4], {"strides": [2, 2], "group": 4, "pads": [1, 1, 1, 1]}),
    "conv1d_k4s2": (6, 5, [13], [4], {"strides": [2], "pads": [1, 2]}),
    "conv1d_k7s3": (3, 8, [11], [7], {"strides": [3], "output_padding": [2]}),
    "conv3d_k2s2": (3, 4, [3, 4, 5], [2, 3, 2], {"strides": [2, 2, 2], "pads": [0, 1, 0] * 2}),
    "dilated": (3, 4, [5, 5], [3, 3], {"strides": [2, 2], "dilations": [2, 2]}),
}


def _out_spatial(spatial, kernel, attrs):
    if "output_shape" in attrs:
        return list(attrs["output_shape"])
    nsp = len(spatial)
    strides = attrs.get("strides", [1] * nsp)
    dilations = attrs.get("dilations", [1] * nsp)
    pads = attrs.get("pads", [0] * 2 * nsp)
    extra = attrs.get("output_padding", [0] * nsp)
    return [
        strides[i] * (spatial[i] - 1) + extra[i] + (kernel[i] - 1) * dilations[i] + 1
        - pads[i] - pads[i + nsp]
        for i in range(nsp)
    ]  # fmt: skip


def _model(channels, out_channels, spatial, kernel, attrs, weight_input=False):
    rng = np.random.default_rng(3)
    group = attrs.get("group", 1)
    w = rng.standard_normal((channels, out_channels // group, *kernel)).astype(np.float32)
    b = rng.standard_normal(out_channels).astype(np.float32)
    inputs = [("x", FLOAT, [2, channels, *spatial])]
    initializers = {"b": b}
    if weight_input:
        inputs.append(("w", FLOAT, list(w.shape)))
    else:
        initializers["w"] = w
    node = helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], **attrs)
    out_shape = [2, out_channels, *_out_spatial(spatial, kernel, attrs)]
    model = make_model([node], inputs, [("y", FLOAT, out_shape)], initializers)
    feeds = {"x": rng.standard_normal((2, channels, *spatial)).astype(np.float32)}
    if weight_input:
        feeds["w"] = w
    return model, feeds


def _check(model, feeds, label):
    expected = ort.InferenceSession(model.SerializeToString()).run(None, feeds)[0]
    actual = load(compiler_core.compile(model)).run(feeds)["y"]
    assert_close_to_scale(actual, expected, label=label)


@pytest.mark.parametrize("name", sorted(CASES))
def test_native_matches_onnxruntime(name):
    model, feeds = _model(*CASES[name])
    _check(model, feeds, name)


def test_runtime_weight_keeps_the_direct_kernel():
    model, feeds = _model(*CASES["gan_k4s2p1"], weight_input=True)
    assert any(n.op == "ConvTranspose" for n in optimize(import_model(model)).nodes)
    _check(model, feeds, "runtime weight")


def test_phase_conv_rides_the_blocked_path():
    """k2 s2 with 6 output channels: 24 phase channels, a multiple of 8, so the phase Conv
    writes NCHW8c and the interleave reads it through one fused layout transform."""
    graph = optimize(import_model(_model(*CASES["unet_k2s2"])[0]))
    (conv,) = [n for n in graph.nodes if n.op == "Conv"]
    assert conv.attr("out_layout") != "NCHW"
    assert not any(n.op == "ConvTranspose" for n in graph.nodes)
    kinds = {tuple(graph.node_by_name[n].op for n in g.nodes) for g in graph.groups}
    assert ("LayoutTransform", "InterleavePhases") in kinds


def _node_test_cases():
    from tests.conformance.suite import generate

    return sorted(p.name for p in generate().glob("test_convtranspose*"))


@pytest.mark.parametrize("case", _node_test_cases())
def test_onnx_node_tests_with_constant_weights(case):
    """The ONNX ConvTranspose node tests pass the weight as an input, which keeps the direct
    kernel; as an initializer (a trained model's weight) it takes the phase Conv path."""
    from tests.conformance.suite import generate

    folder = generate() / case
    model = onnx.load(str(folder / "model.onnx"))
    data = folder / "test_data_set_0"
    inputs = [numpy_helper.to_array(onnx.load_tensor(str(p))) for p in sorted(data.glob("input_*"))]
    expected = numpy_helper.to_array(onnx.load_tensor(str(data / "output_0.pb")))
    graph = model.graph
    weight = graph.input[1]
    graph.initializer.append(numpy_helper.from_array(inputs[1], weight.name))
    graph.input.remove(weight)
    feeds = {graph.input[0].name: inputs[0]}
    if len(graph.input) > 1:
        feeds[graph.input[1].name] = inputs[2]
    decomposes = "dilations" not in case
    ops = {n.op for n in optimize(import_model(model)).nodes}
    assert ("ConvTranspose" not in ops) == decomposes
    actual = load(compiler_core.compile(model)).run(feeds)[graph.output[0].name]
    assert_close_to_scale(actual, expected, label=case)
