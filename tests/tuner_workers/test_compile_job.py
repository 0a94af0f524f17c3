"""Compile jobs as service functions, over a real filesystem store and SQLite ledger: stages,
idempotency, byte-identical redo, failures with reasons, cancellation, orphan recovery."""

from __future__ import annotations

import time

import numpy as np
import onnx
import pytest
from onnx import helper

from artifact_store import FileStore
from compiler_core.autotune.records import FileLog
from compiler_core.runtime import load
from tests.conftest import FLOAT, make_model
from tuner_workers import service
from tuner_workers.ledger import Ledger, SqliteBackend
from tuner_workers.settings import KilnSettings

RNG = np.random.default_rng(0)
W = RNG.standard_normal((8, 4)).astype(np.float32)


def tiny_model() -> onnx.ModelProto:
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Relu", ["y"], ["z"])]
    return make_model(nodes, [("x", FLOAT, ["n", 8])], [("z", FLOAT, ["n", 4])], {"w": W})


def unsupported_model() -> onnx.ModelProto:
    node = helper.make_node("NoSuchOp", ["x"], ["z"], name="the_odd_one")
    return make_model([node], [("x", FLOAT, [2])], [("z", FLOAT, [2])])


@pytest.fixture
def platform(tmp_path):
    settings = KilnSettings(data_dir=tmp_path, heartbeat_seconds=0.1, job_lease_seconds=1.0)
    return settings, Ledger(SqliteBackend(tmp_path / "ledger.sqlite")), FileStore(tmp_path / "s")


def new_job(
    platform, model: onnx.ModelProto, shapes=None, tenant="a", job_id="c-1", target="llvm"
) -> dict:
    settings, ledger, store = platform
    digest = store.put_blob(model.SerializeToString())
    options = {"shapes": shapes, "tuning": None}
    now = time.time()
    queue = "cpu" if target == "llvm" else "cuda.sm_90"
    return ledger.create_job({
        "id": job_id, "tenant": tenant, "model": "m-x", "model_digest": digest,
        "target": target, **options, "key": service.job_key(digest, target, options, "test"),
        "compiler_version": "test", "queue": queue, "status": "queued", "stage": "queued",
        "attempts": 0, "created": now, "updated": now,
    })  # fmt: skip


def run(platform, job_id="c-1"):
    settings, ledger, store = platform
    return service.run_compile_job(job_id, ledger, store, settings)


def test_a_job_runs_every_stage_and_stores_a_verified_artifact(platform):
    _, ledger, store = platform
    new_job(platform, tiny_model(), {"x": [3, 8]})
    job = run(platform)
    assert job["status"] == "done", job
    assert job["verification"]["passed"] and job["best_latency_ms"] > 0
    stages = [e["stage"] for _, e in ledger.read_events("c-1") if e["type"] == "stage"]
    assert stages == list(service.STAGES)
    assert ledger.owns_artifact("a", job["artifact"])
    module = load(store.get_blob(job["artifact"]))
    x = RNG.standard_normal((3, 8)).astype(np.float32)
    np.testing.assert_allclose(module.run({"x": x})["z"], np.maximum(x @ W, 0), rtol=1e-5)
    manifest = store.get_manifest("artifacts", job["artifact"])
    assert manifest["model"] == job["model_digest"] and manifest["options"]["shapes"]


