"""Errors a user can act on: each answers problem+json with a status and a detail naming the
problem, and a refused upload leaves nothing behind in the store."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
from onnx import helper

from tests.api.conftest import (
    FLOAT,
    IN,
    KEYS,
    MAX_UPLOAD,
    assert_problem,
    compile_model,
    make_client,
    make_model,
    mlp_model,
    unsupported_model,
    upload,
    wait_for_job,
)
from tests.conftest import REPO

UNKNOWN_DIGEST = "sha256:" + "0" * 64
# A queue no worker of the harness consumes: a job sent there stays queued.
IDLE_TARGET = "llvm -mcpu=x86-64"
IDLE_QUEUE = "cpu.x86-64"


@contextlib.contextmanager
def worker_process(stack, queue: str):
    """`python -m tuner_workers worker -Q queue` over the harness's data dir."""
    env = {
        **os.environ,
        "KILN_DATA_DIR": str(stack.settings.data_dir),
        "KILN_HEARTBEAT_SECONDS": str(stack.settings.heartbeat_seconds),
        "KILN_JOB_LEASE_SECONDS": str(stack.settings.job_lease_seconds),
    }
    command = [sys.executable, "-m", "tuner_workers", "worker", "-Q", queue]
    process = subprocess.Popen(command, env=env, cwd=REPO)
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def leaves_store_unchanged(stack):
    before = stack.blobs()
    yield
    assert stack.blobs() == before
    assert stack.staged_files() == []


@pytest.fixture(scope="module")
def model_id(stack):
    with make_client(stack.api_url, KEYS["a"]) as client:
        return upload(client, mlp_model(scale=2.0)).json()["id"]


# --- uploads --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"this is not a model at all", ["not an ONNX model"]),
        (mlp_model().SerializeToString()[:-40], ["onnx"]),
        (b"", ["empty"]),
    ],
    ids=["not-onnx", "truncated", "empty"],
)
def test_a_bad_upload_is_422_and_leaves_nothing(client_a, stack, body, words):
    with leaves_store_unchanged(stack):
        assert_problem(upload(client_a, body), 422, *words)
        files = {"file": ("m.onnx", body, "application/octet-stream")}
        assert_problem(client_a.post("/v1/models", files=files), 422, *words)


def test_an_unknown_default_domain_operator_is_refused_with_its_node_and_op(client_a, stack):
    node = helper.make_node("NoSuchOp", ["x"], ["z"], name="odd_node")
    model = make_model([node], [("x", FLOAT, [2])], [("z", FLOAT, [2])])
    with leaves_store_unchanged(stack):
        assert_problem(upload(client_a, model), 422, "NoSuchOp", "odd_node", "17")


def test_a_multipart_form_without_a_file_part_is_422(client_a, stack):
    with leaves_store_unchanged(stack):
        response = client_a.post("/v1/models", data={"other": "x"}, files={"f": ("a", b"zz")})
        assert_problem(response, 422, "'file'")


def oversize() -> bytes:
    return b"\x08" * (MAX_UPLOAD + 1)


def test_an_oversize_raw_upload_is_413(client_a, stack):
    with leaves_store_unchanged(stack):
        assert_problem(upload(client_a, oversize() + b"\x00" * (1 << 17)), 413, str(MAX_UPLOAD))


def test_an_oversize_streamed_upload_without_a_length_is_413(client_a, stack):
    def chunks():
        data = oversize()
        for start in range(0, len(data), 1 << 16):
            yield data[start : start + (1 << 16)]

    with leaves_store_unchanged(stack):
        response = client_a.post(
            "/v1/models", content=chunks(), headers={"Content-Type": "application/octet-stream"}
        )
        assert "content-length" not in response.request.headers
        assert_problem(response, 413, str(MAX_UPLOAD))


@pytest.mark.parametrize("extra", [0, 1 << 17], ids=["just-over", "far-over"])
def test_an_oversize_multipart_upload_is_413(client_a, stack, extra):
    files = {"file": ("big.onnx", oversize() + b"\x00" * extra, "application/octet-stream")}
    with leaves_store_unchanged(stack):
        assert_problem(client_a.post("/v1/models", files=files), 413, str(MAX_UPLOAD))


