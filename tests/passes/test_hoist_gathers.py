"""hoist_gathers: a Gather of constant indices moves above the row-wise ops that feed it,
checked against the reference executor (same function), by the shapes the ops then compute,
and compiled against ONNX Runtime."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from compiler_core.frontend.onnx import import_model
from compiler_core.passes import eliminate_dead_code, hoist_gathers
from compiler_core.passes.pipeline import optimize
from compiler_core.target import host_target
from tests.conftest import FLOAT, make_model, shared_model
from tests.passes.test_passes import assert_same_function
from tests.passes.test_views import check_compiled

RNG = np.random.default_rng(5)


def rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def hoisted(model):
    before = import_model(model)
    after = eliminate_dead_code.run(hoist_gathers.run(before))
    assert_same_function(before, after)
    return after


def input_rows(graph, op):
    """The shape of the first input of each `op` node."""
    return [graph.types[n.inputs[0]].shape for n in graph.nodes if n.op == op]


def classifier_head(index, sequence=6, width=8):
    """A token of an encoder's last layer: MatMul + bias -> GELU-like x * erf(x) (x read
    twice) -> LayerNorm -> Gather(token, axis=1) -> Gemm."""
    return make_model(
        [
            helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
            helper.make_node("Add", ["m", "b"], ["h"], name="bias"),
            helper.make_node("Erf", ["h"], ["e"], name="erf"),
            helper.make_node("Mul", ["h", "e"], ["g"], name="gelu"),
            helper.make_node("LayerNormalization", ["g", "s", "o"], ["n"], name="ln", axis=-1),
            helper.make_node("Gather", ["n", "i"], ["t"], name="token", axis=1),
            helper.make_node("Gemm", ["t", "wh", "bh"], ["y"], name="head", transB=1),
        ],
        [("x", FLOAT, [1, sequence, width])],
        [("y", FLOAT, [1, 3])],
        {
            "w": rand(width, width),
            "b": rand(width),
            "s": rand(width),
            "o": rand(width),
            "i": np.array(index, np.int64),
            "wh": rand(3, width),
            "bh": rand(3),
        },
    )


@pytest.mark.parametrize("index", [0, -1])
def test_a_classifier_computes_only_the_token_it_reads(index):
    model = classifier_head(index)
    graph = hoisted(model)
    # The Gather reached the input: the MatMul, activation and LayerNorm run on one row.
    assert input_rows(graph, "MatMul") == [(1, 1, 8)]
    assert input_rows(graph, "LayerNormalization") == [(1, 1, 8)]
    assert graph.producers[next(n for n in graph.nodes if n.op == "MatMul").inputs[0]].op == (
        "Gather"
    )
    check_compiled(model, {"x": rand(1, 6, 8)})


def sliced_head(starts, ends, steps, sequence=6, width=8):
    """An encoder's last layer read through a Slice of its tokens (`x[:, start:end:step]`),
    then a Gemm per kept token."""
    kept = len(range(*slice(starts, ends, steps).indices(sequence)))
    return make_model(
        [
            helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
            helper.make_node("Add", ["m", "b"], ["h"], name="bias"),
            helper.make_node("Relu", ["h"], ["r"], name="relu"),
            helper.make_node("Slice", ["r", "st", "en", "ax", "sp"], ["t"], name="tokens"),
            helper.make_node("MatMul", ["t", "wh"], ["y"], name="head"),
        ],
        [("x", FLOAT, [1, sequence, width])],
        [("y", FLOAT, [1, kept, 3])],
        {
            "w": rand(width, width),
            "b": rand(width),
            "st": np.array([starts], np.int64),
            "en": np.array([ends], np.int64),
            "ax": np.array([1], np.int64),
            "sp": np.array([steps], np.int64),
            "wh": rand(width, 3),
        },
    )


@pytest.mark.parametrize(
    ("starts", "ends", "steps", "rows"),
    [(0, 1, 1, 1), (-1, 6, 1, 1), (0, 6, 2, 3), (5, -7, -2, 3)],
    ids=["first", "last", "every-other", "reversed"],
)
def test_a_slice_of_tokens_moves_up_like_a_gather(starts, ends, steps, rows):
    model = sliced_head(starts, ends, steps)
    graph = hoisted(model)
    # The projection, its bias and activation run on the kept tokens alone.
    assert input_rows(graph, "MatMul")[0] == (1, rows, 8)
    assert "Slice" not in {n.op for n in graph.nodes}
    check_compiled(model, {"x": rand(1, 6, 8)})


def test_a_slice_that_cannot_move_stays_a_slice():
    """Sliced along the axis a Softmax normalizes: it stays where it is, a Slice."""
    model = make_model(
        [
            helper.make_node("Softmax", ["x"], ["p"], name="softmax", axis=-1),
            helper.make_node("Slice", ["p", "st", "en", "ax"], ["y"], name="cut"),
        ],
        [("x", FLOAT, [2, 5])],
        [("y", FLOAT, [2, 2])],
        {"st": np.array([1], np.int64), "en": np.array([3], np.int64), "ax": np.array([1])},
    )
    graph = hoisted(model)
    assert [n.op for n in graph.nodes] == ["Softmax", "Slice"]


def test_a_gather_along_the_normalized_axis_stays():
    model = make_model(
        [
            helper.make_node("Softmax", ["x"], ["p"], name="softmax", axis=-1),
            helper.make_node("Gather", ["p", "i"], ["y"], name="pick", axis=1),
        ],
        [("x", FLOAT, [2, 5])],
        [("y", FLOAT, [2, 2])],
        {"i": np.array([0, 3], np.int64)},
    )
    graph = hoisted(model)
    assert [n.op for n in graph.nodes] == ["Softmax", "Gather"]


def test_a_value_something_else_reads_is_computed_whole():
    model = make_model(
        [
            helper.make_node("Relu", ["x"], ["r"], name="relu"),
            helper.make_node("Gather", ["r", "i"], ["y1"], name="pick", axis=0),
            helper.make_node("Neg", ["r"], ["y2"], name="neg"),
        ],
        [("x", FLOAT, [4, 3])],
        [("y1", FLOAT, [2, 3]), ("y2", FLOAT, [4, 3])],
        {"i": np.array([1, 2], np.int64)},
    )
    graph = hoisted(model)
    assert input_rows(graph, "Relu") == [(4, 3)]


def test_rows_move_through_transposes_reshapes_and_attention():
    """One query row of attention: softmax(q k^T) v, its heads merged by a Transpose and a
    Reshape, then a Gemm; the Gather of row 2 ends on q (k and v stay whole)."""
    heads, sequence, dim = 2, 5, 4
    model = make_model(
        [
            helper.make_node("Transpose", ["k"], ["kt"], name="kt", perm=[0, 2, 1]),
            helper.make_node("MatMul", ["q", "kt"], ["s"], name="qk"),
            helper.make_node("Softmax", ["s"], ["p"], name="softmax", axis=-1),
            helper.make_node("MatMul", ["p", "v"], ["a"], name="av"),
            helper.make_node("Transpose", ["a"], ["at"], name="merge", perm=[1, 0, 2]),
            helper.make_node("Reshape", ["at", "flat"], ["af"], name="flat"),
            helper.make_node("Gemm", ["af", "w", "c"], ["o"], name="proj", transB=1),
            helper.make_node("Gather", ["o", "i"], ["y"], name="row", axis=0),
        ],
        [(name, FLOAT, [heads, sequence, dim]) for name in "qkv"],
        [("y", FLOAT, [heads * dim])],
        {
            "flat": np.array([sequence, heads * dim], np.int64),
            "w": rand(heads * dim, heads * dim),
            "c": rand(sequence, heads * dim),  # a bias with rows: gathered too
            "i": np.array(2, np.int64),
        },
    )
    graph = hoisted(model)
    assert input_rows(graph, "Softmax") == [(heads, 1, sequence)]
    assert input_rows(graph, "Gemm") == [(1, heads * dim)]
    feeds = {name: rand(heads, sequence, dim) for name in "qkv"}
    check_compiled(model, feeds)


def test_the_shared_encoder_runs_its_last_layer_on_the_token_it_classifies():
    graph = optimize(import_model(str(shared_model("encoder4"))), target=host_target())
    rows = [shape[-2] for shape in input_rows(graph, "MatMul")]
    # Each layer's feed-forward pair: 128 rows in layers 0-2, one in layer 3.
    assert rows.count(1) >= 3 and rows.count(128) >= 3 * 4