def test_the_same_job_key_reuses_its_artifact_and_a_redo_is_byte_identical(platform):
    settings, ledger, store = platform
    new_job(platform, tiny_model(), {"x": [3, 8]}, tenant="a", job_id="c-1")
    first = run(platform, "c-1")
    # Another tenant asks for the same compilation: same key, same artifact, now theirs too.
    new_job(platform, tiny_model(), {"x": [3, 8]}, tenant="b", job_id="c-2")
    second = run(platform, "c-2")
    assert second["artifact"] == first["artifact"] and second["reused"]
    # What was checked and measured when it was built, reported with the reuse too.
    assert second["verification"] == first["verification"]
    assert second["verification"]["passed"] is True
    assert second["best_latency_ms"] == first["best_latency_ms"] > 0
    assert ledger.owns_artifact("b", first["artifact"])
    # Redone from scratch (its job record gone, its blob deleted): the very same bytes.
    store.delete_manifest("jobs", first["key"])
    before = store.get_blob(first["artifact"])
    store.delete_blob(first["artifact"])
    new_job(platform, tiny_model(), {"x": [3, 8]}, job_id="c-3")
    third = run(platform, "c-3")
    assert third["artifact"] == first["artifact"]
    assert store.get_blob(third["artifact"]) == before


def test_an_unsupported_operator_fails_the_job_with_the_node_named(platform):
    _, ledger, store = platform
    new_job(platform, unsupported_model())
    job = run(platform)
    assert job["status"] == "failed"
    assert "the_odd_one" in job["error"] and "NoSuchOp" in job["error"]
    assert list(store.list_manifests("artifacts")) == []
    assert ledger.read_events("c-1")[-1][1]["type"] == "failed"


def test_a_symbolic_input_without_a_shape_fails_with_the_input_named(platform):
    """Only a batch axis has a default (1); a symbolic feature axis must be bound."""
    nodes = [helper.make_node("Relu", ["x"], ["z"])]
    model = make_model(nodes, [("x", FLOAT, [2, "features"])], [("z", FLOAT, [2, "features"])])
    new_job(platform, model, shapes=None)
    job = run(platform)
    assert job["status"] == "failed" and "'x'" in job["error"] and "'features'" in job["error"]


def test_an_unbound_batch_compiles_for_batch_one_and_the_manifest_says_so(platform):
    _, _, store = platform
    new_job(platform, tiny_model(), shapes=None)
    job = run(platform)
    assert job["status"] == "done", job
    assert job["verification"]["passed"] is True


def test_a_cancelled_job_is_not_run(platform):
    _, ledger, store = platform
    new_job(platform, tiny_model(), {"x": [1, 8]})
    ledger.update_job("c-1", status="cancelled")
    assert run(platform)["status"] == "cancelled"
    assert list(store.list_blobs()) and not store.list_manifests("artifacts")


def test_a_job_held_by_a_live_owner_is_not_run_twice(platform):
    settings, ledger, _ = platform
    new_job(platform, tiny_model(), {"x": [1, 8]})
    ledger.claim_job("c-1", "elsewhere:1", lease_seconds=60)
    assert run(platform) is None
    assert ledger.get_job("c-1")["owner"] == "elsewhere:1"


def test_orphans_are_requeued_once(platform):
    settings, ledger, _ = platform
    new_job(platform, tiny_model(), {"x": [1, 8]}, job_id="c-dead")
    new_job(platform, tiny_model(), {"x": [1, 8]}, job_id="c-stale")
    new_job(platform, tiny_model(), {"x": [1, 8]}, job_id="c-alive")
    ledger.claim_job("c-dead", f"{service.process_owner().split(':')[0]}:999999999", 60)
    ledger.claim_job("c-stale", "other-host:1", 60)
    ledger.claim_job("c-alive", service.process_owner(), 60)
    ledger.backend.update("job", "c-stale", lambda j: {**j, "heartbeat": time.time() - 120})
    sent = []
    requeued = service.requeue_orphans(ledger, 60, lambda job: sent.append(job["id"]))
    assert sorted(requeued) == sorted(sent) == ["c-dead", "c-stale"]
    assert ledger.get_job("c-dead")["status"] == "queued"
    assert service.requeue_orphans(ledger, 60, sent.append) == []
    # Taken up again, the job runs to the end.
    assert run(platform, "c-dead")["status"] == "done"