def test_an_unsupported_media_type_is_415(client_a, stack):
    with leaves_store_unchanged(stack):
        response = client_a.post(
            "/v1/models",
            content=mlp_model().SerializeToString(),
            headers={"Content-Type": "text/plain"},
        )
        assert_problem(response, 415, "application/octet-stream")


# --- compilations ---------------------------------------------------------------------------


def test_an_unsupported_operator_is_accepted_and_its_job_fails_naming_the_node(client_a, stack):
    before = stack.blobs()
    job = compile_model(client_a, unsupported_model())
    assert job["status"] == "failed", job
    assert "odd_node" in job["error"] and "NoSuchOp" in job["error"], job["error"]
    assert job["artifact"] is None
    # Only the uploaded model was stored: the failed job left no artifact behind.
    assert stack.blobs() - before == {job_model_digest(client_a, job)}


def job_model_digest(client, job: dict) -> str:
    return client.get(f"/v1/models/{job['model']}").json()["digest"]


def test_an_unknown_model_in_a_compilation_is_404(client_a):
    response = client_a.post("/v1/compilations", json={"model": "m-nope", "target": "llvm"})
    assert_problem(response, 404, "m-nope")


@pytest.mark.parametrize(
    ("target", "words"),
    [
        ("tpu", ["unsupported target", "tpu"]),
        ("llvm -frobnicate=1", ["unknown target option", "-frobnicate"]),
        ("llvm 'unclosed", ["target"]),
    ],
)
def test_a_bad_target_is_422(client_a, model_id, target, words):
    response = client_a.post("/v1/compilations", json={"model": model_id, "target": target})
    assert_problem(response, 422, *words)


@pytest.mark.parametrize(
    ("shapes", "words"),
    [
        ({"nope": [1, IN]}, ["no input 'nope'", "'x'"]),
        ({"x": [0, IN]}, ["'x'", "> 0"]),
        ({"x": ["a"]}, ["shapes"]),
    ],
)
def test_bad_shapes_are_422(client_a, model_id, shapes, words):
    body = {"model": model_id, "target": "llvm", "shapes": shapes}
    assert_problem(client_a.post("/v1/compilations", json=body), 422, *words)


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"target": "llvm"}, ["model", "field required"]),
        ({"model": "m-x", "surprise": 1}, ["surprise"]),
        ({"model": "m-x", "tuning": {"trials": 0}}, ["trials"]),
    ],
)
def test_a_malformed_compilation_request_is_422(client_a, body, words):
    assert_problem(client_a.post("/v1/compilations", json=body), 422, *words)


def test_a_compilation_body_that_is_not_json_is_422(client_a):
    response = client_a.post(
        "/v1/compilations", content=b"{model", headers={"Content-Type": "application/json"}
    )
    assert_problem(response, 422, "json")


def test_cancelling_a_finished_job_is_409(client_a):
    job = compile_model(client_a, mlp_model(scale=3.0), shapes={"x": [2, IN]})
    assert job["status"] == "done", job["error"]
    assert_problem(client_a.delete(f"/v1/compilations/{job['id']}"), 409, job["id"], "done")
    assert client_a.get(f"/v1/compilations/{job['id']}").json()["status"] == "done"


def test_a_cancelled_queued_job_never_runs(client_a, stack, model_id):
    body = {"model": model_id, "target": IDLE_TARGET, "shapes": {"x": [2, IN]}}
    queued = client_a.post("/v1/compilations", json=body).json()
    assert queued["status"] == "queued"
    cancelled = client_a.delete(f"/v1/compilations/{queued['id']}")
    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json()["status"] == "cancelled"
    assert_problem(client_a.delete(f"/v1/compilations/{queued['id']}"), 409, "cancelled")

    # A worker for that queue now takes its messages in order: once a later job on the same
    # queue is done, the cancelled job's message has been delivered, and it did not run. (A
    # subprocess: two Celery workers cannot share one process, stopping one stops both.)
    later = client_a.post("/v1/compilations", json=body).json()
    assert stack.waiting_messages(IDLE_QUEUE) == 2
    with worker_process(stack, IDLE_QUEUE):
        finished = wait_for_job(client_a, later["id"])
        assert finished["status"] == "done", finished["error"]
    assert stack.waiting_messages(IDLE_QUEUE) == 0
    job = client_a.get(f"/v1/compilations/{queued['id']}").json()
    assert job["status"] == "cancelled" and job["attempts"] == 0, job
    events = client_a.get(f"/v1/compilations/{queued['id']}/events").text
    assert "event: stage" not in events and "event: cancelled" in events


