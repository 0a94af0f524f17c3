"""The runtime server end to end: uvicorn on loopback, a FileStore, and tritonclient as the
third-party client. Outputs are checked against the in-process runtime and numpy."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from compiler_core.runtime import load
from tests.runtime_server.conftest import IN, expected

X = np.array([[1.0, -2.0, 3.0, 0.5]], np.float32)


@pytest.fixture(scope="module")
def client(server):
    with triton.InferenceServerClient(server.address) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def tiny(server, http):
    """Model 'tiny' version 1, loaded with our own load body."""
    response = http.post(
        "/v2/repository/models/tiny/load", json={"parameters": {"artifact": server.digests["1"]}}
    )
    assert response.status_code == 200, response.text
    return "tiny"


def json_input(x: np.ndarray, name: str = "x") -> triton.InferInput:
    tensor = triton.InferInput(name, list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=False)
    return tensor


def binary_input(x: np.ndarray) -> triton.InferInput:
    tensor = triton.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=True)
    return tensor


def infer_body(x, name="x", datatype="FP32", shape=None) -> dict:
    shape = list(x.shape) if shape is None else shape
    return {"inputs": [{"name": name, "shape": shape, "datatype": datatype, "data": x.tolist()}]}


def assert_error(response: httpx.Response, status: int, *needles: str) -> str:
    assert response.status_code == status, response.text
    message = response.json()["error"]
    for needle in needles:
        assert needle in message
    return message


# -- health and metadata -----------------------------------------------------------------


def test_health_and_server_metadata(client):
    assert client.is_server_live()
    assert client.is_server_ready()
    meta = client.get_server_metadata()
    assert meta["name"] == "kiln"
    assert {"binary_tensor_data", "model_repository"} <= set(meta["extensions"])
    assert meta["version"]


def test_load_with_tritonclient_config_then_metadata(client, server):
    client.load_model("tiny_tc", config=json.dumps({"artifact": server.digests["1"]}))
    assert client.is_model_ready("tiny_tc")
    assert client.is_model_ready("tiny_tc", "1")
    meta = client.get_model_metadata("tiny_tc")
    assert meta["name"] == "tiny_tc"
    assert meta["platform"] == "kiln_native"
    assert meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [1, IN]}]
    assert [o["name"] for o in meta["outputs"]] == ["y", "z"]
    assert client.get_model_metadata("tiny_tc", "1")["inputs"] == meta["inputs"]


# -- inference ---------------------------------------------------------------------------


def test_infer_json(client, tiny, archives):
    outputs = [triton.InferRequestedOutput(n, binary_data=False) for n in ("y", "z")]
    result = client.infer(tiny, [json_input(X)], outputs=outputs)
    in_process = load(archives["1"]).run({"x": X})
    for name, want in expected(X).items():
        got = result.as_numpy(name)
        assert got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_array_equal(got, in_process[name])
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert result.get_response()["model_version"] == "1"


def test_infer_binary_inputs_and_outputs(client, tiny, archives):
    # No requested outputs: tritonclient asks for all of them in binary.
    result = client.infer(tiny, [binary_input(X)])
    in_process = load(archives["1"]).run({"x": X})
    for name in ("y", "z"):
        np.testing.assert_array_equal(
            result.as_numpy(name).reshape(in_process[name].shape), in_process[name]
        )
    outputs = result.get_response()["outputs"]
    assert all("binary_data_size" in o["parameters"] for o in outputs)


def test_binary_response_framing(http, tiny):
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "shape": [1, IN],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": X.nbytes},
                }
            ],
            "outputs": [{"name": "z", "parameters": {"binary_data": True}}],
        }
    ).encode()
    response = http.post(
        "/v2/models/tiny/infer",
        content=header + X.tobytes(),
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/octet-stream"
    length = int(response.headers["inference-header-content-length"])
    meta = json.loads(response.content[:length])
    assert [o["name"] for o in meta["outputs"]] == ["z"]
    assert meta["outputs"][0]["parameters"]["binary_data_size"] == X.nbytes
    z = np.frombuffer(response.content[length:], "<f4").reshape(1, IN)
    np.testing.assert_array_equal(z, 2 * X)


def test_nested_json_data_and_selected_output(http, tiny):
    response = http.post(
        "/v2/models/tiny/infer",
        json={**infer_body(X), "id": "req-7", "outputs": [{"name": "y"}]},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"] == "req-7" and body["model_name"] == "tiny"
    assert [o["name"] for o in body["outputs"]] == ["y"]
    y = np.array(body["outputs"][0]["data"], np.float32).reshape(body["outputs"][0]["shape"])
    np.testing.assert_allclose(y, expected(X)["y"], rtol=1e-6, atol=1e-6)


def test_concurrent_requests_each_get_their_own_answer(server, tiny):
    """48 requests over 8 threads against 2 instances: a shared workspace would mix them up."""
    local = threading.local()

    def one(i: int) -> tuple[np.ndarray, np.ndarray]:
        if not hasattr(local, "client"):
            local.client = httpx.Client(base_url=server.url, timeout=30)
        x = (np.arange(IN, dtype=np.float32) - i) * np.float32(0.37 * (i + 1))
        x = x.reshape(1, IN)
        response = local.client.post("/v2/models/tiny/infer", json=infer_body(x))
        assert response.status_code == 200, response.text
        got = {o["name"]: o["data"] for o in response.json()["outputs"]}
        return x, np.array(got["y"], np.float32).reshape(1, -1)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(48)))
    for x, y in results:
        np.testing.assert_allclose(y, expected(x)["y"], rtol=1e-5, atol=1e-5)


def test_two_versions_addressed_by_version(client, server, http):
    for version in ("1", "2"):
        response = http.post(
            "/v2/repository/models/tiny_v/load",
            json={"parameters": {"artifact": server.digests[version], "version": version}},
        )
        assert response.status_code == 200, response.text
    for version in ("1", "2"):
        result = client.infer("tiny_v", [json_input(X)], model_version=version)
        np.testing.assert_allclose(
            result.as_numpy("y"), expected(X, version)["y"], rtol=1e-6, atol=1e-6
        )
        assert result.get_response()["model_version"] == version
    latest = client.infer("tiny_v", [json_input(X)])
    assert latest.get_response()["model_version"] == "2"
    assert client.get_model_metadata("tiny_v")["versions"] == ["1", "2"]
    assert not client.is_model_ready("tiny_v", "3")


# -- the repository extension ------------------------------------------------------------


def test_unload_then_infer_fails_and_reload_by_name(client, server):
    client.load_model("tiny_u", config=json.dumps({"artifact": server.digests["1"]}))
    client.unload_model("tiny_u")
    assert not client.is_model_ready("tiny_u")
    with pytest.raises(InferenceServerException) as err:
        client.infer("tiny_u", [json_input(X)])
    assert err.value.status() == "400"
    assert "tiny_u" in err.value.message() and "not ready" in err.value.message()
    rows = {(r["name"], r["version"]): r for r in client.get_model_repository_index()}
    assert rows[("tiny_u", "1")]["state"] == "UNAVAILABLE"
    assert rows[("tiny_u", "1")]["reason"] == "unloaded"
    # No artifact: the server reloads the one it remembers.
    client.load_model("tiny_u")
    assert client.is_model_ready("tiny_u")
    np.testing.assert_allclose(
        client.infer("tiny_u", [json_input(X)]).as_numpy("z"), 2 * X, rtol=0, atol=0
    )


def test_repository_index_lists_states(http, tiny, server):
    http.post(
        "/v2/repository/models/tiny_gone/load",
        json={"parameters": {"artifact": server.digests["1"]}},
    )
    http.post("/v2/repository/models/tiny_gone/unload")
    rows = http.post("/v2/repository/index").json()
    states = {(r["name"], r["version"]): r["state"] for r in rows}
    assert states[("tiny", "1")] == "READY"
    assert states[("tiny_gone", "1")] == "UNAVAILABLE"
    ready = http.post("/v2/repository/index", json={"ready": True}).json()
    assert ("tiny_gone", "1") not in {(r["name"], r["version"]) for r in ready}


def test_unknown_model(client, http):
    with pytest.raises(InferenceServerException) as err:
        client.infer("nope", [json_input(X)])
    assert err.value.status() == "404"
    assert "'nope'" in err.value.message()
    with pytest.raises(InferenceServerException) as err:
        client.get_model_metadata("nope")
    assert err.value.status() == "404"
    assert not client.is_model_ready("nope")
    # Loading an unknown name needs an artifact, and the error says so.
    with pytest.raises(InferenceServerException) as err:
        client.load_model("nope")
    assert err.value.status() == "404"
    assert "artifact" in err.value.message()
    assert_error(http.post("/v2/repository/models/nope/unload"), 404, "nope")


@pytest.mark.parametrize(
    ("parameters", "status", "needle"),
    [
        ({"artifact": "sha256:" + "0" * 64}, 404, "not in the artifact store"),
        ({"artifact": "sha256:xyz"}, 400, "invalid digest"),
        ({"artifact": 7}, 400, "artifact"),
        ({"config": "{not json"}, 400, "malformed JSON"),
        ({"artifact": "sha256:" + "0" * 64, "version": "../1"}, 400, "version"),
    ],
)
def test_load_errors(http, parameters, status, needle):
    response = http.post("/v2/repository/models/broken/load", json={"parameters": parameters})
    assert_error(response, status, needle)


def test_load_a_blob_that_is_not_an_archive(http, server):
    digest = server.store.put_blob(b"not a zip file")
    response = http.post(
        "/v2/repository/models/junk/load", json={"parameters": {"artifact": digest}}
    )
    assert_error(response, 400, "not a module archive")


# -- bad requests ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "needles"),
    [
        (infer_body(X, name="w"), ["unknown input 'w'", "['x']"]),
        (infer_body(X.reshape(2, 2)), ["input 'x'", "shape [2, 2]", "[1, 4]"]),
        (infer_body(X.astype(np.float64), datatype="FP64"), ["input 'x'", "FP64", "FP32"]),
        (infer_body(X, shape=[1, 5]), ["input 'x'", "4 elements", "needs 5"]),
        (infer_body(X, datatype="BYTES"), ["input 'x'", "unsupported datatype 'BYTES'"]),
        (infer_body(X, datatype="INT32"), ["input 'x'", "not INT32"]),
        ({"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32"}]}, ["input 'x'"]),
        ({"inputs": []}, ["inputs"]),
        ({**infer_body(X), "outputs": [{"name": "q"}]}, ["unknown output 'q'"]),
        (
            {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [[1, 2], [3]]}]},
            ["input 'x'", "rectangular"],
        ),
    ],
)
def test_bad_json_requests_are_400_and_name_the_culprit(http, tiny, body, needles):
    assert_error(http.post("/v2/models/tiny/infer", json=body), 400, *needles)


def test_malformed_json_is_400(http, tiny):
    response = http.post(
        "/v2/models/tiny/infer",
        content=b'{"inputs": [',
        headers={"content-type": "application/json"},
    )
    assert_error(response, 400, "malformed JSON")
    assert_error(http.post("/v2/models/tiny/infer", content=b"[1, 2]"), 400, "JSON object")


def binary_request(header: dict, raw: bytes, length: int | None = None) -> dict:
    text = json.dumps(header).encode()
    length = len(text) if length is None else length
    return {
        "content": text + raw,
        "headers": {"Inference-Header-Content-Length": str(length)},
    }


def test_bad_binary_requests_are_400(http, tiny):
    def header(size: int) -> dict:
        return {
            "inputs": [
                {
                    "name": "x",
                    "shape": [1, IN],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": size},
                }
            ]
        }

    url = "/v2/models/tiny/infer"
    raw = X.tobytes()
    past = binary_request(header(len(raw)), raw, length=10_000)
    assert_error(http.post(url, **past), 400, "Inference-Header-Content-Length", "10000")
    short = binary_request(header(len(raw) + 8), raw)
    assert_error(http.post(url, **short), 400, "input 'x'", "runs past the end")
    wrong = binary_request(header(8), raw[:8])
    assert_error(http.post(url, **wrong), 400, "input 'x'", "needs 16")
    extra = binary_request(header(len(raw)), raw + b"\0" * 4)
    assert_error(http.post(url, **extra), 400, "4 bytes")
    not_int = {"content": b"{}", "headers": {"Inference-Header-Content-Length": "abc"}}
    assert_error(http.post(url, **not_int), 400, "integer")


def test_unknown_route_and_method_keep_the_error_shape(http):
    assert "error" in http.get("/v2/nothing/here").json()
    assert http.get("/v2/nothing/here").status_code == 404
    response = http.get("/v2/models/tiny/infer")
    assert response.status_code == 405 and "error" in response.json()


# -- metrics -----------------------------------------------------------------------------


def metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {name} {labels} in:\n{text}")


def test_metrics_after_requests(http, tiny):
    for _ in range(3):
        assert http.post("/v2/models/tiny/infer", json=infer_body(X)).status_code == 200
    http.post("/v2/models/tiny/infer", json=infer_body(X, name="w"))
    text = http.get("/metrics").text
    route = "/v2/models/{model}/infer"
    assert metric(text, "kiln_runtime_requests_total", route=route, outcome="success") >= 3
    assert metric(text, "kiln_runtime_requests_total", route=route, outcome="client_error") >= 1
    assert metric(text, "kiln_runtime_inference_seconds_count", model="tiny", version="1") >= 3
    assert metric(text, "kiln_runtime_loaded_models") >= 1
    assert metric(text, "kiln_runtime_workspace_cached_bytes") >= 0  # tests/runtime: its value
