"""The api against real components, nothing mocked: the api and the runtime server served by
uvicorn on free loopback ports, a real Celery worker (in-process, SQLite broker), the SQLite
ledger and the filesystem store, all under one tmp data dir.

Every httpx client made here fails the test it serves on any 5xx answer.
"""

from __future__ import annotations

import contextlib
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import onnx
import pytest
import uvicorn
from celery.contrib.testing.worker import start_worker
from onnx import helper

from api.app import create_app as create_api
from artifact_store import open_store
from runtime_server.app import create_app as create_runtime
from runtime_server.settings import RuntimeSettings
from tests.conftest import FLOAT, make_model
from tuner_workers.settings import KilnSettings
from tuner_workers.tasks import create_worker_app

KEYS = {"a": "key-a", "b": "key-b"}
MAX_UPLOAD = 2 * 2**20
IN, OUT = 8, 4
W = (np.arange(IN * OUT, dtype=np.float32).reshape(IN, OUT) - 13) * np.float32(0.1)
JOB_TIMEOUT = 60.0
BROKER_FILE = "celery-broker.sqlite"  # KilnSettings.broker_url's file

# Answers >= 500 seen by any client of this harness, cleared and checked around every test.
SERVER_ERRORS: list[str] = []


# --- models ---------------------------------------------------------------------------------


def mlp_model(scale: float = 1.0) -> onnx.ModelProto:
    """z = relu(x @ W * scale), with a symbolic batch dim."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Relu", ["y"], ["z"])]
    return make_model(
        nodes, [("x", FLOAT, ["n", IN])], [("z", FLOAT, ["n", OUT])], {"w": W * np.float32(scale)}
    )


def mlp_expected(x: np.ndarray, scale: float = 1.0) -> np.ndarray:
    return np.maximum(x @ (W * np.float32(scale)), 0)


def unsupported_model() -> onnx.ModelProto:
    """Valid ONNX (the checker skips ops of other domains) that the compiler cannot import."""
    node = helper.make_node("NoSuchOp", ["x"], ["z"], name="odd_node", domain="com.example")
    model = make_model([node], [("x", FLOAT, [2])], [("z", FLOAT, [2])])
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    return model


# --- servers --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serve(app, port: int) -> Iterator[str]:
    """Serve an ASGI app with uvicorn in a background thread; yields its base url."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            pytest.fail(f"a server did not start on port {port}")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@dataclass
class Stack:
    api_url: str
    runtime_url: str
    settings: KilnSettings
    worker: object

    @property
    def runtime_address(self) -> str:  # host:port, as tritonclient wants it
        return self.runtime_url.removeprefix("http://")

    @property
    def store_root(self) -> Path:
        return self.settings.data_dir / "store"

    def blobs(self) -> set[str]:
        return {info.digest for info in open_store(str(self.store_root)).list_blobs()}

    def waiting_messages(self, queue: str) -> int:
        """Messages of `queue` the SQLite broker has not handed to a worker yet."""
        query = (
            "SELECT count(*) FROM kombu_message m JOIN kombu_queue q ON q.id = m.queue_id"
            " WHERE q.name = ? AND m.visible"
        )
        with contextlib.closing(sqlite3.connect(self.settings.data_dir / BROKER_FILE)) as db:
            return db.execute(query, (queue,)).fetchone()[0]

    def staged_files(self) -> list[Path]:
        """Anything left in the store's staging area (a half-written upload)."""
        return sorted((self.store_root / "tmp").glob("*"))


def kiln_settings(data_dir: Path, runtime_url: str) -> KilnSettings:
    return KilnSettings(
        data_dir=data_dir,
        api_keys=",".join(f"{tenant}:{key}" for tenant, key in KEYS.items()),
        runtime_url=runtime_url,
        max_upload_bytes=MAX_UPLOAD,
        heartbeat_seconds=0.5,
        job_lease_seconds=5,
    )


