"""The ledger on both backends: real Redis (127.0.0.1:6379) and SQLite."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from tuner_workers.ledger import Ledger, RedisBackend, SqliteBackend

REDIS_URL = "redis://127.0.0.1:6379/11"


@pytest.fixture(params=["sqlite", "redis"])
def ledger(request, tmp_path):
    if request.param == "sqlite":
        yield Ledger(SqliteBackend(tmp_path / "ledger.sqlite"))
        return
    backend = RedisBackend(REDIS_URL, prefix=f"test-{uuid.uuid4().hex[:8]}")
    try:
        backend.client.ping()
    except Exception as err:  # noqa: BLE001
        pytest.fail(f"Redis must answer on {REDIS_URL} (`.ci/run` starts one): {err}")
    yield Ledger(backend)
    for key in backend.client.scan_iter(f"{backend.prefix}:*"):
        backend.client.delete(key)


def job(job_id="c-1", tenant="a", **fields):
    now = time.time()
    return {"id": job_id, "tenant": tenant, "status": "queued", "stage": "queued",
            "created": now, "updated": now, **fields}  # fmt: skip


def test_models_are_scoped_by_tenant_and_uploads_are_idempotent(ledger):
    first = ledger.add_model("a", {"id": "m-1", "created": 1.0, "size": 3})
    again = ledger.add_model("a", {"id": "m-1", "created": 2.0, "size": 3})
    assert again == first
    assert ledger.get_model("b", "m-1") is None
    assert [m["id"] for m in ledger.list_models("a")] == ["m-1"]
    assert ledger.list_models("b") == []


def test_claim_heartbeat_and_release(ledger):
    ledger.create_job(job())
    claimed = ledger.claim_job("c-1", "host:1", lease_seconds=60)
    assert claimed["status"] == "running" and claimed["owner"] == "host:1"
    assert claimed["attempts"] == 1
    # A live lease keeps a second owner out; the owner itself may claim again.
    assert ledger.claim_job("c-1", "host:2", lease_seconds=60) is None
    assert ledger.claim_job("c-1", "host:1", lease_seconds=60)["attempts"] == 2
    assert ledger.heartbeat("c-1", "host:1")
    assert not ledger.heartbeat("c-1", "host:2")
    # Once the lease has run out, another owner takes over and the first loses its heartbeat.
    assert ledger.claim_job("c-1", "host:2", lease_seconds=0)["owner"] == "host:2"
    assert not ledger.heartbeat("c-1", "host:1")
    assert ledger.release_job("c-1", "host:1") is None
    released = ledger.release_job("c-1", "host:2")
    assert released["status"] == "queued" and released["owner"] is None


def test_an_ended_job_never_changes_again(ledger):
    ledger.create_job(job())
    assert [j["id"] for j in ledger.active_jobs()] == ["c-1"]
    ledger.update_job("c-1", status="cancelled")
    assert ledger.update_job("c-1", status="running") is None
    assert ledger.claim_job("c-1", "host:1", lease_seconds=0) is None
    assert ledger.get_job("c-1")["status"] == "cancelled"
    assert ledger.active_jobs() == []


def test_concurrent_claims_have_one_winner(ledger):
    ledger.create_job(job())
    winners = []

    def claim(owner):
        if ledger.claim_job("c-1", owner, lease_seconds=60) is not None:
            winners.append(owner)

    threads = [threading.Thread(target=claim, args=(f"host:{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1
    assert ledger.get_job("c-1")["owner"] == winners[0]


def test_events_resume_after_an_id(ledger):
    ledger.create_job(job())
    ids = [ledger.append_event("c-1", {"type": "stage", "stage": s}) for s in "abc"]
    events = ledger.read_events("c-1")
    assert [e["stage"] for _, e in events] == ["a", "b", "c"]
    assert [i for i, _ in events] == ids
    assert [e["stage"] for _, e in ledger.read_events("c-1", after=ids[0])] == ["b", "c"]
    assert ledger.read_events("c-1", after=ids[-1]) == []
    # A malformed Last-Event-ID replays from the start rather than failing.
    assert len(ledger.read_events("c-1", after="not-an-id")) == 3
    assert ledger.read_events("c-other") == []


def test_jobs_artifacts_and_deployments_by_tenant(ledger):
    ledger.create_job(job("c-1", "a", created=1.0))
    ledger.create_job(job("c-2", "b", created=2.0))
    assert [j["id"] for j in ledger.list_jobs("a")] == ["c-1"]
    ledger.grant_artifact("a", "sha256:" + "0" * 64)
    assert ledger.owns_artifact("a", "sha256:" + "0" * 64)
    assert not ledger.owns_artifact("b", "sha256:" + "0" * 64)
    ledger.put_deployment({"name": "mlp", "tenant": "a", "version": "1"})
    assert [d["name"] for d in ledger.list_deployments("a")] == ["mlp"]
    assert ledger.list_deployments("b") == []
    ledger.delete_deployment("mlp", "a")
    assert ledger.get_deployment("mlp") is None and ledger.list_deployments("a") == []
