"""Reshapes map shared leading and trailing dimensions straight through (only the part between
them goes through a flat index), and a channel shuffle (Concat -> Reshape -> Transpose ->
Reshape -> Slice, ShuffleNet's) compiles to a kernel whose rows are plain unit-stride loops;
every case compared with numpy through native code."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import compiler_core
from compiler_core.kernels.injective import reshape_index
from compiler_core.loop.ir import Binary, Var
from compiler_core.loop.transform import walk_exprs
from compiler_core.runtime import load
from tests.conftest import FLOAT, make_model

RNG = np.random.default_rng(5)

PAIRS = [
    ((1, 116, 28, 28), (1, 2, 58, 28, 28)),  # split a channel axis
    ((1, 58, 2, 28, 28), (1, 116, 28, 28)),  # merge it back
    ((2, 3, 4, 5), (2, 3, 4, 5)),  # identity
    ((6, 4), (3, 8)),  # nothing shared
    ((1, 1, 5), (5,)),  # unit axes dropped
    ((5,), (1, 5, 1)),  # and added
    ((4, 6, 10), (4, 2, 3, 2, 5)),  # both middle parts split
    ((3, 4, 4), (3, 16)),  # trailing axes merged
]


@pytest.mark.parametrize(("in_shape", "out_shape"), PAIRS)
def test_reshape_matches_numpy(in_shape, out_shape):
    shape = helper.make_tensor("s", TensorProto.INT64, [len(out_shape)], list(out_shape))
    node = helper.make_node("Reshape", ["x", "s"], ["y"])
    model = make_model([node], [("x", FLOAT, list(in_shape))], [("y", FLOAT, list(out_shape))])
    model.graph.initializer.append(shape)
    x = RNG.standard_normal(in_shape).astype(np.float32)
    actual = load(compiler_core.compile(model)).run({"x": x})["y"]
    np.testing.assert_array_equal(actual, x.reshape(out_shape))


def test_shared_trailing_axes_need_no_division():
    h, w = Var("h"), Var("w")
    index = reshape_index(
        (Var("n"), Var("c1"), Var("c2"), h, w), (1, 2, 58, 28, 28), (1, 116, 28, 28)
    )
    assert index[-2:] == (h, w)
    ops = {e.op for e in walk_exprs(index[1]) if isinstance(e, Binary)}
    assert not ops & {"floordiv", "mod"}, index[1]


def channel_shuffle():
    """Concat(a, b) -> [1, 2, 10, 7, 9] -> transpose(0, 2, 1, 3, 4) -> [1, 20, 7, 9] -> two
    Slices of 10 channels, each through a Relu (so both halves are kernel outputs)."""
    ints = TensorProto.INT64
    nodes = [
        helper.make_node("Concat", ["a", "b"], ["c"], axis=1),
        helper.make_node("Reshape", ["c", "s1"], ["r"]),
        helper.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 1, 3, 4]),
        helper.make_node("Reshape", ["t", "s2"], ["u"]),
        helper.make_node("Slice", ["u", "zero", "ten", "channels", "one"], ["p"]),
        helper.make_node("Slice", ["u", "ten", "twenty", "channels", "one"], ["q"]),
        helper.make_node("Relu", ["p"], ["y0"]),
        helper.make_node("Relu", ["q"], ["y1"]),
    ]
    model = make_model(
        nodes,
        [("a", FLOAT, [1, 10, 7, 9]), ("b", FLOAT, [1, 10, 7, 9])],
        [("y0", FLOAT, [1, 10, 7, 9]), ("y1", FLOAT, [1, 10, 7, 9])],
    )
    consts = {"s1": [1, 2, 10, 7, 9], "s2": [1, 20, 7, 9], "zero": [0], "ten": [10]}
    consts |= {"twenty": [20], "channels": [1], "one": [1]}
    for name, values in consts.items():
        model.graph.initializer.append(helper.make_tensor(name, ints, [len(values)], values))
    return model


def test_channel_shuffle_matches_numpy():
    model = channel_shuffle()
    a, b = (RNG.standard_normal((1, 10, 7, 9)).astype(np.float32) for _ in range(2))
    out = load(compiler_core.compile(model)).run({"a": a, "b": b})
    shuffled = np.concatenate([a, b], 1).reshape(1, 2, 10, 7, 9).transpose(0, 2, 1, 3, 4)
    shuffled = np.maximum(shuffled.reshape(1, 20, 7, 9), 0)
    np.testing.assert_array_equal(out["y0"], shuffled[:, :10])
    np.testing.assert_array_equal(out["y1"], shuffled[:, 10:])