def test_job_keys_depend_on_every_input():
    base = service.job_key("sha256:a", "llvm", {"shapes": {"x": [1]}}, "1")
    assert base == service.job_key("sha256:a", "llvm", {"shapes": {"x": [1]}}, "1")
    assert base != service.job_key("sha256:b", "llvm", {"shapes": {"x": [1]}}, "1")
    assert base != service.job_key("sha256:a", "llvm -mcpu=znver4", {"shapes": {"x": [1]}}, "1")
    assert base != service.job_key("sha256:a", "llvm", {"shapes": {"x": [2]}}, "1")
    assert base != service.job_key("sha256:a", "llvm", {"shapes": {"x": [1]}}, "2")


def test_a_job_with_a_tuning_budget_tunes_against_the_shared_log(platform):
    settings, ledger, store = platform
    new_job(platform, tiny_model(), {"x": [4, 8]})
    ledger.update_job("c-1", tuning={"trials": 5})
    job = run(platform)
    assert job["status"] == "done", job
    assert job["progress"]["tasks_total"] == 1
    tuning = [e for _, e in ledger.read_events("c-1") if e["type"] == "tuning"]
    assert tuning and tuning[-1]["trials"] == 5 and tuning[-1]["best_gflops"] > 0
    records = FileLog(settings.data_dir / "tuning.jsonl").records()
    assert sum(not r.retimed for r in records) == 5  # and the best ones re-timed
    assert any(r.retimed for r in records)
    kernels = load(store.get_blob(job["artifact"])).manifest["kernels"].values()
    assert any(isinstance(k, dict) and k["schedule"] == "tuned" for k in kernels)


def test_tuning_a_cuda_job_on_a_worker_without_a_gpu_fails_saying_where_to_tune(platform):
    from compiler_core.runtime.cuda import cuda_available

    if cuda_available()[0]:
        pytest.skip("a CUDA device is here: the job would tune on it")
    settings, ledger, store = platform
    new_job(platform, tiny_model(), {"x": [4, 8]}, target="cuda -arch=sm_90")
    ledger.update_job("c-1", tuning={"trials": 5})
    job = run(platform)
    assert job["status"] == "failed" and "no CUDA device" in job["error"], job
    assert "OpenCL twin" in job["error"]
    assert (
        not (settings.data_dir / "tuning.jsonl").exists()
        or not FileLog(settings.data_dir / "tuning.jsonl").records()
    )


def test_tuned_cuda_jobs_go_to_a_queue_only_gpu_workers_consume():
    from tuner_workers.__main__ import cpu_queues
    from tuner_workers.celery_app import queue_for_target

    assert queue_for_target("cuda -arch=sm_80") == "cuda.sm_80"
    assert queue_for_target("cuda -arch=sm_80", tuned=True) == "cuda.sm_80.gpu"
    assert queue_for_target("llvm", tuned=True) == "cpu"
    assert "cuda.sm_80" in cpu_queues() and "cuda.sm_80.gpu" not in cpu_queues()


def test_the_compiler_version_names_the_sources_that_built_an_artifact(tmp_path):
    """A job key holds the compiler version, and the version a digest of the compiler's
    sources: an edited compiler under the same version number does not reuse the artifacts
    the old one built."""
    from importlib.metadata import version

    assert service.compiler_version().startswith(version("kiln") + "+")
    digest = service.source_digest.__wrapped__  # uncached: the tree changes below
    (tmp_path / "kernels").mkdir()
    (tmp_path / "build.py").write_text("TILE = 8\n")
    (tmp_path / "kernels" / "pool.c").write_text("int spin;\n")
    (tmp_path / "notes.txt").write_text("not a source\n")
    before = digest(tmp_path)
    (tmp_path / "notes.txt").write_text("still not a source\n")
    assert digest(tmp_path) == before
    (tmp_path / "kernels" / "pool.c").write_text("int spin = 1;\n")
    assert digest(tmp_path) != before
    key = service.job_key("sha256:m", "llvm", {}, service.compiler_version())
    assert key != service.job_key("sha256:m", "llvm", {}, version("kiln"))
