"""End to end over HTTP, on the embedded default and on Redis: `kiln serve`, upload ->
compile -> deploy -> infer with tritonclient; outputs match ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as triton

from tests.conftest import shared_model
from tests.e2e.platform import kiln_serve, redis_url

CASES = [("mlp", "x", [1, 784]), ("resnet18", "input", [1, 3, 224, 224])]


@pytest.fixture(scope="module", params=["embedded", "redis"])
def platform(request, tmp_path_factory):
    redis = redis_url(12) if request.param == "redis" else None
    with kiln_serve(tmp_path_factory.mktemp(request.param), "e2e-key", redis) as served:
        yield served


@pytest.mark.parametrize("name,input_name,shape", CASES, ids=[c[0] for c in CASES])
def test_upload_compile_deploy_infer(platform, name, input_name, shape):
    path = shared_model(name)
    model = platform.upload(path.read_bytes())
    assert model["inputs"][0]["name"] == input_name
    job = platform.wait_job(platform.compile(model["id"], {input_name: shape})["id"])
    assert job["status"] == "done", job
    assert job["verification"]["passed"]
    platform.deploy(job["artifact"], name)

    client = triton.InferenceServerClient(platform.runtime.removeprefix("http://"))
    assert client.is_model_ready(name)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    request = triton.InferInput(input_name, shape, "FP32")
    request.set_data_from_numpy(x, binary_data=True)
    result = client.infer(name, [request])

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    expected_outputs = session.run(None, {input_name: x})
    for output, expected in zip(session.get_outputs(), expected_outputs, strict=True):
        actual = result.as_numpy(output.name)
        scale = float(np.abs(expected).max())
        np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-4 * scale)
