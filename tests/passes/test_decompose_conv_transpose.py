"""decompose_conv_transpose: a ConvTranspose with constant weights becomes one stride-1 Conv
over the stride phases plus an InterleavePhases copy, and computes what it did (numpy
reference executor on both graphs)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from onnx import helper

from compiler_core.frontend.onnx import import_model
from compiler_core.graph.verify import verify
from compiler_core.passes import decompose_conv_transpose
from compiler_core.reference import run_graph
from tests.conftest import FLOAT, make_model

RNG = np.random.default_rng(11)


def conv_transpose_model(
    spatial, kernel, strides, channels=3, out_channels=5, group=1, bias=True, weight_input=False,
    **attrs,
):  # fmt: skip
    nsp = len(spatial)
    w = RNG.standard_normal((channels, out_channels // group, *kernel)).astype(np.float32)
    inputs = [("x", FLOAT, [2, channels, *spatial])]
    initializers = {"b": RNG.standard_normal(out_channels).astype(np.float32)} if bias else {}
    if weight_input:
        inputs.append(("w", FLOAT, list(w.shape)))
    else:
        initializers["w"] = w
    node = helper.make_node(
        "ConvTranspose",
        ["x", "w", "b"] if bias else ["x", "w"],
        ["y"],
        name="up",
        strides=list(strides),
        group=group,
        **attrs,
    )
    model = make_model([node], inputs, [("y", FLOAT, None)], initializers)
    del model.graph.output[0].type.tensor_type.shape.dim[:]  # the importer infers it
    assert nsp == len(kernel) == len(strides)
    return import_model(model)


def assert_decomposed_same(before, rtol=1e-5):
    after = decompose_conv_transpose.run(before)
    verify(after)
    heavy = [n.op for n in after.nodes if n.op != "Reshape"]  # 1-D: lifted to 2-D and back
    assert heavy in (["Conv"], ["Conv", "InterleavePhases"])
    feeds = {n: RNG.standard_normal(before.types[n].shape, np.float32) for n in before.inputs}
    expected, actual = run_graph(before, feeds)["y"], run_graph(after, feeds)["y"]
    assert actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=1e-5 * np.abs(expected).max())
    return after


@pytest.mark.parametrize("stride", [1, 2, 3])
@pytest.mark.parametrize("kernel", [1, 2, 3, 4, 5])
def test_1d_every_kernel_and_stride(stride, kernel):
    for pads, output_padding in [((0, 0), 0), ((kernel // 2, (kernel - 1) // 2), stride - 1)]:
        graph = conv_transpose_model(
            [7], [kernel], [stride], pads=list(pads), output_padding=[output_padding]
        )
        assert_decomposed_same(graph)


@pytest.mark.parametrize("stride", [1, 2, 3])
@pytest.mark.parametrize("kernel", [1, 2, 3, 4, 5])
def test_2d_every_kernel_and_stride(stride, kernel):
    pad = min(kernel - 1, 2)
    graph = conv_transpose_model(
        [5, 4],
        [kernel, kernel],
        [stride, stride],
        pads=[pad, 0, pad // 2, pad],  # asymmetric
        output_padding=[stride - 1, 0],
    )
    assert_decomposed_same(graph)


@pytest.mark.parametrize(
    "spatial, kernel, strides, attrs",
    [
        ([5, 6], [3, 2], [2, 3], {"pads": [1, 0, 0, 1]}),
        ([4, 3], [4, 3], [3, 1], {"output_padding": [2, 0]}),
        ([3, 5], [2, 4], [2, 2], {"output_shape": [9, 13]}),  # pads from an oversized output
        ([3, 5], [3, 3], [2, 2], {"auto_pad": "SAME_UPPER"}),
        ([3, 5], [3, 3], [2, 2], {"auto_pad": "SAME_LOWER"}),
        ([6], [5], [2], {"pads": [4, 4]}),  # crops more than one phase row at each end
        ([2, 3, 3], [3, 2, 2], [2, 1, 2], {"pads": [1, 0, 1, 0, 1, 0]}),  # 3-D
    ],
)
def test_mixed_strides_pads_and_output_sizes(spatial, kernel, strides, attrs):
    assert_decomposed_same(conv_transpose_model(spatial, kernel, strides, **attrs))


@pytest.mark.parametrize("group, channels, out_channels", [(2, 4, 6), (3, 3, 3)])
def test_grouped(group, channels, out_channels):
    graph = conv_transpose_model(
        [5, 4], [3, 3], [2, 2], channels=channels, out_channels=out_channels, group=group,
        pads=[1, 1, 1, 1], output_padding=[1, 1],
    )  # fmt: skip
    assert_decomposed_same(graph)


def test_without_bias_and_stride_one_is_a_plain_conv():
    graph = conv_transpose_model([6, 5], [3, 3], [1, 1], bias=False, pads=[2, 2, 2, 2])
    after = assert_decomposed_same(graph)
    (conv,) = after.nodes  # no crop: stride 1 with pads k-1 is a valid correlation
    assert conv.op == "Conv" and conv.attr("pads") == (0, 0, 0, 0)


def test_phase_conv_shape():
    """Expected: k4 s2 p1 on 32x32 -> one 2x2 Conv with 4x the channels over a 33x33 grid
    (padded by one on each side), interleaved and cropped from position 1."""
    graph = conv_transpose_model([32, 32], [4, 4], [2, 2], channels=8, out_channels=4,
                                 pads=[1, 1, 1, 1])  # fmt: skip
    after = decompose_conv_transpose.run(graph)
    conv, interleave = after.nodes
    assert after.types[conv.inputs[1]].shape == (16, 8, 2, 2)
    assert after.types[conv.outputs[0]].shape == (2, 16, 33, 33)
    assert conv.attr("pads") == (1, 1, 1, 1)
    assert interleave.attr("starts") == (1, 1)
    assert after.types["y"].shape == (2, 4, 64, 64)
    assert "w" not in after.constants  # the original weight is no longer needed


def test_1d_rides_a_2d_conv():
    """A 1-D ConvTranspose is lifted to a unit-height 2-D one, so that its phase Conv gets the
    blocked 2-D path; the interleave's output is reshaped back."""
    graph = conv_transpose_model([13], [4], [2], channels=6, out_channels=4, pads=[1, 2])
    after = assert_decomposed_same(graph)
    assert [n.op for n in after.nodes] == ["Reshape", "Conv", "InterleavePhases", "Reshape"]
    conv = after.nodes[1]
    assert after.types[conv.inputs[1]].shape == (8, 6, 1, 2)
    assert conv.attr("pads") == (0, 1, 0, 0)  # q = 0..12: the end pad 2 crops row 13 away
    assert after.types["y"].shape == graph.types["y"].shape == (2, 4, 25)


