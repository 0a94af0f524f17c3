"""The nine model-zoo graphs shipped with onnx compile to native code and reproduce their
shipped outputs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import compiler_core
from compiler_core.runtime import load
from tests.conftest import LIGHT_DIR, LIGHT_MODELS


@pytest.mark.parametrize("name", LIGHT_MODELS)
def test_light_model_compiles_natively_and_matches(name):
    archive = compiler_core.compile(str(LIGHT_DIR / f"{name}.onnx"))
    assert archive.manifest["verification"]["passed"]
    module = load(archive, num_threads=1)
    feeds = {n: np.zeros(s, d) for n, s, d in module.inputs}
    (actual,) = module.run(feeds).values()
    expected = numpy_helper.to_array(onnx.load_tensor(str(LIGHT_DIR / f"{name}_output_0.pb")))
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5)
