"""Depthwise 2-D convs of plain data that no reader takes blocked (a graph output, ConvNeXt's
permute to channels-last) stay in NCHW
(`schedules.depthwise_window_schedule`: rows of pixel vectors, a last vector overlapping where
the lanes do not divide the row): compiled natively and compared with ONNX Runtime over
strides, dilations, padding, row lengths, a batch and fused epilogues."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper

import compiler_core
from compiler_core.frontend.onnx import import_model
from compiler_core.passes.pipeline import optimize
from compiler_core.runtime import load
from tests.conftest import FLOAT, assert_close_to_scale, make_model

RNG = np.random.default_rng(23)


def depthwise(shape, kernel, stride=1, pad=0, dilation=1, bias=True, activation=None):
    n, c, h, w = shape
    span = dilation * (kernel - 1) + 1
    out = [n, c, *((size + 2 * pad - span) // stride + 1 for size in (h, w))]
    inputs = ["x", "w", "b"] if bias else ["x", "w"]
    nodes = [
        helper.make_node(
            "Conv",
            inputs,
            ["c" if activation else "y"],
            name="dw",
            group=c,
            kernel_shape=[kernel, kernel],
            strides=[stride, stride],
            pads=[pad] * 4,
            dilations=[dilation, dilation],
        )
    ]
    if activation:
        nodes.append(helper.make_node(activation, ["c"], ["y"], name="act"))
    weights = {"w": RNG.standard_normal((c, 1, kernel, kernel)).astype(np.float32)}
    if bias:
        weights["b"] = RNG.standard_normal(c).astype(np.float32)
    return make_model(nodes, [("x", FLOAT, shape)], [("y", FLOAT, out)], weights)


CASES = {
    # Kept plain by the layout pass (up to 5x5 taps at stride 1, 3x3 at stride 2, read by no
    # layout op).
    "3x3": ([1, 16, 13, 13], 3, 1, 1, 1, True, None),
    "5x5_row_of_70": ([1, 8, 9, 70], 5, 1, 2, 1, True, "Relu"),  # whole vectors and a tail
    "3x3_no_padding": ([1, 24, 6, 40], 3, 1, 0, 1, True, None),
    "3x3_dilated": ([2, 9, 20, 31], 3, 1, 2, 2, False, "Sigmoid"),
    "3x3_stride2": ([1, 16, 29, 58], 3, 2, 1, 1, True, "Relu"),  # a whole row of strided taps
    # Fewer than 8 channels: never blocked, so every stride and size runs plain.
    "7x7_row_of_56": ([1, 4, 14, 56], 7, 1, 3, 1, True, None),
    "5x5_stride2": ([1, 6, 29, 29], 5, 2, 2, 1, False, None),
    "3x3_stride3_dilated": ([2, 5, 20, 31], 3, 3, 2, 2, True, "Relu"),
    "5x5_stride5": ([1, 4, 30, 60], 5, 5, 0, 1, True, None),  # lanes 5 apart: gathered
}


@pytest.mark.parametrize("name", list(CASES))
def test_plain_depthwise_conv_matches_onnxruntime(name):
    shape, *params = CASES[name]
    model = depthwise(shape, *params)
    graph = optimize(import_model(model))
    assert not any(node.op == "LayoutTransform" for node in graph.nodes), "not kept plain"
    x = RNG.standard_normal(shape).astype(np.float32)
    data = model.SerializeToString()
    ours = load(compiler_core.compile(data)).run({"x": x})["y"]
    (theirs,) = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert_close_to_scale(ours, theirs)
