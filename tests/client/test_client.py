"""The client against the live services: upload -> compile (tuned) -> events -> wait ->
download -> deploy -> infer; the event stream resumed without a lost or repeated event; the
error type."""

from __future__ import annotations

import contextlib
import socket
import threading

import numpy as np
import pytest

from api.client import Client, Event, KilnApiError, KilnConnectionError
from compiler_core.runtime import load
from tests.client.conftest import API_KEY, custom_op_model, matmul_model
from tests.e2e.platform import free_port


def assert_no_gap(seen: list[Event], full: list[Event]) -> None:
    """`seen` is exactly the job's stream: each event once, in order, ending with `done`."""
    ids = [int(e.id) for e in seen]
    assert ids == sorted(set(ids)), ids  # strictly increasing: nothing repeated
    assert ids == [int(e.id) for e in full]  # nothing lost
    assert [e.data for e in seen] == [e.data for e in full]
    assert seen[-1].type == "done"


def test_upload_same_bytes_same_id(client):
    data, _ = matmul_model(1)
    first, second = client.upload(data), client.upload(data)
    assert first["id"] == second["id"] and first["digest"] == second["digest"]
    assert client.model(first["id"])["inputs"][0]["name"] == "x"


def test_compile_tune_download_deploy_infer(client, served, tmp_path):
    data, w = matmul_model(2)
    model = client.upload(data, name="flow")
    job = client.compile(model, "llvm", shapes={"x": [4, 64]}, tuning={"trials": 6})
    assert job["status"] == "queued" and job["tuning"]["trials"] == 6

    events = list(client.events(job))
    kinds = [e.type for e in events]
    assert kinds[0] == "queued" and kinds[-1] == "done", kinds
    assert "tuning" in kinds and "measured" in kinds
    tuning = next(e for e in events if e.type == "tuning").data
    assert tuning["trials"] >= 1 and tuning["tasks_total"] >= 1 and "best_gflops" in tuning
    stages = [e.data["stage"] for e in events if e.type == "stage"]
    assert stages == ["importing", "tuning", "building", "verifying", "storing"]

    job = client.wait(job)
    assert job["status"] == "done" and job["best_latency_ms"] > 0
    archive = client.download(job, tmp_path / "flow.kiln")
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    np.testing.assert_allclose(load(archive).run({"x": x})["y"], x @ w, rtol=1e-4, atol=1e-4)

    deployment = client.deploy(job, "flow", "3")
    assert deployment["infer_url"] == f"{served.runtime}/v2/models/flow/versions/3/infer"
    # A fresh client with no runtime URL finds it through the deployment.
    with Client(served.api, API_KEY) as fresh:
        outputs = fresh.infer("flow", {"x": x}, version="3")
    assert outputs["y"].dtype == np.float32 and outputs["y"].shape == (4, 32)
    np.testing.assert_allclose(outputs["y"], x @ w, rtol=1e-4, atol=1e-4)
    explicit = Client(served.api, API_KEY, runtime_url=served.runtime)
    np.testing.assert_allclose(explicit.infer("flow", {"x": x})["y"], outputs["y"])
    with pytest.raises(KilnApiError) as err:  # the runtime server's errors, same type
        explicit.infer("flow", {"x": x[:, :10]})
    assert err.value.status == 400 and "shape" in err.value.detail


def test_events_resumed_after_closing(client):
    """Read a few events, drop the connection, resume with the last id seen."""
    model = client.upload(matmul_model(3)[0])
    job = client.compile(model, shapes={"x": [2, 64]}, tuning={"trials": 6})
    stream = client.events(job)
    first = [next(stream) for _ in range(3)]
    stream.close()  # closes the HTTP response mid-job
    rest = list(client.events(job, last_event_id=first[-1].id))
    assert_no_gap(first + rest, list(client.events(job)))


class CuttingProxy:
    """A TCP proxy to the api that cuts every connection after `limit` bytes of answer: an
    event stream dropped in the middle of an event, again and again."""

    def __init__(self, upstream_port: int, limit: int):
        self.upstream_port, self.limit = upstream_port, limit
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                downstream, _ = self.listener.accept()
                self.connections += 1
                threading.Thread(target=self._serve, args=(downstream,), daemon=True).start()

    def _serve(self, downstream: socket.socket) -> None:
        upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
        threading.Thread(target=self._pipe, args=(downstream, upstream, None), daemon=True).start()
        self._pipe(upstream, downstream, self.limit)
        for sock in (upstream, downstream):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket, limit: int | None) -> None:
        sent = 0
        with contextlib.suppress(OSError):
            while limit is None or sent < limit:
                chunk = source.recv(4096 if limit is None else min(4096, limit - sent))
                if not chunk:
                    return
                sink.sendall(chunk)
                sent += len(chunk)

    def close(self) -> None:
        self.listener.close()


def test_events_resume_by_themselves_after_drops(client, served):
    model = client.upload(matmul_model(4)[0])
    job = client.compile(model, shapes={"x": [3, 64]}, tuning={"trials": 6})
    port = int(served.api.rsplit(":", 1)[1])
    proxy = CuttingProxy(port, limit=700)  # the headers and an event or two per connection
    try:
        with Client(proxy.url, API_KEY) as cut:
            seen = list(cut.events(job))
    finally:
        proxy.close()
    assert proxy.connections > 2
    assert_no_gap(seen, list(client.events(job)))


def test_failed_job_names_the_node(client):
    job = client.wait(client.compile(client.upload(custom_op_model())))
    assert job["status"] == "failed" and "the_foo_node" in job["error"]
    with pytest.raises(KilnApiError) as err:
        client.download(job["artifact"] or "sha256:" + "0" * 64, "/nonexistent/x.kiln")
    assert err.value.status == 404


def test_errors_carry_problem_fields(client, served):
    with pytest.raises(KilnApiError) as err, Client(served.api, "wrong-key") as bad:
        bad.models()
    assert (err.value.status, err.value.title) == (401, "Unauthorized")
    assert err.value.type == "about:blank" and "API key" in err.value.detail

    with pytest.raises(KilnApiError) as err:
        client.compilation("c-nope")
    assert err.value.status == 404 and "c-nope" in err.value.detail

    with pytest.raises(KilnApiError) as err:
        client.upload(b"this is not an ONNX model")
    assert err.value.status == 422 and err.value.title == "Invalid ONNX model"

    model = client.upload(matmul_model(5)[0])
    with pytest.raises(KilnApiError) as err:
        client.compile(model, shapes={"nope": [1]})
    assert err.value.status == 422 and "nope" in err.value.detail
    with pytest.raises(KilnApiError) as err:
        list(client.events("c-nope"))
    assert err.value.status == 404


def test_connection_refused_is_a_clear_error():
    with Client(f"http://127.0.0.1:{free_port()}", API_KEY) as nowhere:
        with pytest.raises(KilnConnectionError, match="cannot reach the Kiln api"):
            nowhere.models()
        with pytest.raises(KilnConnectionError):
            list(nowhere.events("c-any"))