def test_left_alone_dilated_or_runtime_weight():
    dilated = conv_transpose_model([5, 5], [3, 3], [2, 2], dilations=[2, 2])
    assert decompose_conv_transpose.run(dilated) is dilated
    runtime_weight = conv_transpose_model([5, 5], [3, 3], [2, 2], weight_input=True)
    assert decompose_conv_transpose.run(runtime_weight) is runtime_weight


def test_phase_weight_taps():
    """Tap u of phase r holds w[r + (T-1-u)*s]; a phase with fewer taps gets a zero tap."""
    w = np.arange(5, dtype=np.float32).reshape(1, 1, 5)  # k5 s2: T=3, phase 1 has 2 taps
    phased = decompose_conv_transpose.phase_weight(w, (2,), 1)
    np.testing.assert_array_equal(phased[:, 0], [[4, 2, 0], [0, 3, 1]])
    w2 = RNG.standard_normal((4, 3, 3, 2)).astype(np.float32)
    phased = decompose_conv_transpose.phase_weight(w2, (2, 2), 1)
    assert phased.shape == (12, 4, 2, 1)
    for m, ry, rx, c in itertools.product(range(3), range(2), range(2), range(4)):
        channel = m * 4 + ry * 2 + rx
        for u in range(2):
            k = ry + (1 - u) * 2
            expected = w2[c, m, k, rx] if k < 3 else 0.0
            assert phased[channel, c, u, 0] == expected


def test_prime_phase_grid_width_is_widened():
    """k4 s2 p1 on 16x16 needs a 17x17 phase grid; the width grows to 18 (computed, then
    cropped) so that the conv's pixel tile, a divisor of the width, is not one pixel."""
    graph = conv_transpose_model([16, 16], [4, 4], [2, 2], channels=4, out_channels=2,
                                 pads=[1, 1, 1, 1])  # fmt: skip
    after = assert_decomposed_same(graph)
    conv = after.nodes[0]
    assert after.types[conv.outputs[0]].shape == (2, 8, 17, 18)
    assert conv.attr("pads") == (1, 1, 1, 2)
    assert after.types["y"].shape == (2, 2, 32, 32)
