"""Dynamic batching of archives compiled with batch buckets: concurrent requests run together
(fewer runs than requests), each gets exactly its own rows, a bad request fails alone, an
unloaded version refuses new requests, and the server's metrics count the batches; through
the repository and through uvicorn with tritonclient."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
import uvicorn

import compiler_core
from artifact_store import FileStore
from runtime_server.app import create_app
from runtime_server.batching import DynamicBatcher
from runtime_server.repository import InvalidRequest, ModelNotReady, ModelRepository
from runtime_server.settings import RuntimeSettings
from tests.runtime_server.conftest import IN, expected, free_port, tiny_model

BUCKETS = [1, 2, 4, 8]


@pytest.fixture(scope="module")
def bucketed() -> bytes:
    return compiler_core.compile(tiny_model("1"), batch_buckets=BUCKETS).to_bytes()


def rows(i: int, batch: int = 1) -> np.ndarray:
    x = (np.arange(batch * IN, dtype=np.float32).reshape(batch, IN) - i) * np.float32(0.1 * i)
    return x + np.float32(i)


def test_concurrent_requests_run_together_and_get_their_own_rows(tmp_path, bucketed):
    store = FileStore(tmp_path / "store")
    repo = ModelRepository(store, instances=1, num_threads=1, batch_delay=0.05)
    repo.load("m", store.put_blob(bucketed))
    batches = [1, 2, 1, 3, 1, 1, 2, 1, 1, 4, 1, 2]  # some do not fit what is already queued

    def one(i: int):
        x = rows(i, batches[i])
        return x, repo.infer("m", None, {"x": x})

    with ThreadPoolExecutor(len(batches)) as pool:
        results = list(pool.map(one, range(len(batches))))
    for x, out in results:
        assert out["y"].shape == (len(x), 3) and out["z"].shape == x.shape
        np.testing.assert_allclose(out["y"], expected(x)["y"], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(out["z"], 2 * x)
    ((_, _, stats),) = repo.batch_stats()
    assert stats.requests == len(batches)
    assert stats.batches < len(batches) and stats.largest > 1, stats


def test_a_bad_request_fails_alone(tmp_path, bucketed):
    store = FileStore(tmp_path / "store")
    repo = ModelRepository(store, instances=2, num_threads=1, batch_delay=0.05)
    repo.load("m", store.put_blob(bucketed))

    def one(i: int):
        if i == 3:
            x = np.ones((1, IN + 1), np.float32)  # the wrong width
        elif i == 5:
            x = np.ones((9, IN), np.float32)  # past the largest bucket
        else:
            x = rows(i)
        try:
            return x, repo.infer("m", None, {"x": x})
        except InvalidRequest as err:
            return x, err

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    for i, (x, out) in enumerate(results):
        if i == 3:
            assert isinstance(out, InvalidRequest) and "batch N of 1 to 8" in str(out)
        elif i == 5:
            assert isinstance(out, InvalidRequest) and "outside the module's buckets" in str(out)
        else:
            np.testing.assert_allclose(out["y"], expected(x)["y"], rtol=1e-5, atol=1e-5)


def test_an_unloaded_version_refuses_new_requests(tmp_path, bucketed):
    store = FileStore(tmp_path / "store")
    repo = ModelRepository(store, instances=1, num_threads=1)
    repo.load("m", store.put_blob(bucketed))
    pool = repo.get("m").pool
    repo.unload("m")
    with pytest.raises(ModelNotReady, match="unloaded"):
        pool.run({"x": rows(1)})
    with pytest.raises(ModelNotReady):
        repo.infer("m", None, {"x": rows(1)})


def test_batching_is_off_for_unbucketed_archives_and_when_disabled(tmp_path, bucketed, archives):
    store = FileStore(tmp_path / "store")
    repo = ModelRepository(store, instances=1, num_threads=1)
    repo.load("plain", store.put_blob(archives["1"]))
    assert repo.get("plain").pool.batcher is None
    off = ModelRepository(store, instances=1, num_threads=1, batch_delay=None)
    off.load("m", store.put_blob(bucketed))
    assert off.get("m").pool.batcher is None
    assert RuntimeSettings(runtime_batch_delay_ms=-1).batch_delay is None
    assert RuntimeSettings(runtime_batch_delay_ms=2).batch_delay == pytest.approx(0.002)


def test_a_failing_run_fails_every_request_of_its_batch():
    calls = []

    def run(inputs):
        calls.append(len(inputs["x"]))
        raise RuntimeError("the kernel crashed")

    batcher = DynamicBatcher(run, lambda inputs: len(inputs["x"]), 8, 0.05, workers=1)
    errors = []

    def one(_):
        try:
            batcher.submit({"x": np.ones((1, 2), np.float32)})
        except RuntimeError as err:
            errors.append(str(err))

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(4)))
    batcher.close()
    assert errors == ["the kernel crashed"] * 4
    assert sum(calls) == 4


def test_the_server_batches_tritonclient_requests_and_counts_them(tmp_path, bucketed):
    settings = RuntimeSettings(
        data_dir=tmp_path,
        store_url=str(tmp_path / "store"),
        runtime_instances=1,
        num_threads=1,
        runtime_batch_delay_ms=20,
    )
    digest = settings.store().put_blob(bucketed)
    port = free_port()
    uv = uvicorn.Server(
        uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        address = f"127.0.0.1:{port}"
        triton.InferenceServerClient(address).load_model(
            "m", config=json.dumps({"artifact": digest})
        )
        local = threading.local()  # a tritonclient (gevent inside) stays on its thread

        def one(i: int):
            if not hasattr(local, "client"):
                local.client = triton.InferenceServerClient(address)
            x = rows(i, 1 + i % 2)
            request = triton.InferInput("x", list(x.shape), "FP32")
            request.set_data_from_numpy(x, binary_data=True)
            return x, local.client.infer("m", [request]).as_numpy("y")

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, range(24)))
        for x, y in results:
            np.testing.assert_allclose(y, expected(x)["y"], rtol=1e-5, atol=1e-5)
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        requests = _metric(metrics, "kiln_runtime_batched_requests_total")
        batches = _metric(metrics, "kiln_runtime_batches_total")
        assert requests == 24 and 1 <= batches < 24, (requests, batches)
    finally:
        uv.should_exit = True
        thread.join(timeout=10)


def _metric(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(f'{name}{{model="m"'))
    return float(line.rsplit(" ", 1)[1])
