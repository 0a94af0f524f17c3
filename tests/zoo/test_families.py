"""The zoo's architecture families, small: each compiles natively and matches ONNX Runtime
(max error within 1e-4 of the output's scale) on random inputs."""

from __future__ import annotations

import onnxruntime as ort
import pytest

import compiler_core
from compiler_core.runtime import load
from tests.conftest import assert_close_to_scale, random_feeds
from tests.zoo.graphs import FAMILIES


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_compiles_natively_and_matches_onnxruntime(name):
    model = FAMILIES[name]().SerializeToString()
    module = load(compiler_core.compile(model), num_threads=2)
    feeds = random_feeds(module.inputs)
    (actual,) = module.run(feeds).values()
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    (expected,) = session.run(None, feeds)
    assert_close_to_scale(actual, expected, label=name)
