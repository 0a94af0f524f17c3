"""block_masked_attention: attention spelled out under a constant mask (as torch exports
GPT-2) is computed in blocks of queries, each over only the keys its rows may attend, with
the same outputs (the reference executor before and after the pass, and the compiled module
against ONNX Runtime); chains it cannot compute so stay whole."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import compiler_core
from compiler_core.frontend.onnx import import_model
from compiler_core.graph.verify import verify
from compiler_core.passes import block_masked_attention, fold_constants
from compiler_core.reference import run_graph
from compiler_core.runtime import load
from tests.conftest import FLOAT, make_model

RNG = np.random.default_rng(17)
LOWEST = np.float32(np.finfo(np.float32).min)
CAUSAL = np.tril(np.ones((256, 256), bool))[None, None]


def masked_attention(
    mask=CAUSAL, lowest=LOWEST, scale="Div", shape=(1, 2, 256, 8), mask_input=False, extra=()
):
    """q, k, v -> Softmax(Where(mask, (q k^T) scale, lowest)) v, the scores' chain as torch
    writes it; `mask_input` makes the mask a graph input instead of a constant."""
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2])]
    nodes.append(helper.make_node("MatMul", ["q", "kt"], ["s"]))
    scores = "s"
    if scale:
        nodes.append(helper.make_node(scale, ["s", "scale"], ["scaled"]))
        scores = "scaled"
    nodes += [
        helper.make_node("Where", ["mask", scores, "lowest"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["y"]),
        *extra,
    ]
    inputs = [(name, FLOAT, list(shape)) for name in ("q", "k", "v")]
    constants = {"scale": np.float32(np.sqrt(shape[-1])), "lowest": np.asarray(lowest)}
    if mask_input:
        inputs.append(("mask", TensorProto.BOOL, list(mask.shape)))
    else:
        constants["mask"] = mask
    scores_shape = [*shape[:-1], shape[-2]]
    outputs = [("y", FLOAT, list(shape))] + [(e.output[0], FLOAT, scores_shape) for e in extra]
    return make_model(nodes, inputs, outputs, constants, opset=17)


def blocked(model):
    before = fold_constants.run(import_model(model))
    after = block_masked_attention.run(before)
    verify(after)
    return before, after


def keys_read(graph):
    """The key count of each scores MatMul (its B operand's last axis)."""
    return [
        graph.types[n.inputs[1]].shape[-1]
        for n in graph.nodes
        if n.op == "MatMul" and graph.consumers[n.outputs[0]][0].op != "Concat"
    ]


def assert_same_outputs(model, before, after):
    feeds = {
        name: RNG.standard_normal(before.types[name].shape).astype(np.float32)
        for name in before.inputs
    }
    expected = run_graph(before, feeds)["y"]
    np.testing.assert_allclose(run_graph(after, feeds)["y"], expected, rtol=1e-5, atol=1e-6)
    data = model.SerializeToString()
    native = load(compiler_core.compile(data)).run(feeds)["y"]
    (theirs,) = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_allclose(native, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "reads"),
    [
        ({}, [64, 128, 192, 256]),  # torch's GPT-2: divided by sqrt(d), finfo.min
        ({"scale": "Mul", "lowest": np.float32(-np.inf)}, [64, 128, 192, 256]),
        # keys past 200 disallowed to every query: no block reads them
        ({"scale": None, "mask": CAUSAL & (np.arange(256) < 200)}, [64, 128, 192, 200]),
        # one pattern for every head and batch; 4-row heads of 130 queries: two blocks
        ({"shape": (2, 3, 130, 4), "mask": np.tril(np.ones((130, 130), bool))}, [65, 130]),
    ],
)
def test_a_constant_mask_chain_is_computed_in_blocks_of_queries(kwargs, reads):
    model = masked_attention(**kwargs)
    before, after = blocked(model)
    assert keys_read(after) == reads
    assert [n.op for n in after.nodes].count("Softmax") == len(reads)
    assert_same_outputs(model, before, after)


@pytest.mark.parametrize(
    "case", ["mask per head", "run-time mask", "lowest too high", "a row left empty", "read twice"]
)
def test_chains_the_blocks_cannot_compute_exactly_stay_whole(case):
    kwargs = {}
    if case == "mask per head":
        kwargs["mask"] = np.concatenate([CAUSAL, CAUSAL.transpose(0, 1, 3, 2)], axis=1)
    elif case == "run-time mask":
        kwargs["mask_input"] = True
    elif case == "lowest too high":  # exp(-100 - max) is not 0: the skipped keys would count
        kwargs["lowest"] = np.float32(-100.0)
    elif case == "a row left empty":  # a finite lowest makes that row uniform, not zeros
        mask = CAUSAL.copy()
        mask[..., 3, :] = False
        kwargs["mask"] = mask
    else:  # the probabilities are also an output
        kwargs["extra"] = [helper.make_node("Identity", ["p"], ["probabilities"])]
    before, after = blocked(masked_attention(**kwargs))
    assert after is before
