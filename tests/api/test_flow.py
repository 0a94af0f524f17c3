"""The happy path end to end over HTTP: upload, compile on a real worker, follow the events,
download the artifact, deploy it on the runtime server and infer through tritonclient."""

from __future__ import annotations

import hashlib
import io
import json
import zipfile

import numpy as np
import pytest
import tritonclient.http as triton

from compiler_core.runtime import load
from tests.api.conftest import (
    IN,
    KEYS,
    OUT,
    make_client,
    mlp_expected,
    mlp_model,
    upload,
    wait_for_job,
)

X = np.random.default_rng(1).standard_normal((3, IN)).astype(np.float32)


def read_sse(client, path: str, last_event_id: str | None = None) -> list[dict]:
    """Every event of an SSE stream as {'id', 'event', 'data'}; returns once the server ends
    the stream."""
    headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
    events, current = [], {}
    with client.stream("GET", path, headers=headers, timeout=60) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if not line:
                if "data" in current:
                    events.append(current)
                current = {}
            elif not line.startswith(":"):
                field, _, value = line.partition(":")
                current[field] = value.removeprefix(" ")
    for event in events:
        event["data"] = json.loads(event["data"])
    return events


@pytest.fixture(scope="module")
def compiled(stack):
    """One model uploaded, compiled for llvm with a bound batch dim, and finished."""
    with make_client(stack.api_url, KEYS["a"]) as client:
        model = upload(client, mlp_model(), headers={"X-Model-Name": "mlp"}).json()
        body = {"model": model["id"], "target": "llvm", "shapes": {"x": [3, IN]}}
        created = client.post("/v1/compilations", json=body)
        assert created.status_code == 202, created.text
        # Followed live from the moment it is queued: the stream ends when the job does.
        live = read_sse(client, f"{created.headers['location']}/events")
        job = wait_for_job(client, created.json()["id"], timeout=1)
    return {"model": model, "created": created, "job": job, "live_events": live}


def test_upload_raw_and_multipart_give_one_id(client_a):
    data = mlp_model(scale=0.5).SerializeToString()
    raw = upload(client_a, data)
    assert raw.status_code == 201, raw.text
    again = upload(client_a, data)
    form = client_a.post("/v1/models", files={"file": ("m.onnx", data, "application/octet-stream")})
    assert again.status_code == form.status_code == 201, (again.text, form.text)
    assert raw.json()["id"] == again.json()["id"] == form.json()["id"]
    assert raw.json()["digest"] == "sha256:" + hashlib.sha256(data).hexdigest()


def test_model_is_described_and_listed(client_a, compiled):
    model = compiled["model"]
    assert model["name"] == "mlp"
    assert model["size"] == len(mlp_model().SerializeToString())
    assert model["inputs"] == [{"name": "x", "dtype": "float", "shape": ["n", IN]}]
    assert model["outputs"] == [{"name": "z", "dtype": "float", "shape": ["n", OUT]}]
    assert model["op_histogram"] == {"MatMul": 1, "Relu": 1}
    assert model["nodes"] == 2
    assert model["opsets"] == {"ai.onnx": 17}
    fetched = client_a.get(f"/v1/models/{model['id']}")
    assert fetched.status_code == 200
    assert fetched.json() == model
    listed = client_a.get("/v1/models")
    assert listed.status_code == 200
    assert model["id"] in [m["id"] for m in listed.json()["models"]]


def test_compilation_is_accepted_and_finishes(client_a, compiled):
    created, job = compiled["created"], compiled["job"]
    assert created.headers["location"] == f"/v1/compilations/{job['id']}"
    assert created.json()["status"] == "queued"
    assert job["status"] == "done", job
    assert job["model"] == compiled["model"]["id"]
    assert job["shapes"] == {"x": [3, IN]}
    assert job["artifact"].startswith("sha256:")
    assert job["verification"]["passed"] is True
    assert job["best_latency_ms"] > 0
    listed = client_a.get("/v1/compilations").json()["compilations"]
    assert job["id"] in [j["id"] for j in listed]


def test_events_stream_ends_after_the_final_event_and_resumes(client_a, compiled):
    job = compiled["job"]
    path = f"/v1/compilations/{job['id']}/events"
    events = read_sse(client_a, path)
    assert events == compiled["live_events"]
    kinds = [e["event"] for e in events]
    assert kinds[0] == "queued" and kinds[-1] == "done", kinds
    stages = [e["data"]["stage"] for e in events if e["event"] == "stage"]
    assert stages == ["importing", "tuning", "building", "verifying", "storing"]
    assert all(e["data"]["type"] == e["event"] for e in events)
    assert events[-1]["data"]["artifact"] == job["artifact"]
    ids = [int(e["id"]) for e in events]
    assert ids == sorted(set(ids))

    resumed = read_sse(client_a, path, last_event_id=events[2]["id"])
    assert [e["id"] for e in resumed] == [e["id"] for e in events[3:]]
    assert read_sse(client_a, path, last_event_id=events[-1]["id"]) == []


