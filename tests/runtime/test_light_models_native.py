"""The nine model-zoo graphs shipped with onnx compile to native code and match ONNX Runtime
on random inputs (their logits: see `light_model_logits`)."""

from __future__ import annotations

import onnxruntime as ort
import pytest

import compiler_core
from compiler_core.runtime import load
from tests.conftest import LIGHT_MODELS, assert_close_to_scale, light_model_logits, random_feeds


@pytest.mark.parametrize("name", LIGHT_MODELS)
def test_light_model_compiles_natively_and_matches(name):
    model = light_model_logits(name).SerializeToString()
    archive = compiler_core.compile(model)
    assert archive.manifest["verification"]["passed"]
    module = load(archive, num_threads=1)
    feeds = random_feeds(module.inputs)
    (actual,) = module.run(feeds).values()
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    (expected,) = session.run(None, feeds)
    assert_close_to_scale(actual, expected, label=name)
