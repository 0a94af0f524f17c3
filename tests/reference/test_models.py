"""Every benchmark model and every model-zoo 'light' graph: import, run the pipeline, execute
with the reference executor, and match ONNX Runtime (or the shipped expected output)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from compiler_core.frontend.onnx import import_model
from compiler_core.graph.verify import verify
from compiler_core.passes.pipeline import optimize
from compiler_core.reference import run_graph
from tests.conftest import (
    LIGHT_MODELS,
    SHARED_MODELS,
    assert_close_to_scale,
    light_model_logits,
    random_feeds,
    shared_model,
)

RTOL, ATOL = 1e-4, 1e-5
SHAPES = {"mlp": {"x": [3, 784]}}


def ort_outputs(path, feeds):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    model = path if isinstance(path, bytes) else str(path)
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


@pytest.mark.parametrize("name", SHARED_MODELS)
def test_shared_model_matches_onnxruntime(name):
    path = shared_model(name)
    graph = import_model(path, shapes=SHAPES.get(name))
    optimized = verify(optimize(graph))
    rng = np.random.default_rng(0)
    feeds = {
        n: rng.standard_normal(graph.types[n].shape).astype(graph.types[n].dtype)
        for n in graph.inputs
    }
    actual = run_graph(optimized, feeds)
    for out_name, expected in zip(graph.outputs, ort_outputs(path, feeds), strict=True):
        np.testing.assert_allclose(actual[out_name], expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", LIGHT_MODELS)
def test_light_model_matches_onnxruntime(name):
    model = light_model_logits(name)
    graph = import_model(model)
    optimized = verify(optimize(graph))
    feeds = random_feeds(graph.input_signature())
    actual = run_graph(optimized, feeds)[graph.outputs[0]]
    (expected,) = ort_outputs(model.SerializeToString(), feeds)
    assert_close_to_scale(actual, expected, label=name)


def test_mlp_binds_the_batch_dimension():
    for batch in (1, 64):
        graph = import_model(shared_model("mlp"), shapes={"x": [batch, 784]})
        assert graph.types["probs"].shape == (batch, 10)


def test_every_value_has_a_concrete_type_after_import():
    for name in SHARED_MODELS:
        graph = import_model(shared_model(name), shapes=SHAPES.get(name))
        verify(graph, stage=f"import of {name}")
        for node in graph.nodes:
            for value in node.outputs:
                if value:
                    assert all(isinstance(d, int) for d in graph.types[value].shape)
