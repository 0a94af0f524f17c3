"""Each pass against the reference executor: the output graph computes what the input did,
and has the expected shape (Before/Expected)."""

from __future__ import annotations

import math

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper

import compiler_core
from compiler_core.frontend.onnx import import_model
from compiler_core.graph.verify import verify
from compiler_core.passes import (
    eliminate_common_subexpressions,
    eliminate_dead_code,
    eliminate_identity,
    fold_constants,
    simplify_inference,
)
from compiler_core.passes.pipeline import PASS_NAMES, optimize, stages
from compiler_core.reference import run_graph
from compiler_core.runtime import load
from tests.conftest import FLOAT, assert_close_to_scale, make_model, shared_model

RNG = np.random.default_rng(7)


def rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def feeds_for(graph):
    return {n: rand(*graph.types[n].shape) for n in graph.inputs}


def assert_same_function(before, after, rtol=1e-5, atol=1e-6):
    verify(after)
    feeds = feeds_for(before)
    expected, actual = run_graph(before, feeds), run_graph(after, feeds)
    assert list(after.outputs) == list(before.outputs), "output names must survive passes"
    for name in before.outputs:
        np.testing.assert_allclose(actual[name], expected[name], rtol=rtol, atol=atol)


def conv_bn_model():
    channels = 4
    return make_model(
        [
            helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
            helper.make_node(
                "BatchNormalization", ["c", "s", "o", "m", "v"], ["y"], name="bn", epsilon=1e-3
            ),
        ],
        [("x", FLOAT, [1, 3, 8, 8])],
        [("y", FLOAT, [1, channels, 8, 8])],
        {
            "w": rand(channels, 3, 3, 3),
            "b": rand(channels),
            "s": rand(channels),
            "o": rand(channels),
            "m": rand(channels),
            "v": np.abs(rand(channels)) + 0.5,
        },
    )


def test_batchnorm_folds_into_conv():
    before = import_model(conv_bn_model())
    after = simplify_inference.run(before)
    assert after.op_histogram() == {"Conv": 1}
    assert_same_function(before, after)


def test_batchnorm_folds_into_gemm():
    model = make_model(
        [
            helper.make_node("Gemm", ["x", "w", "b"], ["g"], name="fc", transB=1, alpha=0.5),
            helper.make_node("BatchNormalization", ["g", "s", "o", "m", "v"], ["y"], name="bn"),
        ],
        [("x", FLOAT, [2, 5])],
        [("y", FLOAT, [2, 3])],
        {
            "w": rand(3, 5),
            "b": rand(3),
            "s": rand(3),
            "o": rand(3),
            "m": rand(3),
            "v": np.abs(rand(3)) + 0.5,
        },
    )
    before = import_model(model)
    after = simplify_inference.run(before)
    assert after.op_histogram() == {"Gemm": 1}
    assert_same_function(before, after)


def test_standalone_batchnorm_becomes_mul_add():
    model = make_model(
        [
            helper.make_node("Relu", ["x"], ["r"], name="relu"),
            helper.make_node("BatchNormalization", ["r", "s", "o", "m", "v"], ["y"], name="bn"),
        ],
        [("x", FLOAT, [1, 3, 4, 4])],
        [("y", FLOAT, [1, 3, 4, 4])],
        {"s": rand(3), "o": rand(3), "m": rand(3), "v": np.abs(rand(3)) + 0.5},
    )
    before = import_model(model)
    after = simplify_inference.run(before)
    assert after.op_histogram() == {"Add": 1, "Mul": 1, "Relu": 1}
    assert_same_function(before, after)


@pytest.mark.parametrize(
    ("op", "constant", "survives"),
    [
        ("Mul", 1.0, False),
        ("Add", 0.0, False),
        ("Sub", 0.0, False),
        ("Div", 1.0, False),
        ("Mul", 2.0, True),
    ],
)
def test_neutral_arithmetic_is_removed(op, constant, survives):
    model = make_model(
        [
            helper.make_node("Relu", ["x"], ["r"], name="relu"),
            helper.make_node(op, ["r", "k"], ["y"], name="arith"),
        ],
        [("x", FLOAT, [2, 3])],
        [("y", FLOAT, [2, 3])],
        {"k": np.full((3,), constant, np.float32)},
    )
    before = import_model(model)
    after = eliminate_dead_code.run(simplify_inference.run(before))
    assert (op in after.op_histogram()) == survives
    assert_same_function(before, after)


def test_neutral_arithmetic_that_broadcasts_is_kept():
    model = make_model(
        [helper.make_node("Mul", ["x", "k"], ["y"], name="arith")],
        [("x", FLOAT, [3])],
        [("y", FLOAT, [2, 3])],
        {"k": np.ones((2, 3), np.float32)},
    )
    before = import_model(model)
    after = simplify_inference.run(before)
    assert after.op_histogram() == {"Mul": 1}


