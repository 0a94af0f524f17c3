"""Fusion rules, written against pattern kinds: checked on small graphs and on real models."""

from __future__ import annotations

import numpy as np
from onnx import helper

from compiler_core.frontend.onnx import import_model
from compiler_core.graph.ir import OpKind
from compiler_core.graph.verify import verify
from compiler_core.passes import fuse_operators
from compiler_core.passes.pipeline import optimize
from tests.conftest import FLOAT, make_model, shared_model

RNG = np.random.default_rng(3)


def groups_by_ops(graph):
    return [tuple(graph.node_by_name[n].op for n in g.nodes) for g in graph.groups]


def fused(model):
    graph = fuse_operators.run(import_model(model))
    verify(graph)
    return graph


def test_conv_absorbs_bias_residual_add_and_relu():
    model = make_model(
        [
            helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
            helper.make_node("Add", ["c", "x"], ["s"], name="residual"),
            helper.make_node("Relu", ["s"], ["y"], name="relu"),
        ],
        [("x", FLOAT, [1, 4, 6, 6])],
        [("y", FLOAT, [1, 4, 6, 6])],
        {"w": RNG.standard_normal((4, 4, 3, 3)).astype(np.float32)},
    )
    graph = fused(model)
    assert groups_by_ops(graph) == [("Conv", "Add", "Relu")]
    assert graph.groups[0].anchor == "conv"
    assert graph.groups[0].kind == OpKind.OUT_ELEMWISE_FUSABLE


def test_two_heavy_ops_never_fuse():
    model = make_model(
        [
            helper.make_node("MatMul", ["x", "w1"], ["a"], name="mm1"),
            helper.make_node("MatMul", ["a", "w2"], ["y"], name="mm2"),
        ],
        [("x", FLOAT, [2, 3])],
        [("y", FLOAT, [2, 3])],
        {"w1": np.eye(3, dtype=np.float32), "w2": np.eye(3, dtype=np.float32)},
    )
    assert groups_by_ops(fused(model)) == [("MatMul",), ("MatMul",)]


def test_opaque_stays_alone():
    model = make_model(
        [
            helper.make_node("Relu", ["x"], ["a"], name="relu"),
            helper.make_node("Softmax", ["a"], ["b"], name="softmax"),
            helper.make_node("Exp", ["b"], ["y"], name="exp"),
        ],
        [("x", FLOAT, [2, 3])],
        [("y", FLOAT, [2, 3])],
    )
    assert groups_by_ops(fused(model)) == [("Relu",), ("Softmax",), ("Exp",)]


def test_injective_chain_fuses_into_a_reduction():
    model = make_model(
        [
            helper.make_node("Transpose", ["x"], ["t"], name="transpose", perm=[1, 0]),
            helper.make_node("Exp", ["t"], ["e"], name="exp"),
            helper.make_node("ReduceSum", ["e", "axes"], ["r"], name="sum", keepdims=0),
            helper.make_node("Sqrt", ["r"], ["y"], name="sqrt"),
        ],
        [("x", FLOAT, [2, 3])],
        [("y", FLOAT, [3])],
        {"axes": np.array([1], np.int64)},
    )
    graph = fused(model)
    assert groups_by_ops(graph) == [("Transpose", "Exp", "ReduceSum", "Sqrt")]
    assert graph.groups[0].kind == OpKind.REDUCTION


def test_heavy_op_does_not_absorb_injective_consumers():
    model = make_model(
        [
            helper.make_node("MatMul", ["x", "w"], ["a"], name="mm"),
            helper.make_node("Transpose", ["a"], ["y"], name="transpose", perm=[1, 0]),
        ],
        [("x", FLOAT, [2, 3])],
        [("y", FLOAT, [3, 2])],
        {"w": np.eye(3, dtype=np.float32)},
    )
    assert groups_by_ops(fused(model)) == [("MatMul",), ("Transpose",)]


def test_value_read_twice_is_not_fused_through():
    model = make_model(
        [
            helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
            helper.make_node("Relu", ["c"], ["a"], name="relu"),
            helper.make_node("Sigmoid", ["c"], ["b"], name="sigmoid"),
            helper.make_node("Add", ["a", "b"], ["y"], name="add"),
        ],
        [("x", FLOAT, [1, 2, 4, 4])],
        [("y", FLOAT, [1, 2, 4, 4])],
        {"w": RNG.standard_normal((2, 2, 1, 1)).astype(np.float32)},
    )
    graph = fused(model)
    conv_group = next(g for g in graph.groups if "conv" in g.nodes)
    assert conv_group.nodes == ("conv",)


def test_fusion_never_makes_a_cycle():
    # c = conv(x); p = pool(c) [own group]; y = c + p would put the Add in conv's group while
    # it reads pool, which reads conv: a cycle between groups. It must not happen.
    model = make_model(
        [
            helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
            helper.make_node("Relu", ["c"], ["r"], name="relu"),
            helper.make_node(
                "MaxPool", ["r"], ["p"], name="pool", kernel_shape=[1, 1], strides=[1, 1]
            ),
            helper.make_node("Exp", ["r"], ["e"], name="exp"),
            helper.make_node("Add", ["e", "p"], ["y"], name="add"),
        ],
        [("x", FLOAT, [1, 2, 4, 4])],
        [("y", FLOAT, [1, 2, 4, 4])],
        {"w": RNG.standard_normal((2, 2, 1, 1)).astype(np.float32)},
    )
    graph = fused(model)
    group_of = {n: i for i, g in enumerate(graph.groups) for n in g.nodes}
    edges = set()
    for node in graph.nodes:
        for value in node.inputs:
            producer = graph.producers.get(value)
            if producer is not None and group_of[producer.name] != group_of[node.name]:
                edges.add((group_of[producer.name], group_of[node.name]))
    assert all(a < b or (b, a) not in edges for a, b in edges)
    assert not any((b, a) in edges for a, b in edges), f"group cycle: {edges}"


def test_resnet18_groups_each_conv_with_its_epilogue():
    graph = optimize(import_model(shared_model("resnet18")))
    convs = [n for n in graph.nodes if n.op == "Conv"]
    group_of = {n: g for g in graph.groups for n in g.nodes}
    for conv in convs:
        group = group_of[conv.name]
        assert group.anchor == conv.name
        (consumer,) = graph.consumers[conv.outputs[0]]
        if consumer.op == "Relu":
            assert consumer.name in group.nodes, f"{conv.name}'s Relu is not fused"
        if consumer.op == "Add":
            # A residual Add joins one of the two convs it reads (the main path's).
            owners = {group_of[graph.producers[v].name].anchor for v in consumer.inputs}
            assert group_of[consumer.name].anchor in owners
    epilogues = [tuple(graph.node_by_name[n].op for n in g.nodes) for g in graph.groups]
    assert epilogues.count(("Conv", "Add", "Relu")) == 8
    assert all(ops.count("Conv") <= 1 for ops in epilogues)
