"""Deployment sync: every runtime server converges on the deployments listed in the store."""

from __future__ import annotations

import numpy as np
from fastapi.testclient import TestClient

from runtime_server.app import create_app
from runtime_server.repository import READY, UNAVAILABLE, ModelRepository
from runtime_server.sync import DEPLOYMENTS, sync_once
from tests.runtime_server.conftest import IN, expected, make_settings

X = np.linspace(-1, 1, IN, dtype=np.float32).reshape(1, IN)


def deploy(store, name, version, artifact):
    doc = {"name": name, "version": version, "artifact": artifact}
    store.put_manifest(DEPLOYMENTS, f"{name}/{version}", doc)


def states(repository):
    return {(r["name"], r["version"]): r["state"] for r in repository.index()}


def test_sync_loads_changes_and_unloads_only_what_it_loaded(tmp_path, archives):
    store = make_settings(tmp_path).store()
    v1, v2 = store.put_blob(archives["1"]), store.put_blob(archives["2"])
    repository = ModelRepository(store, instances=1, num_threads=1)
    repository.load("by-hand", v1)  # through the repository API: sync leaves it alone
    deploy(store, "tiny", "1", v1)
    sync_once(repository, store)
    assert states(repository) == {("by-hand", "1"): READY, ("tiny", "1"): READY}

    deploy(store, "tiny", "1", v2)  # redeployed with another artifact
    deploy(store, "tiny", "2", v2)
    sync_once(repository, store)
    assert repository.get("tiny", "1").artifact == v2
    np.testing.assert_allclose(repository.infer("tiny", "2", {"x": X})["y"], expected(X, "2")["y"])

    store.delete_manifest(DEPLOYMENTS, "tiny/1")
    store.delete_manifest(DEPLOYMENTS, "tiny/2")
    sync_once(repository, store)
    assert states(repository) == {
        ("by-hand", "1"): READY,
        ("tiny", "1"): UNAVAILABLE,
        ("tiny", "2"): UNAVAILABLE,
    }


def test_a_deployment_that_cannot_load_does_not_stop_the_others(tmp_path, archives):
    store = make_settings(tmp_path).store()
    good = store.put_blob(archives["1"])
    deploy(store, "gone", "1", "sha256:" + "0" * 64)
    deploy(store, "tiny", "1", good)
    repository = ModelRepository(store, instances=1, num_threads=1)
    sync_once(repository, store)
    assert states(repository) == {("tiny", "1"): READY}


def test_a_starting_server_serves_what_is_deployed(tmp_path, archives):
    settings = make_settings(tmp_path)
    store = settings.store()
    deploy(store, "tiny", "1", store.put_blob(archives["1"]))
    with TestClient(create_app(settings)) as client:
        assert client.get("/v2/models/tiny/ready").status_code == 200
        body = {"inputs": [{"name": "x", "shape": [1, IN], "datatype": "FP32",
                            "data": X.reshape(-1).tolist()}]}  # fmt: skip
        outputs = client.post("/v2/models/tiny/infer", json=body).json()["outputs"]
        y = next(o for o in outputs if o["name"] == "y")
        np.testing.assert_allclose(y["data"], expected(X)["y"].reshape(-1), rtol=1e-5)
