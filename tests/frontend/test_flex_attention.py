"""ai.onnx.preview FlexAttention: without modifiers it imports as the Attention operator,
with them as the spec's stages with each modifier graph inlined; compiled natively and checked
against the ONNX reference evaluator. Malformed nodes get an error that names them."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import compiler_core
from compiler_core.frontend.common import ModelFormatError, UnsupportedError
from compiler_core.frontend.onnx import import_model
from compiler_core.runtime import load

PREVIEW = "ai.onnx.preview"
RNG = np.random.default_rng(11)


def flex_model(q_shape, k_shape, v_shape, dtype=TensorProto.FLOAT, **attrs) -> onnx.ModelProto:
    node = helper.make_node("FlexAttention", ["Q", "K", "V"], ["Y"], domain=PREVIEW, **attrs)
    out_shape = [q_shape[0], q_shape[1], q_shape[2], v_shape[3]]
    graph = helper.make_graph(
        [node],
        "flex",
        [
            helper.make_tensor_value_info(name, dtype, list(shape))
            for name, shape in (("Q", q_shape), ("K", k_shape), ("V", v_shape))
        ],
        [helper.make_tensor_value_info("Y", dtype, out_shape)],
    )
    opsets = [helper.make_opsetid("", 26), helper.make_opsetid(PREVIEW, 1)]
    return helper.make_model(graph, opset_imports=opsets)


def modifier(nodes, initializers=(), name="mod", out="out") -> onnx.GraphProto:
    """A modifier graph of one rank-4 float input `x` and one output."""
    return helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in initializers],
    )


def causal_mask() -> onnx.GraphProto:
    """Scores above the diagonal set to -inf, positions computed from the scores' shape."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "two"], ["rows"]),
        helper.make_node("Gather", ["shape", "three"], ["cols"]),
        helper.make_node("Range", ["zero", "rows", "one"], ["r"]),
        helper.make_node("Range", ["zero", "cols", "one"], ["c"]),
        helper.make_node("Unsqueeze", ["r", "axis1"], ["r2"]),
        helper.make_node("GreaterOrEqual", ["r2", "c"], ["keep"]),
        helper.make_node("Where", ["keep", "x", "ninf"], ["out"]),
    ]
    constants = [
        ("two", np.int64(2)),
        ("three", np.int64(3)),
        ("zero", np.int64(0)),
        ("one", np.int64(1)),
        ("axis1", np.array([1], np.int64)),
        ("ninf", np.float32(-np.inf)),
    ]
    return modifier(nodes, constants, "causal")


def inputs(q_shape, k_shape, v_shape, dtype=np.float32):
    return {
        name: RNG.standard_normal(shape).astype(dtype)
        for name, shape in (("Q", q_shape), ("K", k_shape), ("V", v_shape))
    }


def run_both(model, feeds):
    ours = load(compiler_core.compile(model.SerializeToString())).run(feeds)["Y"]
    (theirs,) = ReferenceEvaluator(model).run(None, feeds)
    return ours, theirs


def test_without_modifiers_it_is_one_attention_node_and_matches_the_reference_with_gqa():
    shapes = ((2, 8, 5, 16), (2, 2, 7, 16), (2, 2, 7, 12))
    model = flex_model(*shapes, scale=0.2)
    graph = import_model(model)
    assert [n.op for n in graph.nodes] == ["Attention"]
    ours, theirs = run_both(model, inputs(*shapes))
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("heads", [(4, 4), (6, 2)])
def test_a_causal_score_mod_is_inlined_and_matches_the_reference(heads):
    q_heads, kv_heads = heads
    shapes = ((1, q_heads, 6, 8), (1, kv_heads, 6, 8), (1, kv_heads, 6, 8))
    model = flex_model(*shapes, score_mod=causal_mask())
    ops = [n.op for n in import_model(model).nodes]
    assert "Attention" not in ops and "Where" in ops and "Softmax" in ops
    assert "Expand" not in ops  # grouped heads as GEMM rows: K and V are not repeated
    ours, theirs = run_both(model, inputs(*shapes))
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)
    # The first query position sees only the first key: its output is V's first row.
    feeds = inputs(*shapes)
    first = load(compiler_core.compile(model.SerializeToString())).run(feeds)["Y"][0, :, 0]
    np.testing.assert_allclose(first, np.repeat(feeds["V"][0, :, 0], q_heads // kv_heads, 0))


def test_soft_cap_and_a_prob_mod_with_an_outer_scale_match_the_reference():
    shapes = ((2, 2, 4, 8), (2, 2, 5, 8), (2, 2, 5, 8))
    soft_cap = modifier(
        [
            helper.make_node("Div", ["x", "cap"], ["s"]),
            helper.make_node("Tanh", ["s"], ["t"]),
            helper.make_node("Mul", ["t", "cap"], ["out"]),
        ],
        [("cap", np.float32(2.0))],
        "soft_cap",
    )
    halve = modifier(
        [helper.make_node("Mul", ["x", "half"], ["out"])], [("half", np.float32(0.5))], "halve"
    )
    model = flex_model(*shapes, score_mod=soft_cap, prob_mod=halve)
    ours, theirs = run_both(model, inputs(*shapes))
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)


def test_float16_inputs_compute_scores_in_float32_and_return_float16():
    shapes = ((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8))
    model = flex_model(*shapes, dtype=TensorProto.FLOAT16, score_mod=causal_mask())
    graph = import_model(model)
    softmax = next(n for n in graph.nodes if n.op == "Softmax")
    assert graph.types[softmax.outputs[0]].dtype == "float32"
    ours, theirs = run_both(model, inputs(*shapes, dtype=np.float16))
    assert ours.dtype == np.float16
    np.testing.assert_allclose(
        ours.astype(np.float32), theirs.astype(np.float32), rtol=2e-3, atol=2e-3
    )


def test_a_modifier_of_two_outputs_is_refused_by_name():
    shapes = ((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8))
    two = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["a"]), helper.make_node("Identity", ["x"], ["b"])],
        "two",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("a", "b")],
    )
    with pytest.raises(ModelFormatError, match="score_mod.*one input and gives one output"):
        import_model(flex_model(*shapes, score_mod=two))


def test_a_modifier_that_changes_the_scores_shape_is_refused():
    shapes = ((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8))
    reduce = modifier(
        [helper.make_node("ReduceSum", ["x", "axes"], ["out"], keepdims=1)],
        [("axes", np.array([3], np.int64))],
    )
    must = r"prob_mod: gives float32\[1,2,4,1\], it must give float32\[1,2,4,4\]"
    with pytest.raises(ModelFormatError, match=must):
        import_model(flex_model(*shapes, prob_mod=reduce))


def test_heads_that_do_not_group_are_refused():
    with pytest.raises(ModelFormatError, match="multiple of K's"):
        import_model(flex_model((1, 3, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8)))


def test_an_unknown_operator_of_the_preview_domain_is_still_unsupported():
    model = flex_model((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8))
    model.graph.node[0].op_type = "NoSuchAttention"
    with pytest.raises(UnsupportedError, match="ai.onnx.preview"):
        import_model(model)
