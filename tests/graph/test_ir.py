"""The graph IR: immutability, structural keys, the printer, the verifier's named checks, and
the op table's completeness."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from onnx import helper

from compiler_core.frontend.onnx import import_model
from compiler_core.frontend.onnx_ops import CONVERTERS
from compiler_core.graph.ir import Graph, Node, OpKind, TensorType
from compiler_core.graph.ops import OP_TABLE
from compiler_core.graph.printer import format_graph
from compiler_core.graph.verify import CHECKS, VerificationError, verify
from tests.conftest import FLOAT, make_model


def small_graph(weight=None):
    weight = np.ones((3, 3), np.float32) if weight is None else weight
    model = make_model(
        [
            helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
            helper.make_node("Relu", ["m"], ["y"], name="relu"),
        ],
        [("x", FLOAT, [2, 3])],
        [("y", FLOAT, [2, 3])],
        {"w": weight},
    )
    return import_model(model)


def test_nodes_and_graphs_are_immutable():
    graph = small_graph()
    with pytest.raises(dataclasses.FrozenInstanceError):
        graph.nodes[0].op = "Add"
    with pytest.raises(TypeError):
        graph.types["y"] = TensorType((1,), "float32")
    with pytest.raises(ValueError):
        graph.constants["w"][0, 0] = 5.0


def test_structural_key_is_stable_and_sees_constant_content():
    assert small_graph().key == small_graph().key
    other = small_graph(np.full((3, 3), 2.0, np.float32))
    assert other.key != small_graph().key


def test_a_bfloat16_constant_is_keyed_by_its_content():
    """bfloat16 (ml_dtypes) exports no buffer format: its bytes are hashed raw."""
    from ml_dtypes import bfloat16

    def key(values):
        array = np.asarray(values, dtype=bfloat16)
        return Graph("g", (), ("c",), (), {"c": TensorType.of(array)}, {"c": array}).key

    assert key([1.0, 2.0]) == key([1.0, 2.0]) != key([1.0, 3.0])


def test_attrs_are_order_independent():
    a = Node("Conv", "c", ("x", "w"), ("y",), {"strides": [1, 1], "pads": [0, 0, 0, 0]})
    b = Node("Conv", "c", ("x", "w"), ("y",), {"pads": (0, 0, 0, 0), "strides": (1, 1)})
    assert a == b and a.signature == b.signature
    assert a.attr("strides") == (1, 1)
    with pytest.raises(KeyError, match="dilations"):
        a.attr("dilations")


def test_printer_is_readable():
    text = format_graph(small_graph())
    assert "graph test(%x: float32[2,3]) -> (%y: float32[2,3])" in text
    assert "%m = MatMul(%x, %w)  : float32[2,3]" in text
    assert "%y = Relu(%m)" in text


def test_verifier_names_the_failed_check_and_prints_the_graph():
    graph = small_graph()
    broken = dataclasses.replace(graph, nodes=tuple(reversed(graph.nodes)))
    with pytest.raises(VerificationError) as info:
        verify(broken)
    assert info.value.check == "topological_order"
    assert "graph test(" in str(info.value)


def test_verifier_catches_inconsistent_types():
    graph = small_graph()
    types = dict(graph.types) | {"m": TensorType((2, 4), "float32")}
    with pytest.raises(VerificationError) as info:
        verify(dataclasses.replace(graph, types=types))
    assert info.value.check == "types_consistent"


def test_verifier_catches_dangling_values():
    graph = small_graph()
    bad = graph.nodes[1].replace(inputs=("nowhere",))
    broken = Graph(
        graph.name, graph.inputs, graph.outputs, (graph.nodes[0], bad), graph.types, graph.constants
    )
    with pytest.raises(VerificationError) as info:
        verify(broken)
    assert info.value.check in ("topological_order", "no_dangling_values")


def test_verifier_checks_are_named_and_all_pass_on_a_good_graph():
    assert set(CHECKS) >= {
        "topological_order",
        "no_dangling_values",
        "types_consistent",
        "shapes_known",
    }
    verify(small_graph())


def test_every_converter_target_and_kind_is_in_the_op_table():
    for name, opdef in OP_TABLE.items():
        assert opdef.name == name
        assert isinstance(opdef.kind, OpKind)
        assert callable(opdef.infer) and callable(opdef.compute)
    # The core ONNX operators the benchmark models and model zoo need are all convertible.
    for op in (
        "Conv",
        "Gemm",
        "MatMul",
        "BatchNormalization",
        "Relu",
        "Clip",
        "Add",
        "MaxPool",
        "GlobalAveragePool",
        "Softmax",
        "LayerNormalization",
        "Reshape",
        "Transpose",
        "Gather",
        "Concat",
        "Slice",
        "Shape",
        "Erf",
        "LRN",
        "Sum",
    ):
        assert op in CONVERTERS, op


def test_tensor_type_rejects_unknown_dtypes_and_negative_dims():
    with pytest.raises(ValueError, match="element type"):
        TensorType((1,), "complex64")
    with pytest.raises(ValueError, match="negative"):
        TensorType((-1, 2), "float32")
