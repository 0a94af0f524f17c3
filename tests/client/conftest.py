"""One `kiln serve` (embedded defaults, a tmp data dir, KILN_API_KEYS set) per test worker,
and tiny models: each test builds its own weights, since the platform reuses the artifact of a
job it has seen before (same model, target and options) and a reused job has no stages."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from api.client import Client
from tests.conftest import FLOAT, make_model
from tests.e2e.platform import kiln_serve

API_KEY = "client-tests-key"


@pytest.fixture(scope="session")
def served(tmp_path_factory):
    with kiln_serve(tmp_path_factory.mktemp("client-serve"), API_KEY) as platform:
        yield platform


@pytest.fixture
def client(served):
    with Client(served.api, API_KEY) as client:
        yield client


def matmul_model(seed: int, rows: int = 64, cols: int = 32):
    """x[n, rows] @ w -> y: (model bytes, w); the seed makes each model (and job) distinct."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    model = make_model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        [("x", FLOAT, ["n", rows])],
        [("y", FLOAT, ["n", cols])],
        {"w": w},
        name=f"matmul{seed}",
    )
    return model.SerializeToString(), w


def custom_op_model() -> bytes:
    """A model whose only node is an operator of a custom domain: valid ONNX, not compilable."""
    model = make_model(
        [helper.make_node("Foo", ["x"], ["y"], domain="custom.x", name="the_foo_node")],
        [("x", FLOAT, [1, 8])],
        [("y", FLOAT, [1, 8])],
    )
    model.opset_import.append(helper.make_opsetid("custom.x", 1))
    return model.SerializeToString()
