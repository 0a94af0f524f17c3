"""simplify_views and clone_shared_views: each rewrite against the reference executor (the
graph computes what it did), the groups fusion then makes, and compiled models against ONNX
Runtime (PyTorch's attention block, whose QKV split and residual these passes are for)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper

import compiler_core
from compiler_core.frontend.onnx import import_model
from compiler_core.passes import clone_shared_views, simplify_views
from compiler_core.passes.pipeline import optimize
from compiler_core.runtime import load
from compiler_core.target import host_target
from tests.conftest import FLOAT, assert_close_to_scale, make_model, shared_model
from tests.passes.test_passes import assert_same_function

RNG = np.random.default_rng(11)


def rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def group_ops(graph):
    return [[graph.node_by_name[n].op for n in group.nodes] for group in graph.groups]


def ort_outputs(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))


def check_compiled(model, feeds):
    module = load(compiler_core.compile(model))
    expected = ort_outputs(model, feeds)
    actual = module.run(feeds)
    for name, value in expected.items():
        assert_close_to_scale(actual[name], value, label=name)


@pytest.mark.parametrize(
    ("shape", "perm", "becomes_reshape"),
    [
        ((1, 6, 8), (1, 0, 2), True),  # batch-first <-> sequence-first with one batch
        ((6, 1, 8, 1), (1, 3, 0, 2), True),
        ((2, 6, 8), (1, 0, 2), False),  # moves elements
        ((1, 6, 8), (0, 2, 1), False),
    ],
)
def test_a_transpose_of_axes_of_size_one_is_a_reshape(shape, perm, becomes_reshape):
    out_shape = [shape[p] for p in perm]
    model = make_model(
        [
            helper.make_node("Transpose", ["x"], ["t"], name="t", perm=list(perm)),
            helper.make_node("Relu", ["t"], ["y"], name="relu"),
        ],
        [("x", FLOAT, list(shape))],
        [("y", FLOAT, out_shape)],
    )
    before = import_model(model)
    after = simplify_views.run(before)
    expected = "Reshape" if becomes_reshape else "Transpose"
    assert after.op_histogram() == {expected: 1, "Relu": 1}
    assert_same_function(before, after)


def batched_matmul_with_bias(bias_shape, rows=5, k=8, n=6):
    """PyTorch's QKV projection: [S, 1, K] @ [K, N] + bias, which import makes a 2-D GEMM
    between two Reshapes (so the bias Add reads the second Reshape)."""
    return make_model(
        [
            helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
            helper.make_node("Add", ["b", "m"], ["y"], name="bias"),
        ],
        [("x", FLOAT, [rows, 1, k])],
        [("y", FLOAT, [rows, 1, n])],
        {"w": rand(k, n), "b": rand(*bias_shape)},
    )


@pytest.mark.parametrize("bias_shape", [(6,), (1, 1, 6), (1,)])
def test_a_bias_after_a_batched_matmul_joins_the_gemm_epilogue(bias_shape):
    model = batched_matmul_with_bias(bias_shape)
    before = import_model(model)
    after = optimize(before, target=host_target())
    assert ["MatMul", "Add"] in group_ops(after), group_ops(after)
    assert_same_function(before, after)
    check_compiled(model, {"x": rand(5, 1, 8)})


def test_a_constant_that_varies_along_a_reshaped_axis_stays_after_the_reshape():
    model = make_model(
        [
            helper.make_node("Reshape", ["x", "s"], ["r"], name="r"),
            helper.make_node("Add", ["r", "c"], ["y"], name="add"),
        ],
        [("x", FLOAT, [4, 6])],
        [("y", FLOAT, [2, 12])],
        {"s": np.array([2, 12], np.int64), "c": rand(12)},
    )
    before = import_model(model)
    after = simplify_views.run(before)
    add = next(n for n in after.nodes if n.op == "Add")
    assert after.producers[add.inputs[0]].op == "Reshape"
    assert_same_function(before, after)


def gemm_then_residual(sequence=6, width=8):
    """The attention block's output projection: Gemm -> Reshape [S, 1, E] -> Transpose to
    [1, S, E] -> Add(residual)."""
    return make_model(
        [
            helper.make_node("Gemm", ["a", "w", "b"], ["g"], name="proj", transB=1),
            helper.make_node("Reshape", ["g", "s"], ["r"], name="unflatten"),
            helper.make_node("Transpose", ["r"], ["t"], name="batch_first", perm=[1, 0, 2]),
            helper.make_node("Add", ["res", "t"], ["y"], name="residual"),
        ],
        [("a", FLOAT, [sequence, width]), ("res", FLOAT, [1, sequence, width])],
        [("y", FLOAT, [1, sequence, width])],
        {
            "w": rand(width, width),
            "b": rand(width),
            "s": np.array([sequence, 1, width], np.int64),
        },
    )


def test_a_residual_add_after_a_reshaped_gemm_joins_its_epilogue():
    model = gemm_then_residual()
    before = import_model(model)
    views = simplify_views.run(before)  # terminates: the Reshape does not move back
    assert views.op_histogram() == {"Add": 1, "Gemm": 1, "Reshape": 2}
    after = optimize(before, target=host_target())
    assert ["Gemm", "Add"] in group_ops(after), group_ops(after)
    assert_same_function(before, after)
    check_compiled(model, {"a": rand(6, 8), "res": rand(1, 6, 8)})


def test_a_reshape_sinks_through_a_layer_and_meets_its_inverse():
    """[S, E] -> [1, S, E] -> LayerNorm -> MatMul -> Relu -> [S, F]: the Reshape moves below
    each op (rows in, rows out) and cancels against the last one; no view is left."""
    sequence, width, wide = 6, 8, 12
    model = make_model(
        [
            helper.make_node("Reshape", ["x", "s3"], ["r"], name="batched"),
            helper.make_node("LayerNormalization", ["r", "g", "o"], ["n"], name="ln", axis=-1),
            helper.make_node("MatMul", ["n", "w"], ["m"], name="mm"),
            helper.make_node("Relu", ["m"], ["a"], name="relu"),
            helper.make_node("Reshape", ["a", "s2"], ["y"], name="flat"),
        ],
        [("x", FLOAT, [sequence, width])],
        [("y", FLOAT, [sequence, wide])],
        {
            "s3": np.array([1, sequence, width], np.int64),
            "s2": np.array([sequence, wide], np.int64),
            "g": rand(width),
            "o": rand(width),
            "w": rand(width, wide),
        },
    )
    before = import_model(model)
    after = optimize(before, stop_after="eliminate_identity_again")
    assert "Reshape" not in after.op_histogram(), after.op_histogram()
    assert_same_function(before, after)
    check_compiled(model, {"x": rand(sequence, width)})


def test_a_batched_matmul_is_not_made_of_a_gemm():
    """MatMul(Reshape(x), B) sinks only for a matrix x: a [S, 1, K] x would make a batch of
    one-row products (the form import turns into one GEMM)."""
    model = make_model(
        [
            helper.make_node("Reshape", ["x", "s"], ["r"], name="flat"),
            helper.make_node("MatMul", ["r", "w"], ["y"], name="mm"),
        ],
        [("x", FLOAT, [5, 1, 8])],
        [("y", FLOAT, [5, 6])],
        {"s": np.array([5, 8], np.int64), "w": rand(8, 6)},
    )
    before = import_model(model)
    after = simplify_views.run(before)
    matmul = next(n for n in after.nodes if n.op == "MatMul")
    assert after.types[matmul.inputs[0]].shape == (5, 8)


def test_two_gemms_added_behind_a_reshape_do_not_pull_it_back_and_forth():
    model = make_model(
        [
            helper.make_node("Gemm", ["a", "w1"], ["g1"], name="g1"),
            helper.make_node("Gemm", ["a", "w2"], ["g2"], name="g2"),
            helper.make_node("Reshape", ["g1", "s"], ["r"], name="r"),
            helper.make_node("Reshape", ["g2", "s"], ["r2"], name="r2"),
            helper.make_node("Add", ["r", "r2"], ["y"], name="add"),
        ],
        [("a", FLOAT, [4, 6])],
        [("y", FLOAT, [1, 4, 6])],
        {"w1": rand(6, 6), "w2": rand(6, 6), "s": np.array([1, 4, 6], np.int64)},
    )
    before = import_model(model)
    after = simplify_views.run(before)  # terminates
    assert after.op_histogram() == {"Add": 1, "Gemm": 2, "Reshape": 1}
    assert_same_function(before, after)


def qkv_split(sequence=6, heads=2, head_dim=4):
    """PyTorch's split of a packed QKV projection into heads: Reshape to [1, S, 1, 3, E],
    Transpose the 3 to the front, Squeeze, then one Gather per Q, K, V (K transposed for
    Q K^T)."""
    e = heads * head_dim
    nodes = [
        helper.make_node("Reshape", ["qkv", "s5"], ["u"], name="unsqueeze"),
        helper.make_node("Transpose", ["u"], ["t"], name="to_front", perm=[3, 1, 2, 0, 4]),
        helper.make_node("Reshape", ["t", "s4"], ["packed"], name="squeeze"),
    ]
    outputs = []
    for index, name in enumerate("qkv"):
        nodes += [
            helper.make_node("Gather", ["packed", f"i{index}"], [f"{name}g"], name=f"g{name}"),
            helper.make_node("Reshape", [f"{name}g", "heads"], [f"{name}h"], name=f"h{name}"),
            helper.make_node("Transpose", [f"{name}h"], [name], name=f"t{name}", perm=[1, 0, 2]),
        ]
        outputs.append((name, FLOAT, [heads, sequence, head_dim]))
    nodes.append(helper.make_node("Transpose", ["k"], ["kt"], name="kt", perm=[0, 2, 1]))
    nodes.append(helper.make_node("MatMul", ["q", "kt"], ["scores"], name="qk"))
    outputs = [outputs[0], outputs[2], ("scores", FLOAT, [heads, sequence, sequence])]
    constants = {
        "s5": np.array([1, sequence, 1, 3, e], np.int64),
        "s4": np.array([3, sequence, 1, e], np.int64),
        "heads": np.array([sequence, heads, head_dim], np.int64),
        **{f"i{i}": np.array(i, np.int64) for i in range(3)},
    }
    return make_model(nodes, [("qkv", FLOAT, [sequence, 3 * e])], outputs, constants)


def test_each_gather_of_a_shared_transpose_reads_the_projection_itself():
    model = qkv_split()
    before = import_model(model)
    cloned = clone_shared_views.run(optimize(before, stop_after="transform_layout"))
    assert cloned.op_histogram()["Transpose"] > before.op_histogram()["Transpose"]
    assert_same_function(before, cloned)
    after = optimize(before, target=host_target())
    ops = group_ops(after)
    # No group is the shared transpose alone: each Gather's group computes its own.
    assert all("Gather" in group for group in ops if "Transpose" in group and "MatMul" not in group)
    assert sum("Gather" in group for group in ops) == 3, ops
    assert_same_function(before, after)
    check_compiled(model, {"qkv": rand(6, 24)})


def test_a_view_read_by_a_heavy_op_is_not_cloned():
    model = make_model(
        [
            helper.make_node("Transpose", ["x"], ["t"], name="t", perm=[1, 0]),
            helper.make_node("MatMul", ["t", "w"], ["y1"], name="mm"),
            helper.make_node("Relu", ["t"], ["y2"], name="relu"),
        ],
        [("x", FLOAT, [4, 6])],
        [("y1", FLOAT, [6, 3]), ("y2", FLOAT, [6, 4])],
        {"w": rand(4, 3)},
    )
    graph = optimize(import_model(model), stop_after="transform_layout")
    assert clone_shared_views.run(graph) is graph


def test_encoder_attention_has_no_copy_kernel_before_its_head_split():
    """The shared encoder's QKV bias runs in the projection GEMM's epilogue and no kernel
    only transposes the projection for the three Gathers."""
    graph = optimize(import_model(str(shared_model("encoder4"))), target=host_target())
    ops = group_ops(graph)
    # Each layer's QKV projection and its bias; the last layer's split into its queries (of
    # the one token its classifier reads), keys and values (split_gemm_columns).
    assert ops.count(["MatMul", "Add"]) == 3 + 3
    assert ops.count(["MatMul", "Add", "Gelu"]) == 4  # and its linear1, bias and GELU
    heads = [g for g in ops if "Gather" in g and "Transpose" in g]
    assert len(heads) == 3 * 3  # Q, K and V of the first three layers
    # No kernel transposes a whole projection for its Gathers (the first layer's kernels, up
    # to its feed-forward; the last layer's value heads are copied from their own GEMM).
    first_layer = ops[: ops.index(["MatMul", "Add", "Gelu"]) + 1]
    assert ["Reshape", "Reshape", "Transpose", "Reshape"] not in first_layer
