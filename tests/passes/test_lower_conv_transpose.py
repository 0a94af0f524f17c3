"""ConvTranspose as a stride-phase Conv: the rewritten graph computes what the original did
(numpy reference executor) over strides, kernels, pads, output padding, groups and 1-3 spatial
dims; it compiles natively and matches ONNX Runtime; ineligible nodes are left alone."""

from __future__ import annotations

import itertools

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper

import compiler_core
from compiler_core.frontend.onnx import import_model
from compiler_core.passes import lower_conv_transpose
from compiler_core.passes.pipeline import optimize
from compiler_core.runtime import load
from tests.conftest import FLOAT, assert_close_to_scale, make_model, random_feeds
from tests.passes.test_passes import assert_same_function, rand


def conv_transpose_model(
    spatial, cin, cout, kernel, stride, pads=None, output_padding=None, group=1, bias=True
):
    nsp = len(spatial)
    pads = pads or [0] * (2 * nsp)
    output_padding = output_padding or [0] * nsp
    out = [
        (size - 1) * stride + kernel - pads[i] - pads[i + nsp] + output_padding[i]
        for i, size in enumerate(spatial)
    ]
    inputs = ["x", "w", "b"] if bias else ["x", "w"]
    weights = {"w": rand(cin, cout // group, *[kernel] * nsp)}
    if bias:
        weights["b"] = rand(cout)
    node = helper.make_node(
        "ConvTranspose",
        inputs,
        ["y"],
        name="up",
        kernel_shape=[kernel] * nsp,
        strides=[stride] * nsp,
        pads=pads,
        output_padding=output_padding,
        group=group,
    )
    return make_model(
        [node], [("x", FLOAT, [1, cin, *spatial])], [("y", FLOAT, [1, cout, *out])], weights
    )


def before_lowering(model):
    return optimize(import_model(model), stop_after="simplify_inference")


CASES = [
    # (spatial, cin, cout, kernel, stride, pads, output_padding, group)
    *[
        ([5, 7], 3, 4, k, s, None, None, 1)
        for k, s in itertools.product((1, 2, 3, 4, 5), (1, 2, 3))
    ],
    ([6, 6], 4, 6, 4, 2, [1, 1, 1, 1], None, 1),
    ([6, 5], 4, 6, 3, 2, [1, 0, 2, 1], [1, 1], 1),
    ([7, 7], 4, 8, 3, 2, [1, 1, 1, 1], [1, 0], 2),
    ([11], 3, 5, 4, 3, [2, 1], None, 1),
    ([13], 4, 4, 2, 2, None, [1], 4),
    ([3, 4, 5], 2, 3, 3, 2, [1, 0, 1, 1, 0, 1], None, 1),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}k{c[3]}s{c[4]}g{c[7]}")
def test_phase_conv_computes_the_transposed_conv(case):
    spatial, cin, cout, kernel, stride, pads, output_padding, group = case
    before = before_lowering(
        conv_transpose_model(spatial, cin, cout, kernel, stride, pads, output_padding, group)
    )
    after = lower_conv_transpose.run(before)
    assert "ConvTranspose" not in {n.op for n in after.nodes}
    convs = [n for n in after.nodes if n.op == "Conv"]
    assert len(convs) == 1 and all(s == 1 for s in convs[0].attr("strides"))
    assert_same_function(before, after, rtol=1e-4, atol=1e-5)


def test_without_bias_and_the_blocked_path_takes_the_conv():
    model = conv_transpose_model([9, 9], 16, 8, 2, 2, bias=False)
    graph = optimize(import_model(model))
    conv = next(n for n in graph.nodes if n.op == "Conv")
    assert conv.attr("out_layout", "NCHW") != "NCHW"  # 8 x 4 phases: blocked


def test_ineligible_nodes_are_left_alone():
    model = conv_transpose_model([5, 5], 3, 4, 3, 2)
    model.graph.node[0].attribute.append(helper.make_attribute("dilations", [2, 2]))
    model.graph.output[0].type.tensor_type.shape.dim[2].dim_value = 13
    model.graph.output[0].type.tensor_type.shape.dim[3].dim_value = 13
    before = before_lowering(model)
    assert lower_conv_transpose.run(before) is before


@pytest.mark.parametrize(
    "case",
    [
        ([24, 20], 16, 8, 2, 2, None),
        ([16, 16], 16, 16, 4, 2, [1, 1, 1, 1]),
        ([33], 8, 8, 3, 2, None),
    ],
)
def test_native_conv_transpose_matches_onnxruntime(case):
    spatial, cin, cout, kernel, stride, pads = case
    model = conv_transpose_model(spatial, cin, cout, kernel, stride, pads).SerializeToString()
    module = load(compiler_core.compile(model), num_threads=2)
    feeds = random_feeds(module.inputs)
    (actual,) = module.run(feeds).values()
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    (expected,) = session.run(None, feeds)
    assert_close_to_scale(actual, expected, label=str(case))
    assert np.isfinite(actual).all()