# --- unknown and malformed ids --------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "word"),
    [
        ("GET", "/v1/models/m-nope", "m-nope"),
        ("GET", "/v1/compilations/c-nope", "c-nope"),
        ("DELETE", "/v1/compilations/c-nope", "c-nope"),
        ("GET", "/v1/compilations/c-nope/events", "c-nope"),
        ("GET", f"/v1/artifacts/{UNKNOWN_DIGEST}", UNKNOWN_DIGEST),
        ("GET", f"/v1/artifacts/{UNKNOWN_DIGEST}/manifest", UNKNOWN_DIGEST),
        ("GET", "/v1/deployments/nope", "nope"),
        ("DELETE", "/v1/deployments/nope", "nope"),
    ],
)
def test_unknown_ids_are_404(client_a, method, path, word):
    assert_problem(client_a.request(method, path), 404, word)


def test_deploying_an_unknown_artifact_is_404(client_a):
    response = client_a.post("/v1/deployments", json={"artifact": UNKNOWN_DIGEST, "name": "x"})
    assert_problem(response, 404, UNKNOWN_DIGEST)


@pytest.mark.parametrize(
    "path",
    [
        "/v1/artifacts/sha256:xyz",
        "/v1/artifacts/md5:" + "0" * 32,
        "/v1/artifacts/sha256:" + "A" * 64 + "/manifest",
    ],
)
def test_a_malformed_digest_is_422(client_a, path):
    assert_problem(client_a.get(path), 422, "digest", "pattern")


@pytest.mark.parametrize(
    ("body", "word"),
    [
        ({"artifact": "sha256:xyz", "name": "ok"}, "artifact"),
        ({"artifact": UNKNOWN_DIGEST, "name": "Bad Name!"}, "name"),
        ({"artifact": UNKNOWN_DIGEST, "name": "ok", "version": "v1"}, "version"),
    ],
)
def test_a_malformed_deployment_request_is_422(client_a, body, word):
    assert_problem(client_a.post("/v1/deployments", json=body), 422, word)


def test_a_malformed_deployment_name_in_the_path_is_422(client_a):
    assert_problem(client_a.get("/v1/deployments/Not_Valid!"), 422, "name")


# --- authentication -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/models"),
        ("POST", "/v1/models"),
        ("GET", "/v1/models/m-x"),
        ("POST", "/v1/compilations"),
        ("GET", "/v1/compilations"),
        ("GET", "/v1/compilations/c-x"),
        ("DELETE", "/v1/compilations/c-x"),
        ("GET", "/v1/compilations/c-x/events"),
        ("GET", f"/v1/artifacts/{UNKNOWN_DIGEST}"),
        ("GET", f"/v1/artifacts/{UNKNOWN_DIGEST}/manifest"),
        ("POST", "/v1/deployments"),
        ("GET", "/v1/deployments"),
        ("GET", "/v1/deployments/x"),
        ("DELETE", "/v1/deployments/x"),
    ],
)
def test_every_route_needs_a_valid_key(anonymous, stack, method, path):
    with leaves_store_unchanged(stack):
        missing = anonymous.request(method, path, content=b"\x08\x01")
        assert_problem(missing, 401, "API key is required")
        assert missing.headers["www-authenticate"].startswith("Bearer")
        wrong = anonymous.request(method, path, headers={"X-API-Key": "key-c"})
        assert_problem(wrong, 401, "not valid")
        bearer = anonymous.request(method, path, headers={"Authorization": "Bearer nope"})
        assert_problem(bearer, 401, "not valid")


def test_a_bearer_token_is_accepted(anonymous, client_a):
    response = anonymous.get("/v1/models", headers={"Authorization": f"Bearer {KEYS['a']}"})
    assert response.status_code == 200
    assert response.json() == client_a.get("/v1/models").json()
