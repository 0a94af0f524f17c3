"""fuse_attention and the attention template: S = Q K^T, its row softmax and Y = P V as one
kernel that computes a block of query rows at a time (its scores in a buffer of the
thread's), checked against ONNX Runtime, every knob through the measurer, and the scheduled
loops against the unscheduled ones in the loop-IR interpreter for a target the host may
not run."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import compiler_core
from compiler_core.autotune.tasks import extract_tasks
from compiler_core.frontend.onnx import import_model
from compiler_core.passes.pipeline import optimize
from compiler_core.runtime import load
from compiler_core.target import host_target, parse_target
from tests.conftest import (
    FLOAT,
    assert_close_to_scale,
    make_model,
    measurement_errors,
    one_knob_off_default,
)

RNG = np.random.default_rng(23)


def rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def attention_op(batch, heads, queries, keys, size, **attrs):
    """The ONNX Attention operator (opset 23) over [B, H, L, D] Q, K and V."""
    q, kv = [batch, heads, queries, size], [batch, heads, keys, size]
    node = helper.make_node("Attention", ["q", "k", "v"], ["y"], **attrs)
    inputs = [("q", FLOAT, q), ("k", FLOAT, kv), ("v", FLOAT, kv)]
    return make_model([node], inputs, [("y", FLOAT, q)], opset=23)


def masked_attention_op(heads, queries, keys, size):
    """The Attention operator with a boolean mask input [1, 1, queries, keys]."""
    model = attention_op(1, heads, queries, keys, size)
    model.graph.node[0].input.append("mask")
    model.graph.input.append(
        helper.make_tensor_value_info("mask", TensorProto.BOOL, [1, 1, queries, keys])
    )
    return model


def spelled_out(heads, queries, keys, size, mask=None, dtype=FLOAT):
    """Attention as exporters write it: K transposed, Q K^T divided by sqrt(D), a float mask
    added (an input) or a constant boolean one applied with Where, Softmax, then P V."""
    q, kv = [1, heads, queries, size], [1, heads, keys, size]
    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["s"]),
        helper.make_node("Div", ["s", "scale"], ["scaled"]),
    ]
    inputs = [("q", dtype, q), ("k", dtype, kv), ("v", dtype, kv)]
    numpy_type = np.float64 if dtype == TensorProto.DOUBLE else np.float32
    weights = {"scale": numpy_type(np.sqrt(size))}
    logits = "scaled"
    if mask == "add":
        inputs.append(("m", dtype, [1, 1, queries, keys]))
        nodes.append(helper.make_node("Add", ["scaled", "m"], ["masked"]))
        logits = "masked"
    elif mask == "where":
        weights["allowed"] = RNG.random((1, 1, queries, keys)) < 0.7
        weights["allowed"][..., 0] = True  # no row left empty
        weights["lowest"] = numpy_type(np.finfo(numpy_type).min)
        nodes.append(helper.make_node("Where", ["allowed", "scaled", "lowest"], ["masked"]))
        logits = "masked"
    nodes += [
        helper.make_node("Softmax", [logits], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["y"]),
    ]
    return make_model(nodes, inputs, [("y", dtype, q)], weights, opset=17)


def feeds_of(model):
    feeds = {}
    for value in model.graph.input:
        shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
        array = rand(*shape)
        if value.type.tensor_type.elem_type == TensorProto.BOOL:
            array = array < 0.5  # about 70% of the keys allowed
            array[..., 0] = True  # no row left empty (ORT's empty rows differ: see below)
        elif value.type.tensor_type.elem_type == TensorProto.DOUBLE:
            array = array.astype(np.float64)
        feeds[value.name] = array
    return feeds


def ort_output(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["y"], feeds)[0]


def group_ops(model, target=None):
    graph = optimize(import_model(model), target=target or host_target())
    return graph, [[graph.node_by_name[n].op for n in g.nodes] for g in graph.groups]


CASES = {
    # ViT's rows: 197 queries (a prime: Y's rows padded, the last block guarded) and keys (a
    # tail tile of scores after 6 of 32).
    "vit_rows": lambda: attention_op(1, 3, 197, 197, 64),
    "more_keys_than_queries": lambda: attention_op(2, 2, 40, 100, 32),
    "few_keys": lambda: attention_op(1, 2, 16, 6, 8),
    "head_size_24": lambda: attention_op(1, 2, 33, 50, 24),
    "float_mask": lambda: spelled_out(2, 30, 70, 16, mask="add"),
    # A boolean mask known at run time: a row may allow no key (zero probabilities).
    "runtime_boolean_mask": lambda: masked_attention_op(2, 30, 70, 16),
    "boolean_mask": lambda: spelled_out(2, 30, 70, 16, mask="where"),
    # A block's scores (16 rows of 6000 keys) outgrow the largest stack tile: computed in
    # the kernel's workspace buffer instead.
    "keys_past_a_stack_tile": lambda: attention_op(1, 1, 16, 6000, 16),
}


@pytest.mark.parametrize("name", list(CASES))
def test_attention_is_one_kernel_and_matches_onnxruntime(name):
    model = CASES[name]()
    _, ops = group_ops(model)
    chains = [ops_ for ops_ in ops if ops_.count("MatMul") == 2 and "Softmax" in ops_]
    assert len(chains) == 1, ops
    feeds = feeds_of(model)
    module = load(compiler_core.compile(model))
    assert_close_to_scale(module.run(feeds)["y"], ort_output(model, feeds), label=name)


def test_a_row_whose_mask_allows_no_key_gives_zeros_in_the_chain():
    """The spec's convention for a row with no allowed key (zero probabilities, so a zero
    output row), against the reference executor on the imported graph."""
    from compiler_core.reference.executor import run_graph

    model = masked_attention_op(2, 30, 70, 16)
    feeds = feeds_of(model)
    feeds["mask"][0, 0, 3] = False  # query 3 of every head attends to nothing
    got = load(compiler_core.compile(model)).run(feeds)["y"]
    assert not got[0, :, 3].any()
    expected = run_graph(import_model(model), feeds)["y"]
    assert_close_to_scale(got, expected, label="empty row")


def test_a_causal_attention_in_blocks_of_queries_is_one_kernel_a_block():
    """`decompose_attention` computes a causal attention in blocks of queries, each over the
    keys it may attend: every block is a chain of its own."""
    model = attention_op(1, 2, 128, 128, 16, is_causal=1)
    _, ops = group_ops(model)
    chains = [g for g in ops if g.count("MatMul") == 2 and "Softmax" in g]
    assert len(chains) > 1, ops
    feeds = feeds_of(model)
    module = load(compiler_core.compile(model))
    assert_close_to_scale(module.run(feeds)["y"], ort_output(model, feeds), label="causal")


def exposed_probabilities():
    """The probabilities are also a graph output: they must be written whole."""
    model = spelled_out(2, 20, 30, 16)
    model.graph.output.append(helper.make_tensor_value_info("p", FLOAT, [1, 2, 20, 30]))
    return model


def exposed_scores():
    """The scores are also read by another node: they must be written whole."""
    model = spelled_out(2, 20, 30, 16)
    model.graph.node.append(helper.make_node("Relu", ["scaled"], ["s_out"]))
    model.graph.output.append(helper.make_tensor_value_info("s_out", FLOAT, [1, 2, 20, 30]))
    return model


def softmax_over_queries():
    model = spelled_out(2, 20, 20, 16)
    softmax = next(n for n in model.graph.node if n.op_type == "Softmax")
    softmax.attribute[0].i = 2
    return model


@pytest.mark.parametrize(
    ("name", "model", "target"),
    [
        ("probabilities_read_elsewhere", exposed_probabilities, None),
        ("scores_read_elsewhere", exposed_scores, None),
        ("softmax_not_over_keys", softmax_over_queries, None),
        ("float64", lambda: spelled_out(2, 20, 30, 16, dtype=TensorProto.DOUBLE), None),
        ("gpu_target", lambda: attention_op(1, 2, 20, 30, 16), "cuda -arch=sm_90"),
    ],
)
def test_no_chain_where_the_kernels_must_stay_apart(name, model, target):
    _, ops = group_ops(model(), parse_target(target) if target else None)
    assert ["Softmax"] in ops, (name, ops)


def attention_task(model, target=None):
    target = target or host_target()
    graph = optimize(import_model(model), target=target)
    (task,) = [t for t in extract_tasks(graph, target) if t.tunable.template.name == "attention"]
    return task


def test_the_chain_is_one_task_of_the_attention_template_counting_both_gemms():
    task = attention_task(attention_op(1, 2, 40, 100, 32))
    y, scores = task.tunable.anchor, task.tunable.anchor.note("scores")
    assert y.shape[-1] == 32 and scores.reduce_axes[0][1] == 32
    expected = 2 * np.prod(y.shape) * 100 + 2 * np.prod(scores.shape) * 32
    assert task.flops == pytest.approx(expected)


def test_every_knob_value_of_the_attention_template_measures_correct():
    """Each knob off its default, one at a time (blocks of 1 to 16 rows, every column tile of
    both GEMMs), checked by the measurer against the reference answer."""
    task = attention_task(attention_op(1, 2, 40, 100, 32))
    configs = one_knob_off_default(task.tunable)
    assert len({c["rows"] for c in configs}) > 2, configs
    errors = measurement_errors(task, configs)
    assert not errors, errors[:3]


@pytest.mark.parametrize("target_text", ["llvm -mcpu=znver3 -mattr=+avx2,+fma"])
def test_scheduled_blocks_compute_what_the_unscheduled_loops_do(target_text):
    """The loop-IR interpreter runs the default and each knob off it for an AVX2 target
    (8-lane vectors: other tiles than the host's) against the group's unscheduled loops."""
    from compiler_core.loop import interpreter
    from compiler_core.schedule.primitives import apply

    task = attention_task(attention_op(1, 1, 13, 21, 8), parse_target(target_text))
    lowered = task.lowered_for(None)
    args = {b.name: rand(*b.shape) for b in lowered.func.params}
    expected = {k: v.copy() for k, v in args.items()}
    interpreter.run(lowered.func, expected)
    output = lowered.func.params[-1].name
    for config in one_knob_off_default(task.tunable):
        got = {k: v.copy() for k, v in args.items()}
        interpreter.run(apply(lowered.func, task.records(config)), got)
        np.testing.assert_allclose(got[output], expected[output], rtol=1e-4, atol=1e-5)
