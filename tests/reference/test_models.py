"""Every benchmark model and every model-zoo 'light' graph: import, run the pipeline, execute
with the reference executor, and match ONNX Runtime (or the shipped expected output)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from compiler_core.frontend.onnx import import_model
from compiler_core.graph.verify import verify
from compiler_core.passes.pipeline import optimize
from compiler_core.reference import run_graph
from tests.conftest import LIGHT_DIR, LIGHT_MODELS, SHARED_MODELS, shared_model

RTOL, ATOL = 1e-4, 1e-5
SHAPES = {"mlp": {"x": [3, 784]}}


def ort_outputs(path, feeds):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
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
def test_light_model_matches_shipped_output(name):
    path = LIGHT_DIR / f"{name}.onnx"
    graph = import_model(path)
    optimized = verify(optimize(graph))
    # The light graphs take no data input that matters: the expected output sits beside them.
    expected = numpy_helper.to_array(onnx.load_tensor(str(LIGHT_DIR / f"{name}_output_0.pb")))
    feeds = {n: np.zeros(graph.types[n].shape, graph.types[n].dtype) for n in graph.inputs}
    actual = run_graph(optimized, feeds)[graph.outputs[0]]
    np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=ATOL)


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
