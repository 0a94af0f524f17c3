"""The repository as plain service code: a real FileStore and real module archives."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from artifact_store import FileStore
from runtime_server.repository import (
    ArtifactMissing,
    InstancePool,
    InvalidRequest,
    ModelNotFound,
    ModelNotReady,
    ModelRepository,
    version_key,
)
from runtime_server.settings import RuntimeSettings
from tests.runtime_server.conftest import IN, expected

X = np.linspace(-1, 1, IN, dtype=np.float32).reshape(1, IN)


@pytest.fixture
def store(tmp_path):
    return FileStore(tmp_path / "store")


@pytest.fixture
def repo(store):
    return ModelRepository(store, instances=2, num_threads=1)


def test_load_infer_and_metadata(repo, store, archives):
    repo.load("m", store.put_blob(archives["1"]))
    np.testing.assert_allclose(repo.infer("m", None, {"x": X})["y"], expected(X)["y"], atol=1e-6)
    meta = repo.metadata("m")
    assert (meta.name, meta.version, meta.versions) == ("m", "1", ["1"])
    assert [name for name, _, _ in meta.outputs] == ["y", "z"]


def test_latest_version_is_numeric_then_lexical():
    assert sorted(["10", "9", "b", "2", "a"], key=version_key) == ["a", "b", "2", "9", "10"]


def test_latest_ready_version_is_used(repo, store, archives):
    one, two = store.put_blob(archives["1"]), store.put_blob(archives["2"])
    repo.load("m", one, "9")
    repo.load("m", two, "10")
    assert repo.get("m").version == "10"
    np.testing.assert_allclose(repo.infer("m", "9", {"x": X})["y"], expected(X)["y"], atol=1e-6)
    np.testing.assert_allclose(
        repo.infer("m", None, {"x": X})["y"], expected(X, "2")["y"], atol=1e-6
    )


def test_unload_keeps_the_entry_and_reload_by_name(repo, store, archives):
    repo.load("m", store.put_blob(archives["1"]))
    repo.unload("m")
    assert repo.index() == [
        {"name": "m", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}
    ]
    with pytest.raises(ModelNotReady, match="'m'"):
        repo.infer("m", "1", {"x": X})
    with pytest.raises(ModelNotReady, match="unloaded"):
        repo.metadata("m")
    repo.load("m")
    assert repo.index()[0]["state"] == "READY"
    assert repo.ready_count() == 1


def test_reload_failure_is_reported_in_the_index(repo, store, archives):
    digest = store.put_blob(archives["1"])
    repo.load("m", digest)
    repo.unload("m")
    store.delete_blob(digest)
    with pytest.raises(ArtifactMissing, match=digest):
        repo.load("m")
    [row] = repo.index()
    assert row["state"] == "UNAVAILABLE" and "not in the artifact store" in row["reason"]


def test_failed_reload_keeps_a_loaded_version_serving(repo, store, archives):
    digest = store.put_blob(archives["1"])
    repo.load("m", digest)
    store.delete_blob(digest)
    with pytest.raises(ArtifactMissing):
        repo.load("m")
    assert repo.index()[0]["state"] == "READY"
    np.testing.assert_allclose(repo.infer("m", "1", {"x": X})["z"], 2 * X)


def test_errors(repo, store, archives):
    with pytest.raises(ModelNotFound, match="give parameters.artifact"):
        repo.load("m")
    with pytest.raises(ModelNotFound):
        repo.unload("m")
    with pytest.raises(InvalidRequest, match="invalid model name"):
        repo.load("../m", store.put_blob(archives["1"]))
    repo.load("m", store.put_blob(archives["1"]))
    with pytest.raises(ModelNotFound, match="no version '2'"):
        repo.get("m", "2")
    # The runtime's own input check is the last line of defence: still a client error.
    with pytest.raises(InvalidRequest, match="input 'x'"):
        repo.infer("m", None, {"x": X.astype(np.float64)})


class FakeModule:
    """Counts how many threads are inside run() at once, on this instance and on all."""

    inputs = [("x", (1,), np.dtype(np.float32))]
    outputs = [("y", (1,), np.dtype(np.float32))]
    manifest: dict = {}
    batch_buckets = None
    lock = threading.Lock()
    busy = 0  # instances running right now, across the pool
    most_busy = 0

    def __init__(self):
        self.active = 0
        self.overlaps = 0
        self.runs = 0

    def run(self, inputs):
        cls = type(self)
        with cls.lock:
            self.active += 1
            self.runs += 1
            self.overlaps += self.active > 1
            cls.busy += 1
            cls.most_busy = max(cls.most_busy, cls.busy)
        time.sleep(0.002)  # hold the instance so that other threads contend for it
        with cls.lock:
            self.active -= 1
            cls.busy -= 1
        return {"y": inputs["x"] * 2}


def test_pool_never_shares_an_instance():
    modules = [FakeModule(), FakeModule()]
    pool = InstancePool(modules)

    def one(i: int) -> float:
        return float(pool.run({"x": np.array([i], np.float32)})["y"][0])

    with ThreadPoolExecutor(8) as executor:
        results = list(executor.map(one, range(64)))
    assert results == [2.0 * i for i in range(64)]
    assert sum(m.runs for m in modules) == 64
    assert all(m.overlaps == 0 for m in modules)
    assert FakeModule.most_busy <= 2


def test_settings_read_kiln_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KILN_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("KILN_RUNTIME_INSTANCES", "3")
    monkeypatch.setenv("KILN_RUNTIME_PORT", "9100")
    settings = RuntimeSettings()
    assert settings.runtime_instances == 3 and settings.runtime_port == 9100
    assert settings.resolved_store_url() == str(tmp_path / "store")
    assert isinstance(settings.store(), FileStore)
