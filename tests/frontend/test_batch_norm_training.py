"""BatchNormalization in training mode: normalized by the batch's own statistics, and the
running statistics moved towards them, compiled natively and checked against numpy."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

import compiler_core
from compiler_core.runtime import load
from tests.conftest import FLOAT, make_model

RNG = np.random.default_rng(7)


def training_model(shape, outputs=("y", "mean_out", "var_out"), momentum=0.7, epsilon=1e-3):
    channels = shape[1]
    node = helper.make_node(
        "BatchNormalization",
        ["x", "s", "b", "mean", "var"],
        list(outputs),
        training_mode=1,
        momentum=momentum,
        epsilon=epsilon,
    )
    shapes = {"y": list(shape), "mean_out": [channels], "var_out": [channels]}
    weights = {
        "s": RNG.standard_normal(channels).astype(np.float32),
        "b": RNG.standard_normal(channels).astype(np.float32),
        "mean": RNG.standard_normal(channels).astype(np.float32),
        "var": RNG.uniform(0.5, 2, channels).astype(np.float32),
    }
    model = make_model(
        [node],
        [("x", FLOAT, list(shape))],
        [(o, FLOAT, shapes[o]) for o in outputs if o],
        weights,
        opset=15,
    )
    return model, weights


def expected(x, weights, momentum=0.7, epsilon=1e-3):
    axes = tuple(a for a in range(x.ndim) if a != 1)
    view = [1, -1] + [1] * (x.ndim - 2)
    mean, var = x.mean(axis=axes), x.var(axis=axes)
    y = (x - mean.reshape(view)) / np.sqrt(var.reshape(view) + epsilon)
    y = y * weights["s"].reshape(view) + weights["b"].reshape(view)
    return {
        "y": y,
        "mean_out": weights["mean"] * momentum + mean * (1 - momentum),
        "var_out": weights["var"] * momentum + var * (1 - momentum),
    }


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (4, 16, 10), (3, 8, 2, 3, 4)])
def test_training_mode_normalizes_by_the_batch_and_updates_the_running_statistics(shape):
    model, weights = training_model(shape)
    x = (RNG.standard_normal(shape) * 3 + 1).astype(np.float32)
    out = load(compiler_core.compile(model)).run({"x": x})
    for name, value in expected(x.astype(np.float64), weights).items():
        np.testing.assert_allclose(out[name], value, rtol=1e-5, atol=1e-5, err_msg=name)


def test_training_mode_with_only_the_normalized_output():
    model, weights = training_model((2, 3, 4, 5), outputs=("y",))
    x = RNG.standard_normal((2, 3, 4, 5)).astype(np.float32)
    out = load(compiler_core.compile(model)).run({"x": x})
    assert set(out) == {"y"}
    np.testing.assert_allclose(out["y"], expected(x.astype(np.float64), weights)["y"], atol=1e-5)
