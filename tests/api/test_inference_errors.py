"""Bad inference requests against a model deployed through the api: the runtime server
answers 4xx with `{"error": ...}` naming the problem, to httpx and to tritonclient alike."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.api.conftest import IN, KEYS, make_client, mlp_expected, mlp_model, upload, wait_for_job

NAME = "rt-errors"
BATCH = 2
X = np.random.default_rng(2).standard_normal((BATCH, IN)).astype(np.float32)
INFER = f"/v2/models/{NAME}/infer"


@pytest.fixture(scope="module")
def deployed(stack):
    with make_client(stack.api_url, KEYS["a"]) as client:
        model = upload(client, mlp_model(scale=0.25)).json()
        body = {"model": model["id"], "target": "llvm", "shapes": {"x": [BATCH, IN]}}
        job = wait_for_job(client, client.post("/v1/compilations", json=body).json()["id"])
        assert job["status"] == "done", job
        created = client.post("/v1/deployments", json={"artifact": job["artifact"], "name": NAME})
        assert created.status_code == 201, created.text
        yield created.json()
        client.delete(f"/v1/deployments/{NAME}")


@pytest.fixture
def triton_client(stack):
    client = triton.InferenceServerClient(stack.runtime_address)
    yield client
    client.close()


def infer_body(x: np.ndarray, name: str = "x", datatype: str = "FP32", shape=None) -> dict:
    shape = list(x.shape) if shape is None else shape
    tensor = {"name": name, "shape": shape, "datatype": datatype, "data": x.ravel().tolist()}
    return {"inputs": [tensor]}


def assert_error(response, status: int, *words: str) -> None:
    assert response.status_code == status, response.text
    message = response.json()["error"]
    for word in words:
        assert word in message, (word, message)


def triton_input(x: np.ndarray, name: str = "x", datatype: str = "FP32") -> triton.InferInput:
    tensor = triton.InferInput(name, list(x.shape), datatype)
    tensor.set_data_from_numpy(x, binary_data=False)
    return tensor


def test_the_deployment_answers(triton_client, deployed):
    result = triton_client.infer(NAME, [triton_input(X)])
    np.testing.assert_allclose(result.as_numpy("z"), mlp_expected(X, 0.25), rtol=1e-5, atol=1e-5)


def test_malformed_json_is_400(runtime, deployed):
    response = runtime.post(
        INFER, content=b'{"inputs": [', headers={"content-type": "application/json"}
    )
    assert_error(response, 400, "malformed JSON")


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (infer_body(X.reshape(IN, BATCH)), ["input 'x'", f"[{IN}, {BATCH}]", f"[{BATCH}, {IN}]"]),
        (infer_body(X.astype(np.float64), datatype="FP64"), ["input 'x'", "FP64", "FP32"]),
        (infer_body(X, name="w"), ["unknown input 'w'", "['x']"]),
        (infer_body(X, shape=[BATCH, IN + 1]), ["input 'x'", "needs"]),
    ],
    ids=["wrong-shape", "wrong-dtype", "wrong-name", "wrong-count"],
)
def test_a_bad_request_is_400_naming_the_problem(runtime, deployed, body, words):
    assert_error(runtime.post(INFER, json=body), 400, *words)


@pytest.mark.parametrize(
    ("tensor", "words"),
    [
        (triton_input(X.reshape(IN, BATCH)), ["input 'x'", f"[{IN}, {BATCH}]"]),
        (triton_input(X.astype(np.int32), datatype="INT32"), ["input 'x'", "INT32"]),
        (triton_input(X, name="w"), ["unknown input 'w'"]),
    ],
    ids=["wrong-shape", "wrong-dtype", "wrong-name"],
)
def test_tritonclient_sees_the_message(triton_client, deployed, tensor, words):
    with pytest.raises(InferenceServerException) as caught:
        triton_client.infer(NAME, [tensor])
    assert caught.value.status() == "400"
    for word in words:
        assert word in caught.value.message(), (word, caught.value.message())


def test_an_unloaded_or_unknown_model_is_4xx(client_a, runtime, triton_client, deployed):
    assert_error(runtime.post("/v2/models/never-deployed/infer", json=infer_body(X)), 404, "never")
    # Deploy a second name, undeploy it through the api, then infer on it.
    created = client_a.post(
        "/v1/deployments", json={"artifact": deployed["artifact"], "name": "rt-gone"}
    )
    assert created.status_code == 201, created.text
    assert client_a.delete("/v1/deployments/rt-gone").status_code == 200
    response = runtime.post("/v2/models/rt-gone/infer", json=infer_body(X))
    assert 400 <= response.status_code < 500, response.text
    assert "rt-gone" in response.json()["error"]
    with pytest.raises(InferenceServerException) as caught:
        triton_client.infer("rt-gone", [triton_input(X)])
    assert caught.value.status().startswith("4") and "rt-gone" in caught.value.message()
