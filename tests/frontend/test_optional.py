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