def test_reshape_of_reshape_and_transpose_of_transpose_compose():
    model = make_model(
        [
            helper.make_node("Reshape", ["x", "s1"], ["a"], name="r1"),
            helper.make_node("Reshape", ["a", "s2"], ["b"], name="r2"),
            helper.make_node("Transpose", ["b"], ["c"], name="t1", perm=[1, 0, 2]),
            helper.make_node("Transpose", ["c"], ["y"], name="t2", perm=[0, 2, 1]),
        ],
        [("x", FLOAT, [4, 6])],
        [("y", FLOAT, [3, 4, 2])],
        {"s1": np.array([24], np.int64), "s2": np.array([2, 3, 4], np.int64)},
    )
    before = import_model(model)
    after = optimize(before, stop_after="eliminate_dead_code")
    assert after.op_histogram() == {"Reshape": 1, "Transpose": 1}
    assert_same_function(before, after)


def test_inverse_transposes_cancel():
    model = make_model(
        [
            helper.make_node("Transpose", ["x"], ["a"], name="t1", perm=[1, 2, 0]),
            helper.make_node("Transpose", ["a"], ["b"], name="t2", perm=[2, 0, 1]),
            helper.make_node("Relu", ["b"], ["y"], name="relu"),
        ],
        [("x", FLOAT, [2, 3, 4])],
        [("y", FLOAT, [2, 3, 4])],
    )
    before = import_model(model)
    after = optimize(before, stop_after="eliminate_dead_code")
    assert after.op_histogram() == {"Relu": 1}
    assert_same_function(before, after)


def test_constant_folding_matches_reference():
    model = make_model(
        [
            helper.make_node("Transpose", ["w"], ["wt"], name="t", perm=[1, 0]),
            helper.make_node("Mul", ["wt", "k"], ["ws"], name="scale"),
            helper.make_node("MatMul", ["x", "ws"], ["y"], name="mm"),
        ],
        [("x", FLOAT, [2, 4])],
        [("y", FLOAT, [2, 3])],
        {"w": rand(3, 4), "k": np.float32(2.0)},
    )
    before = import_model(model)
    after = fold_constants.run(before)
    assert after.op_histogram() == {"MatMul": 1}
    folded = after.constants[after.nodes[0].inputs[1]]
    np.testing.assert_array_equal(folded, before.constants["w"].T * 2.0)
    assert_same_function(before, after)


def test_constant_folding_reaches_graph_outputs():
    model = make_model(
        [helper.make_node("Shape", ["x"], ["y"], name="shape")],
        [("x", FLOAT, [2, 5])],
        [("y", helper.TensorProto.INT64, [2])],
    )
    after = fold_constants.run(import_model(model))
    assert not after.nodes
    assert after.constants["y"].tolist() == [2, 5]


def test_encoder_shape_arithmetic_is_gone():
    graph = optimize(import_model(shared_model("encoder4")))
    ops = graph.op_histogram()
    for op in ("Shape", "Concat", "Cast", "Mod", "ConstantOfShape", "Identity"):
        assert op not in ops, f"{op} survived the pipeline: {ops}"
    for node in graph.nodes:
        if node.op == "Gather":
            assert graph.types[node.inputs[0]].dtype == "float32", "Gather on a shape survived"


def test_resnet18_has_no_batchnorm_or_identity_after_pipeline():
    graph = optimize(import_model(shared_model("resnet18")))
    assert "BatchNormalization" not in graph.op_histogram()
    assert "Identity" not in graph.op_histogram()


def test_common_subexpressions_merge():
    model = make_model(
        [
            helper.make_node("Relu", ["x"], ["a"], name="relu1"),
            helper.make_node("Relu", ["x"], ["b"], name="relu2"),
            helper.make_node("Add", ["a", "k1"], ["c"], name="add1"),
            helper.make_node("Add", ["b", "k2"], ["d"], name="add2"),
            helper.make_node("Mul", ["c", "d"], ["y"], name="mul"),
        ],
        [("x", FLOAT, [4])],
        [("y", FLOAT, [4])],
        {"k1": np.arange(4, dtype=np.float32), "k2": np.arange(4, dtype=np.float32)},
    )
    before = import_model(model)
    after = eliminate_dead_code.run(eliminate_common_subexpressions.run(before))
    assert after.op_histogram() == {"Add": 1, "Mul": 1, "Relu": 1}
    assert_same_function(before, after)