def test_artifact_runs_and_matches_numpy(client_a, compiled):
    digest = compiled["job"]["artifact"]
    response = client_a.get(f"/v1/artifacts/{digest}")
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/zip"
    assert response.headers["etag"] == digest
    assert "sha256:" + hashlib.sha256(response.content).hexdigest() == digest
    assert zipfile.ZipFile(io.BytesIO(response.content)).testzip() is None
    outputs = load(response.content, num_threads=1).run({"x": X})
    np.testing.assert_allclose(outputs["z"], mlp_expected(X), rtol=1e-5, atol=1e-5)
    built = json.loads(zipfile.ZipFile(io.BytesIO(response.content)).read("manifest.json"))
    kernels = client_a.get(f"/v1/artifacts/{digest}/kernels").json()
    for field in ("workspace_bytes", "kernel_scratch_bytes"):  # the build's memory account
        assert kernels[field] == built["memory"][field], field

    manifest = client_a.get(f"/v1/artifacts/{digest}/manifest")
    assert manifest.status_code == 200
    manifest = manifest.json()
    assert manifest["artifact"] == digest
    assert manifest["model"] == compiled["model"]["digest"]
    assert manifest["target"] == "llvm"
    assert manifest["options"]["shapes"] == {"x": [3, IN]}
    assert manifest["verification"]["passed"] is True


def test_deploy_infer_with_tritonclient_and_undeploy(client_a, compiled, stack):
    digest = compiled["job"]["artifact"]
    created = client_a.post(
        "/v1/deployments", json={"artifact": digest, "name": "flow-mlp", "version": "2"}
    )
    assert created.status_code == 201, created.text
    deployment = created.json()
    assert deployment["infer_url"] == f"{stack.runtime_url}/v2/models/flow-mlp/versions/2/infer"
    assert client_a.get("/v1/deployments/flow-mlp").json() == deployment
    names = [d["name"] for d in client_a.get("/v1/deployments").json()["deployments"]]
    assert "flow-mlp" in names

    triton_client = triton.InferenceServerClient(stack.runtime_address)
    try:
        assert triton_client.is_model_ready("flow-mlp", "2")
        tensor = triton.InferInput("x", list(X.shape), "FP32")
        tensor.set_data_from_numpy(X, binary_data=False)
        result = triton_client.infer("flow-mlp", [tensor], model_version="2")
        np.testing.assert_allclose(result.as_numpy("z"), mlp_expected(X), rtol=1e-5, atol=1e-5)

        deleted = client_a.delete("/v1/deployments/flow-mlp")
        assert deleted.status_code == 200, deleted.text
        assert deleted.json()["name"] == "flow-mlp"
        assert not triton_client.is_model_ready("flow-mlp", "2")
    finally:
        triton_client.close()
    assert client_a.get("/v1/deployments/flow-mlp").status_code == 404
    names = [d["name"] for d in client_a.get("/v1/deployments").json()["deployments"]]
    assert "flow-mlp" not in names


def test_the_same_compilation_again_reuses_the_artifact(client_a, compiled):
    body = {"model": compiled["model"]["id"], "target": "llvm", "shapes": {"x": [3, IN]}}
    created = client_a.post("/v1/compilations", json=body)
    assert created.status_code == 202
    job = wait_for_job(client_a, created.json()["id"])
    assert job["status"] == "done"
    assert job["artifact"] == compiled["job"]["artifact"]


def test_a_cuda_compilation_builds_ptx_verified_by_its_twin(client_a, compiled, stack):
    body = {
        "model": compiled["model"]["id"],
        "target": "cuda -arch=sm_90",
        "shapes": {"x": [3, IN]},
    }
    created = client_a.post("/v1/compilations", json=body)
    assert created.status_code == 202, created.text
    job = wait_for_job(client_a, created.json()["id"], timeout=120)
    assert job["status"] == "done", job
    archive = client_a.get(f"/v1/artifacts/{job['artifact']}").content
    members = zipfile.ZipFile(io.BytesIO(archive)).namelist()
    assert "model.ptx" in members and "kernels.cl" in members
    manifest = client_a.get(f"/v1/artifacts/{job['artifact']}/manifest").json()
    assert manifest["target"] == "cuda -arch=sm_90"
    verification = manifest["verification"]
    assert verification["passed"] is True and verification["device"] == "opencl twin"
    twin = load(archive, device="opencl").run({"x": X})
    np.testing.assert_allclose(twin["z"], mlp_expected(X), rtol=1e-5, atol=1e-5)
    # This runtime server has no GPU: deploying says so instead of failing later.
    deployed = client_a.post(
        "/v1/deployments", json={"artifact": job["artifact"], "name": "gpu-mlp", "version": "1"}
    )
    assert deployed.status_code in (400, 422), deployed.text
    assert "no CUDA device" in deployed.text


def test_health_and_metrics(anonymous):
    assert anonymous.get("/health/live").json() == {"status": "ok", "checks": {}}
    ready = anonymous.get("/health/ready").json()
    assert ready == {"status": "ok", "checks": {"ledger": "ok", "store": "ok"}}
    metrics = anonymous.get("/metrics")
    assert metrics.status_code == 200
    assert "kiln_api_requests" in metrics.text
