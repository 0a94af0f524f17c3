"""split_gemm_columns: a fused projection whose readers each take one column range, one of
them fewer rows, becomes one GEMM per range, and the next hoist_gathers computes the narrow
reader's rows alone; checked against the reference executor (same function), by the shapes
the GEMMs then compute, and compiled against ONNX Runtime."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from compiler_core.frontend.onnx import import_model
from compiler_core.passes import eliminate_dead_code, hoist_gathers, split_gemm_columns
from compiler_core.passes.pipeline import optimize
from tests.conftest import FLOAT, make_model
from tests.passes.test_passes import assert_same_function
from tests.passes.test_views import check_compiled

RNG = np.random.default_rng(9)
TOKENS, WIDTH, HEADS = 6, 8, 3  # a [6, 8] input, a projection to 3 x 8 columns


def rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def qkv_model(query_rows: str = "one", mixed: bool = False):
    """x @ W + b, viewed as [3, tokens, width] (Reshape, Transpose: the exporter's QKV split)
    and each part taken by a Gather; the queries of one token (`query_rows="one"`) or of all,
    scores = q @ k^T, out = scores @ v. With `mixed`, another reader adds the projection
    to itself reversed along its columns (it reads every column)."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["m"], name="qkv"),
        helper.make_node("Add", ["m", "b"], ["y"], name="qkv_bias"),
        helper.make_node("Reshape", ["y", "split_shape"], ["r"], name="split"),
        helper.make_node("Transpose", ["r"], ["t"], name="parts", perm=[1, 0, 2]),
        helper.make_node("Gather", ["t", "zero"], ["q_all"], name="q", axis=0),
        helper.make_node("Gather", ["t", "one"], ["k"], name="k", axis=0),
        helper.make_node("Gather", ["t", "two"], ["v"], name="v", axis=0),
    ]
    if query_rows == "one":
        nodes.append(helper.make_node("Gather", ["q_all", "token"], ["q"], name="token", axis=0))
    else:
        nodes.append(helper.make_node("Identity", ["q_all"], ["q"], name="all_tokens"))
    nodes += [
        helper.make_node("Transpose", ["k"], ["kt"], name="k_t", perm=[1, 0]),
        helper.make_node("MatMul", ["q", "kt"], ["s"], name="scores"),
        helper.make_node("MatMul", ["s", "v"], ["o"], name="out"),
    ]
    outputs = [("o", FLOAT, [1 if query_rows == "one" else TOKENS, WIDTH])]
    if mixed:
        nodes.append(helper.make_node("Add", ["y", "y"], ["twice"], name="mixed"))
        outputs.append(("twice", FLOAT, [TOKENS, HEADS * WIDTH]))
    return make_model(
        nodes,
        [("x", FLOAT, [TOKENS, WIDTH])],
        outputs,
        {
            "w": rand(WIDTH, HEADS * WIDTH),
            "b": rand(HEADS * WIDTH),
            "split_shape": np.array([TOKENS, HEADS, WIDTH], np.int64),
            "zero": np.array(0, np.int64),
            "one": np.array(1, np.int64),
            "two": np.array(2, np.int64),
            "token": np.array([0], np.int64),
        },
    )


def split_then_hoisted(model):
    before = hoist_gathers.run(import_model(model))
    after = eliminate_dead_code.run(hoist_gathers.run(split_gemm_columns.run(before)))
    assert_same_function(before, after)
    return after


def projections(graph) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(A's shape, B's shape) of every MatMul by a constant."""
    return [
        (graph.types[n.inputs[0]].shape, graph.types[n.inputs[1]].shape)
        for n in graph.nodes
        if n.op == "MatMul" and n.inputs[1] in graph.constants
    ]


def test_the_queries_of_one_token_get_a_one_row_gemm_of_their_own():
    model = qkv_model("one")
    graph = split_then_hoisted(model)
    assert sorted(projections(graph)) == [
        ((1, WIDTH), (WIDTH, WIDTH)),  # the queries: one token
        ((TOKENS, WIDTH), (WIDTH, WIDTH)),  # keys and values: every token
        ((TOKENS, WIDTH), (WIDTH, WIDTH)),
    ]
    check_compiled(model, {"x": rand(TOKENS, WIDTH)})


@pytest.mark.parametrize(
    ("query_rows", "mixed"),
    [("all", False), ("one", True)],
    ids=["every-reader-reads-every-row", "a-reader-reads-every-column"],
)
def test_a_projection_stays_whole_when_splitting_saves_nothing_or_cannot(query_rows, mixed):
    model = qkv_model(query_rows, mixed)
    graph = split_then_hoisted(model)
    assert projections(graph) == [((TOKENS, WIDTH), (WIDTH, HEADS * WIDTH))]
    check_compiled(model, {"x": rand(TOKENS, WIDTH)})


def test_the_pipeline_splits_and_fuses_the_parts():
    graph = optimize(import_model(qkv_model("one")))
    assert sorted(projections(graph))[0] == ((1, WIDTH), (WIDTH, WIDTH))
