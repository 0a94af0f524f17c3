"""Col2Im: native code against ONNX Runtime and against the adjoint of a numpy im2col (the
sum of blocks Col2Im computes is the transpose of the block extraction a conv reads through),
in one, two and three spatial dimensions with pads, strides and dilations; and the clear
errors for blocks that do not fit their image and for shapes that are not constants."""

from __future__ import annotations

import itertools
import math

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import compiler_core
from compiler_core.frontend.common import NotConstantError
from compiler_core.frontend.onnx import import_model
from compiler_core.graph.ops.base import ShapeError
from compiler_core.runtime import load
from tests.conftest import FLOAT, assert_close_to_scale

RNG = np.random.default_rng(41)


def grid_of(image, block, pads, strides, dilations):
    nsp = len(image)
    return [
        (image[d] + pads[d] + pads[d + nsp] - dilations[d] * (block[d] - 1) - 1) // strides[d] + 1
        for d in range(nsp)
    ]


def col2im_model(channels, image, block, pads=None, strides=None, dilations=None, batch=2):
    nsp = len(image)
    pads = pads or [0] * (2 * nsp)
    strides, dilations = strides or [1] * nsp, dilations or [1] * nsp
    blocks = math.prod(grid_of(image, block, pads, strides, dilations))
    attrs = {"pads": pads, "strides": strides, "dilations": dilations}
    node = helper.make_node("Col2Im", ["x", "image", "block"], ["y"], **attrs)
    graph = helper.make_graph(
        [node],
        "col2im",
        [helper.make_tensor_value_info("x", FLOAT, [batch, channels * math.prod(block), blocks])],
        [helper.make_tensor_value_info("y", FLOAT, [batch, channels, *image])],
        [
            numpy_helper.from_array(np.asarray(image, np.int64), "image"),
            numpy_helper.from_array(np.asarray(block, np.int64), "block"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    x = RNG.standard_normal([batch, channels * math.prod(block), blocks]).astype(np.float32)
    return model, x


def im2col(image, block, pads, strides, dilations):
    """[N, C, *spatial] -> [N, C x block size, blocks]: every (dilated) block of the
    zero-padded image at the strides, element by element."""
    nsp = image.ndim - 2
    grid = grid_of(image.shape[2:], block, pads, strides, dilations)
    n, c = image.shape[:2]
    columns = np.zeros((n, c, math.prod(block), math.prod(grid)), image.dtype)
    for b, place in enumerate(itertools.product(*(range(g) for g in grid))):
        for k, offset in enumerate(itertools.product(*(range(s) for s in block))):
            pixel = [place[d] * strides[d] + offset[d] * dilations[d] - pads[d] for d in range(nsp)]
            if all(0 <= pixel[d] < image.shape[2 + d] for d in range(nsp)):
                columns[:, :, k, b] = image[(slice(None), slice(None), *pixel)]
    return columns.reshape(n, c * math.prod(block), -1)


CASES = {
    "2d_plain": (3, [6, 7], [2, 3], None, None, None),
    "2d_pads_strides": (2, [9, 8], [3, 3], [1, 0, 2, 1], [2, 2], None),
    "2d_dilations": (4, [10, 9], [2, 2], [0, 1, 1, 0], [1, 2], [3, 2]),
    "1d": (5, [17], [4], [2, 1], [3], [2]),
    "3d": (2, [5, 6, 4], [2, 3, 2], [1, 0, 0, 0, 1, 1], [1, 2, 1], None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_col2im_is_the_adjoint_of_im2col(name):
    """<im2col(X), Y> = <X, Col2Im(Y)> for every X and Y: checked with random ones."""
    channels, image, block, pads, strides, dilations = CASES[name]
    model, y = col2im_model(channels, image, block, pads, strides, dilations)
    nsp = len(image)
    pads, strides = pads or [0] * (2 * nsp), strides or [1] * nsp
    dilations = dilations or [1] * nsp
    archive = compiler_core.compile(model)
    assert archive.manifest["verification"]["passed"]
    folded = load(archive).run({"x": y})["y"]
    x = RNG.standard_normal(folded.shape).astype(np.float64)
    columns = im2col(x, block, pads, strides, dilations)
    left = float(np.sum(columns * y.astype(np.float64)))
    right = float(np.sum(x * folded.astype(np.float64)))
    assert abs(left - right) <= 1e-4 * max(abs(left), 1.0), (left, right)


@pytest.mark.parametrize("name", ["2d_plain", "2d_pads_strides", "2d_dilations"])
def test_col2im_matches_onnxruntime(name):
    model, x = col2im_model(*CASES[name])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = session.run(["y"], {"x": x})[0]
    assert_close_to_scale(load(compiler_core.compile(model)).run({"x": x})["y"], expected)


def test_blocks_that_do_not_match_the_image_are_a_clear_error():
    model, _ = col2im_model(3, [6, 7], [2, 3])
    # One block too many for a 6x7 image of 2x3 blocks (5 x 5 = 25 of them).
    model.graph.input[0].type.tensor_type.shape.dim[2].dim_value = 26
    model.graph.output[0].type.tensor_type.shape.Clear()
    with pytest.raises(ShapeError, match=r"26 blocks, but \[2, 3\] blocks fit \[5, 5\]"):
        import_model(model)


def test_an_image_shape_computed_at_run_time_is_a_clear_error():
    model, _ = col2im_model(3, [6, 7], [2, 3])
    del model.graph.initializer[0]  # image_shape becomes an input
    model.graph.input.append(helper.make_tensor_value_info("image", TensorProto.INT64, [2]))
    with pytest.raises(NotConstantError, match="Col2Im image_shape"):
        import_model(model)