def test_dead_code_is_dropped():
    model = make_model(
        [
            helper.make_node("Relu", ["x"], ["y"], name="used"),
            helper.make_node("Exp", ["x"], ["unused"], name="dead"),
        ],
        [("x", FLOAT, [4])],
        [("y", FLOAT, [4])],
    )
    after = eliminate_dead_code.run(import_model(model))
    assert [n.name for n in after.nodes] == ["used"]


def test_identity_elimination_keeps_output_names():
    model = make_model(
        [
            helper.make_node("Relu", ["x"], ["r"], name="relu"),
            helper.make_node("Identity", ["r"], ["y"], name="id1"),
            helper.make_node("Identity", ["x"], ["z"], name="id2"),
        ],
        [("x", FLOAT, [4])],
        [("y", FLOAT, [4]), ("z", FLOAT, [4])],
    )
    before = import_model(model)
    after = eliminate_identity.run(before)
    # y is produced by the Relu directly; z must stay a copy of the input x.
    assert after.producers["y"].op == "Relu"
    assert after.producers["z"].op == "Identity"
    assert_same_function(before, after)


def test_pipeline_stages_can_be_dumped_by_name():
    graph = import_model(conv_bn_model())
    names = [name for name, _ in stages(graph)]
    assert names == ["import", *PASS_NAMES]
    with pytest.raises(ValueError, match="unknown pass"):
        optimize(graph, stop_after="no_such_pass")


def projection_then(nodes, constants, half: float = 0.5):
    """x [3, 8] -> MatMul + bias (h [3, 6]), then `nodes`, which compute y from h with
    `constants`, `one` and `half`."""
    return make_model(
        [
            helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
            helper.make_node("Add", ["m", "b"], ["h"], name="bias"),
            *nodes,
        ],
        [("x", FLOAT, [3, 8])],
        [("y", FLOAT, [3, 6])],
        {
            "w": rand(8, 6),
            "b": rand(6),
            "one": np.float32(1.0),
            "half": np.float32(half),
            **constants,
        },
    )


def gelu_model(spelling: str, half: float = 0.5, scale: float = math.sqrt(2.0)):
    """MatMul + bias, then GELU spelled out as exporters write it (`spelling` picks the
    order of the products and the form of the scaling)."""
    if spelling == "div":  # PyTorch's nn.GELU: x * 0.5 * (1 + erf(x / sqrt(2)))
        nodes = [
            helper.make_node("Div", ["h", "c"], ["d"], name="div"),
            helper.make_node("Erf", ["d"], ["e"], name="erf"),
            helper.make_node("Add", ["e", "one"], ["p"], name="plus"),
            helper.make_node("Mul", ["h", "p"], ["q"], name="mul"),
            helper.make_node("Mul", ["q", "half"], ["y"], name="half_of"),
        ]
        constants = {"c": np.float32(scale)}
    else:  # 0.5 * x first, erf(x * sqrt(1/2)), 1 on the left
        nodes = [
            helper.make_node("Mul", ["half", "h"], ["hx"], name="half_x"),
            helper.make_node("Mul", ["h", "c"], ["d"], name="scale"),
            helper.make_node("Erf", ["d"], ["e"], name="erf"),
            helper.make_node("Add", ["one", "e"], ["p"], name="plus"),
            helper.make_node("Mul", ["hx", "p"], ["y"], name="mul"),
        ]
        constants = {"c": np.float32(1.0 / scale)}
    return projection_then(nodes, constants, half)


def assert_one_gelu_in_the_gemm_epilogue(model, approximate: str) -> None:
    """The spelled-out GELU of `model` is one Gelu node of that approximation, the same
    function, in the GEMM's group; compiled, it matches ONNX Runtime."""
    before = import_model(model)
    after = eliminate_dead_code.run(simplify_inference.run(before))
    assert after.op_histogram() == {"Add": 1, "Gelu": 1, "MatMul": 1}
    (gelu,) = [n for n in after.nodes if n.op == "Gelu"]
    assert gelu.attr("approximate") == approximate
    assert_same_function(before, after)
    fused = optimize(before)
    ops = [[fused.node_by_name[n].op for n in g.nodes] for g in fused.groups]
    assert ops == [["MatMul", "Add", "Gelu"]]
    module = load(compiler_core.compile(model))
    feeds = {"x": rand(3, 8)}
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert_close_to_scale(module.run(feeds)["y"], session.run(["y"], feeds)[0])


@pytest.mark.parametrize("spelling", ["div", "mul"])
def test_spelled_out_gelu_becomes_one_node_in_the_gemm_epilogue(spelling):
    assert_one_gelu_in_the_gemm_epilogue(gelu_model(spelling), "none")


