"""End to end over HTTP, on the embedded default (SQLite broker and ledger, filesystem store)
and on the shared setup (Redis broker and ledger, S3 store on moto's server): `kiln serve`,
upload -> compile -> deploy -> infer with tritonclient; outputs match ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as triton

from tests.conftest import shared_model
from tests.e2e.platform import kiln_serve, moto_s3, redis_url

# An MLP and a conv net (depthwise and grouped convs, ReLU6 as Clip). resnet18 goes this way
# in ../shared/acceptance's e2e check; here the smaller mobilenet_v2 keeps the suite short.
CASES = [("mlp", "x", [1, 784]), ("mobilenet_v2", "input", [1, 3, 224, 224])]


@pytest.fixture(scope="module", params=["embedded", "redis+s3"])
def platform(request, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp(request.param.replace("+", "-"))
    if request.param == "embedded":
        with kiln_serve(data_dir, "e2e-key") as served:
            yield served
        return
    with moto_s3() as s3_env, kiln_serve(data_dir, "e2e-key", redis_url(12), s3_env) as served:
        yield served
    assert not (data_dir / "store").exists()  # everything went to S3


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
