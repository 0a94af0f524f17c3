"""Optionals are decided when the graph is imported: Optional of a tensor is that tensor,
OptionalHasElement a constant, OptionalGetElement the tensor itself; an empty optional has no
value to get (a clear error). Compiled natively and checked against numpy."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import compiler_core
from compiler_core.frontend.common import KilnImportError
from compiler_core.runtime import load
from tests.conftest import FLOAT, make_model

EMPTY = helper.make_optional_type_proto(helper.make_tensor_type_proto(FLOAT, [3]))


def optional_model(empty: bool, get: bool = True):
    """x -> Optional (of x, or `empty`) -> OptionalHasElement, and OptionalGetElement + 1
    when `get`."""
    source = [] if empty else ["x"]
    nodes = [
        helper.make_node("Optional", source, ["o"], name="opt", type=EMPTY),
        helper.make_node("OptionalHasElement", ["o"], ["has"], name="has"),
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
    ]
    outputs = [("has", TensorProto.BOOL, []), ("r", FLOAT, [3])]
    if get:
        nodes += [
            helper.make_node("OptionalGetElement", ["o"], ["g"], name="get"),
            helper.make_node("Add", ["g", "one"], ["y"], name="add"),
        ]
        outputs.append(("y", FLOAT, [3]))
    return make_model(
        nodes, [("x", FLOAT, [3])], outputs, {"one": np.ones(3, np.float32)}, opset=18
    )


def test_an_optional_of_a_tensor_is_the_tensor():
    x = np.array([-1.0, 0.5, 2.0], np.float32)
    out = load(compiler_core.compile(optional_model(empty=False))).run({"x": x})
    assert out["has"].dtype == np.bool_ and out["has"].shape == () and bool(out["has"])
    np.testing.assert_array_equal(out["y"], x + 1)
    np.testing.assert_array_equal(out["r"], np.maximum(x, 0))


def test_an_empty_optional_has_no_element():
    x = np.array([-1.0, 0.5, 2.0], np.float32)
    out = load(compiler_core.compile(optional_model(empty=True, get=False))).run({"x": x})
    assert not bool(out["has"])
    np.testing.assert_array_equal(out["r"], np.maximum(x, 0))


def test_getting_the_element_of_an_empty_optional_is_a_clear_error():
    with pytest.raises(KilnImportError, match="OptionalGetElement of an empty optional 'o'"):
        compiler_core.compile(optional_model(empty=True))


def test_an_empty_optional_is_empty_inside_a_loop_body_too():
    """A body graph sees the optionals of the graph around it as they are: a Loop whose body
    adds 1 to its state when the outer optional (empty) has an element adds nothing, and one
    asking about x adds 1 each of its 3 iterations."""
    has = TensorProto.BOOL

    def body(value):
        nodes = [
            helper.make_node("Identity", ["cond_in"], ["cond_out"], name="keep"),
            helper.make_node("OptionalHasElement", [value], ["has"], name="has"),
            helper.make_node("Cast", ["has"], ["step"], name="cast", to=FLOAT),
            helper.make_node("Add", ["acc_in", "step"], ["acc_out"], name="add"),
        ]
        inputs = [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", has, []),
            helper.make_tensor_value_info("acc_in", FLOAT, []),
        ]
        outputs = [
            helper.make_tensor_value_info("cond_out", has, []),
            helper.make_tensor_value_info("acc_out", FLOAT, []),
        ]
        return helper.make_graph(nodes, "body", inputs, outputs)

    nodes = [helper.make_node("Optional", [], ["o"], name="opt", type=EMPTY)]
    for name, value in (("empty", "o"), ("full", "x")):
        nodes.append(
            helper.make_node(
                "Loop", ["trips", "", "zero"], [name], name=f"loop_{name}", body=body(value)
            )
        )
    weights = {"trips": np.array(3, np.int64), "zero": np.array(0.0, np.float32)}
    outputs = [("empty", FLOAT, []), ("full", FLOAT, [])]
    model = make_model(nodes, [("x", FLOAT, [3])], outputs, weights, opset=18)
    out = load(compiler_core.compile(model)).run({"x": np.zeros(3, np.float32)})
    assert float(out["empty"]) == 0.0 and float(out["full"]) == 3.0


def test_an_empty_optional_is_empty_inside_a_branch_too():
    """A body graph sees the optionals of the graph around it as they are: an If whose then
    branch asks about the outer empty optional answers False, its else branch (about x)
    True."""
    has = TensorProto.BOOL

    def branch(name, value):
        node = helper.make_node("OptionalHasElement", [value], [f"{name}_out"], name=name)
        out = helper.make_tensor_value_info(f"{name}_out", has, [])
        return helper.make_graph([node], name, [], [out])

    nodes = [
        helper.make_node("Optional", [], ["o"], name="opt", type=EMPTY),
        helper.make_node(
            "If",
            ["cond"],
            ["answer"],
            name="if",
            then_branch=branch("then", "o"),
            else_branch=branch("else", "x"),
        ),
    ]
    model = make_model(
        nodes, [("cond", has, []), ("x", FLOAT, [3])], [("answer", has, [])], opset=18
    )
    module = load(compiler_core.compile(model))
    x = np.zeros(3, np.float32)
    assert not bool(module.run({"cond": np.array(True), "x": x})["answer"])
    assert bool(module.run({"cond": np.array(False), "x": x})["answer"])