def tanh_gelu_model(cube: str, beta: float = math.sqrt(2 / math.pi), kappa: float = 0.044715):
    """MatMul + bias, then GELU's tanh approximation as GPT-2 / PyTorch (approximate="tanh",
    before opset 20) export it: x * 0.5 * (1 + tanh(beta * (x + kappa * x^3))), the cube a
    Pow (`cube="pow"`) or a product (`"mul"`, kappa on the right, the sum's terms swapped)."""
    if cube == "pow":
        nodes = [
            helper.make_node("Pow", ["h", "three"], ["h3"], name="cube"),
            helper.make_node("Mul", ["kappa", "h3"], ["k3"], name="kappa_x3"),
            helper.make_node("Add", ["h", "k3"], ["s"], name="sum"),
        ]
    else:
        nodes = [
            helper.make_node("Mul", ["h", "h"], ["h2"], name="square"),
            helper.make_node("Mul", ["h2", "h"], ["h3"], name="cube"),
            helper.make_node("Mul", ["h3", "kappa"], ["k3"], name="kappa_x3"),
            helper.make_node("Add", ["k3", "h"], ["s"], name="sum"),
        ]
    nodes += [
        helper.make_node("Mul", ["beta", "s"], ["t"], name="beta_sum"),
        helper.make_node("Tanh", ["t"], ["e"], name="tanh"),
        helper.make_node("Add", ["e", "one"], ["p"], name="plus"),
        helper.make_node("Mul", ["h", "half"], ["hx"], name="half_x"),
        helper.make_node("Mul", ["hx", "p"], ["y"], name="mul"),
    ]
    constants = {"beta": np.float32(beta), "kappa": np.float32(kappa), "three": np.float32(3)}
    return projection_then(nodes, constants)


@pytest.mark.parametrize("cube", ["pow", "mul"])
def test_gelus_tanh_approximation_becomes_one_tanh_gelu_in_the_gemm_epilogue(cube):
    assert_one_gelu_in_the_gemm_epilogue(tanh_gelu_model(cube), "tanh")


@pytest.mark.parametrize(("beta", "kappa"), [(0.8, 0.044715), (math.sqrt(2 / math.pi), 0.05)])
def test_a_tanh_product_with_other_constants_stays_spelled_out(beta, kappa):
    before = import_model(tanh_gelu_model("pow", beta=beta, kappa=kappa))
    after = eliminate_dead_code.run(simplify_inference.run(before))
    assert "Gelu" not in after.op_histogram()
    assert_same_function(before, after)


@pytest.mark.parametrize(("half", "scale"), [(0.4, math.sqrt(2.0)), (0.5, 1.5)])
def test_a_product_that_is_not_gelu_stays_spelled_out(half, scale):
    before = import_model(gelu_model("div", half=half, scale=scale))
    after = eliminate_dead_code.run(simplify_inference.run(before))
    assert "Gelu" not in after.op_histogram()
    assert_same_function(before, after)


def pow_model(exponent, x_shape=(4, 8), exponent_shape=()):
    node = helper.make_node("Pow", ["x", "e"], ["y"], name="power")
    y_shape = list(np.broadcast_shapes(x_shape, exponent_shape))
    constants = {"e": np.full(exponent_shape, exponent, np.float32)}
    return make_model(
        [node], [("x", FLOAT, list(x_shape))], [("y", FLOAT, y_shape)], initializers=constants
    )


@pytest.mark.parametrize(
    ("exponent", "ops"), [(2, {"Mul": 1}), (3, {"Mul": 2}), (-1, {"Reciprocal": 1}), (1, {})]
)
def test_a_pow_by_a_small_whole_constant_is_spelled_out(exponent, ops):
    """The exponent is a weight loaded at run time: as a Pow, every lane called powf."""
    before = import_model(pow_model(float(exponent)))
    after = eliminate_dead_code.run(simplify_inference.run(before))
    histogram = {op: n for op, n in after.op_histogram().items() if op != "Identity"}
    assert histogram == ops
    assert_same_function(before, after)
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    native = load(compiler_core.compile(pow_model(float(exponent)).SerializeToString()))
    np.testing.assert_allclose(native.run({"x": x})["y"], x.astype(np.float64) ** exponent,
                               rtol=3e-7)  # fmt: skip


@pytest.mark.parametrize(("exponent", "exponent_shape"), [(1.7, ()), (0.5, ()), (2, (1, 1, 1))])
def test_a_pow_that_is_not_a_small_whole_power_of_its_own_shape_stays(exponent, exponent_shape):
    """A fractional exponent (0.5 as Sqrt would differ at -0 and -inf), or an exponent
    that broadcasts the result to another shape, stays a Pow."""
    before = import_model(pow_model(float(exponent), exponent_shape=exponent_shape))
    after = simplify_inference.run(before)
    assert after.op_histogram() == {"Pow": 1}