@pytest.fixture(scope="session")
def stack(tmp_path_factory) -> Iterator[Stack]:
    data_dir = tmp_path_factory.mktemp("kiln")
    runtime_port, api_port = free_port(), free_port()
    settings = kiln_settings(data_dir, f"http://127.0.0.1:{runtime_port}")
    runtime_app = create_runtime(RuntimeSettings(data_dir=data_dir, num_threads=1))
    worker_app = create_worker_app(settings)
    with (
        serve(runtime_app, runtime_port) as runtime_url,
        serve(create_api(settings), api_port) as api_url,
        start_worker(
            worker_app,
            pool="solo",
            concurrency=1,
            perform_ping_check=False,
            queues=["cpu", "cuda.sm_90"],  # GPU archives build anywhere (PTX needs no GPU)
            shutdown_timeout=30,
        ) as worker,
    ):
        yield Stack(api_url, runtime_url, settings, worker)


# --- clients --------------------------------------------------------------------------------


def _record_server_error(response: httpx.Response) -> None:
    if response.status_code >= 500:
        response.read()
        request = response.request
        SERVER_ERRORS.append(
            f"{request.method} {request.url} -> {response.status_code}: {response.text[:500]}"
        )


def make_client(base_url: str, key: str | None = None, **kwargs) -> httpx.Client:
    headers = {"X-API-Key": key} if key else {}
    return httpx.Client(
        base_url=base_url,
        headers=headers,
        timeout=30,
        event_hooks={"response": [_record_server_error]},
        **kwargs,
    )


@pytest.fixture(autouse=True)
def no_server_errors():
    SERVER_ERRORS.clear()
    yield
    assert not SERVER_ERRORS, "server errors:\n" + "\n".join(SERVER_ERRORS)


@pytest.fixture
def client_a(stack) -> Iterator[httpx.Client]:
    with make_client(stack.api_url, KEYS["a"]) as client:
        yield client


@pytest.fixture
def client_b(stack) -> Iterator[httpx.Client]:
    with make_client(stack.api_url, KEYS["b"]) as client:
        yield client


@pytest.fixture
def anonymous(stack) -> Iterator[httpx.Client]:
    with make_client(stack.api_url) as client:
        yield client


@pytest.fixture
def runtime(stack) -> Iterator[httpx.Client]:
    with make_client(stack.runtime_url) as client:
        yield client


# --- helpers --------------------------------------------------------------------------------


def upload(client: httpx.Client, model: onnx.ModelProto | bytes, **kwargs) -> httpx.Response:
    data = model if isinstance(model, bytes) else model.SerializeToString()
    headers = {"Content-Type": "application/octet-stream", **kwargs.pop("headers", {})}
    return client.post("/v1/models", content=data, headers=headers, **kwargs)


def wait_for_job(client: httpx.Client, job_id: str, timeout: float = JOB_TIMEOUT) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        response = client.get(f"/v1/compilations/{job_id}")
        assert response.status_code == 200, response.text
        job = response.json()
        if job["status"] in ("done", "failed", "cancelled"):
            return job
        if time.monotonic() > deadline:
            pytest.fail(f"compilation {job_id} did not end in {timeout} s: {job}")
        time.sleep(0.1)


def compile_model(client: httpx.Client, model: onnx.ModelProto, **request) -> dict:
    """Upload `model`, compile it for llvm and wait; returns the finished job."""
    uploaded = upload(client, model)
    assert uploaded.status_code == 201, uploaded.text
    body = {"model": uploaded.json()["id"], "target": "llvm", **request}
    created = client.post("/v1/compilations", json=body)
    assert created.status_code == 202, created.text
    return wait_for_job(client, created.json()["id"])


def assert_problem(response: httpx.Response, status: int, *words: str) -> dict:
    """A problem+json answer with `status` whose title and detail name every one of `words`."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    problem = response.json()
    assert problem["status"] == status
    assert problem["title"] and problem["detail"]
    message = f"{problem['title']}: {problem['detail']}".lower()
    for word in words:
        assert word.lower() in message, (word, problem)
    return problem
