"""The native LinearAttention kernel agrees with the numpy reference (update rules, per-key and
per-head decay, scalar beta, grouped and multi-query heads, explicit scale, past state, float16,
an omitted output)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from onnx import TensorProto, helper

from compiler_core.compiler import compile_graph
from compiler_core.frontend.onnx import import_model
from compiler_core.passes.pipeline import optimize
from compiler_core.reference import run_graph
from compiler_core.runtime import load
from compiler_core.target import parse_target
from tests.conftest import make_model

NUMPY = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}


def linear_attention_model(*, batch=2, steps=3, q_heads=2, kv_heads=2, d_k=4, d_v=3,
                           rule="gated_delta", decay_width=None, beta_width=None, past=False,
                           elem=TensorProto.FLOAT, **attrs):  # fmt: skip
    """One LinearAttention node whose operands are all graph inputs. `decay_width` and
    `beta_width` are the packed last dimension of the gates (default per key / per head)."""
    decay_width = kv_heads * d_k if decay_width is None else decay_width
    beta_width = kv_heads if beta_width is None else beta_width
    shapes = {
        "query": [batch, steps, q_heads * d_k],
        "key": [batch, steps, kv_heads * d_k],
        "value": [batch, steps, kv_heads * d_v],
        "past_state": [batch, kv_heads, d_k, d_v],
        "decay": [batch, steps, decay_width],
        "beta": [batch, steps, beta_width],
        "output": [batch, steps, q_heads * d_v],
        "present_state": [batch, kv_heads, d_k, d_v],
    }
    names = ["query", "key", "value", "past_state" if past else "", "", ""]
    if rule in ("gated", "gated_delta"):
        names[4] = "decay"
    if rule in ("delta", "gated_delta"):
        names[5] = "beta"
    while names[-1] == "":
        names.pop()
    node_outputs = ["output", "present_state"]
    node = helper.make_node(
        "LinearAttention",
        names,
        node_outputs,
        name="la",
        q_num_heads=q_heads,
        kv_num_heads=kv_heads,
        update_rule=rule,
        **attrs,
    )
    graph_inputs = [(n, elem, shapes[n]) for n in names if n]
    graph_outputs = [(n, elem, shapes[n]) for n in node_outputs]
    return make_model([node], graph_inputs, graph_outputs, opset=27), shapes


def random_feeds(model, shapes, seed=0):
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in model.graph.input:
        dtype = NUMPY[value.type.tensor_type.elem_type]
        shape = shapes[value.name]
        if value.name == "decay":  # log-decay: negative, so exp(decay) in (0, 1)
            data = -rng.uniform(0.05, 0.5, shape)
        elif value.name == "beta":
            data = rng.uniform(0.1, 0.9, shape)
        else:
            data = rng.standard_normal(shape) * 0.5
        feeds[value.name] = data.astype(dtype)
    return feeds


def check(model, shapes, rtol=1e-5, atol=1e-5, graph=None):
    graph = optimize(graph or import_model(model))
    feeds = random_feeds(model, shapes)
    feeds = {n: feeds[n] for n in graph.inputs}
    expected = run_graph(graph, feeds)
    actual = load(compile_graph(graph, parse_target("llvm"), verify=False)).run(feeds)
    assert set(actual) >= set(graph.outputs)
    for name in graph.outputs:
        assert actual[name].dtype == expected[name].dtype, name
        assert actual[name].shape == expected[name].shape, name
        np.testing.assert_allclose(
            actual[name].astype(np.float64), expected[name].astype(np.float64), rtol, atol
        )
    return expected


@pytest.mark.parametrize(
    "options",
    [
        {"rule": "linear"},
        {"rule": "gated"},
        {"rule": "gated", "decay_width": 2},  # one decay per head
        {"rule": "delta"},
        {"rule": "delta", "beta_width": 1},  # one beta for every head
        {"rule": "gated_delta", "past": True},
        {"rule": "gated_delta", "q_heads": 4, "kv_heads": 2},  # grouped query heads
        {"rule": "gated_delta", "q_heads": 3, "kv_heads": 1, "beta_width": 1},  # multi-query
        {"rule": "gated_delta", "scale": 0.3, "past": True},
        {"rule": "gated_delta", "steps": 1, "past": True},  # one decode step
    ],
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()),
)
def test_matches_reference(options):
    check(*linear_attention_model(**options))


@pytest.mark.parametrize("keep", ["output", "present_state"])
def test_omitted_output(keep):
    """ONNX requires both outputs; the graph IR may mark one '' (the builder then returns
    one tensor, for the other)."""
    model, shapes = linear_attention_model(past=True)
    graph = import_model(model)
    (node,) = graph.nodes
    outputs = tuple(o if o == keep else "" for o in node.outputs)
    graph = graph.replace(nodes=(dataclasses.replace(node, outputs=outputs),), outputs=(keep,))
    expected = check(model, shapes, graph=graph)
    assert list(expected) == [keep]


def test_float16():
    model, shapes = linear_attention_model(
        elem=TensorProto.FLOAT16, q_heads=4, kv_heads=2, past=True
    )
    check(model, shapes, rtol=1e-3, atol=1e-3)
