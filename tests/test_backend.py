"""compiler_core.backend: the onnx.backend.base module interface over the compiler."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

import compiler_core.backend as backend
from tests.conftest import FLOAT, INT64, make_model, shared_model


def test_module_interface_matches_onnx_backend_base():
    for name in ("prepare", "run_model", "run_node", "supports_device"):
        assert callable(getattr(backend, name))
    assert backend.supports_device("CPU")
    assert not backend.supports_device("CUDA")


def test_prepare_and_run_a_model():
    rep = backend.prepare(str(shared_model("mlp")), "CPU")
    x = np.random.default_rng(0).standard_normal((2, 784)).astype(np.float32)
    (probs,) = rep.run([x])
    assert probs.shape == (2, 10)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-5)


def test_run_node():
    node = helper.make_node("Relu", ["x"], ["y"])
    x = np.array([-1.0, 2.0], np.float32)
    (y,) = backend.run_node(node, [x])
    np.testing.assert_array_equal(y, [0.0, 2.0])


def test_shape_deciding_input_is_bound_at_first_run_and_cached_by_value():
    model = make_model(
        [helper.make_node("Reshape", ["x", "shape"], ["y"], name="reshape")],
        [("x", FLOAT, [2, 6]), ("shape", INT64, [2])],
        [("y", FLOAT, [None, None])],
    )
    rep = backend.prepare(model)
    x = np.arange(12, dtype=np.float32).reshape(2, 6)
    (a,) = rep.run([x, np.array([3, 4], np.int64)])
    (b,) = rep.run([x, np.array([4, 3], np.int64)])
    assert a.shape == (3, 4) and b.shape == (4, 3)
    np.testing.assert_array_equal(b, x.reshape(4, 3))
    assert rep._bound == {"shape"}
    assert len(rep._cache) == 2


def test_wrong_input_count_is_a_clear_error():
    rep = backend.prepare(str(shared_model("mlp")))
    with pytest.raises(ValueError, match="takes 1 inputs"):
        rep.run([np.zeros((1, 784), np.float32), np.zeros(1, np.float32)])


def test_unsupported_device_is_refused():
    with pytest.raises(ValueError, match="CUDA"):
        backend.prepare(str(shared_model("mlp")), "CUDA")


def test_wrong_input_dtype_is_a_clear_error():
    model = make_model(
        [helper.make_node("Relu", ["x"], ["y"], name="relu")],
        [("x", FLOAT, [2])],
        [("y", FLOAT, [2])],
    )
    rep = backend.prepare(model)
    with pytest.raises(ValueError, match="float64"):
        rep.run([np.zeros(2, np.float64)])
