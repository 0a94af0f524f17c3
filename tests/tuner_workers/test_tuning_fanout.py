"""A compile job's tuning fanned out per workload, as service functions over a real SQLite
ledger, filesystem store and JSONL log: budget shares, one message per workload, the job
tuning what nobody took, a worker's message tuning one workload, a lapsed claim taken over,
cancellation. (Real Celery workers sharing a job: tests/e2e/test_tuning_fanout.py.)"""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import onnx
from onnx import helper

from compiler_core.autotune.records import FileLog
from compiler_core.target import parse_target
from tests.conftest import FLOAT, make_model
from tests.tuner_workers.test_compile_job import new_job, platform  # noqa: F401
from tuner_workers import tuning

RNG = np.random.default_rng(1)


def two_matmul_model() -> onnx.ModelProto:
    """Two dense workloads of different shapes (two tuning tasks)."""
    w1 = RNG.standard_normal((32, 48)).astype(np.float32)
    w2 = RNG.standard_normal((48, 16)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["y"]),
        helper.make_node("Relu", ["y"], ["r"]),
        helper.make_node("MatMul", ["r", "w2"], ["z"]),
    ]
    return make_model(nodes, [("x", FLOAT, [4, 32])], [("z", FLOAT, [4, 16])], {"w1": w1, "w2": w2})


@dataclasses.dataclass
class Work:
    key: str
    weight: int
    flops: float
    workload: str = ""


def test_budget_shares_add_up_to_the_budget_in_proportion_to_the_work():
    tasks = [Work("a", 2, 3e6), Work("b", 1, 1e6), Work("c", 1, 1e5)]
    shares = tuning.budget_shares(tasks, 20, None)
    # A trial each (the latency estimate needs every task measured), the other 17 in
    # proportion: 14.4, 2.4, 0.2 -> 14, 3, 0 (the one left to the largest remainder).
    assert [s["trials_budget"] for s in shares] == [15, 4, 1]
    assert [s["index"] for s in shares] == [0, 1, 2]
    assert [s["trials_budget"] for s in tuning.budget_shares(tasks, 2, None)] == [2, 0, 0]
    seconds = tuning.budget_shares(tasks, None, 71.0)
    assert [round(s["seconds_budget"], 9) for s in seconds] == [60.0, 10.0, 1.0]
    assert all(s["trials_budget"] is None for s in seconds)


def test_a_job_fans_its_workloads_out_and_tunes_those_nobody_took(platform):  # noqa: F811
    settings, ledger, store = platform
    new_job(platform, two_matmul_model())
    ledger.update_job("c-1", tuning={"trials": 12})
    sent = []
    job = service_run(platform, send=lambda job_id, key: sent.append((job_id, key)))
    assert job["status"] == "done", job
    entries = ledger.tuning_tasks("c-1")
    assert len(entries) == 2 and sorted(sent) == sorted(("c-1", e["key"]) for e in entries)
    assert all(e["status"] == "done" for e in entries)
    assert sum(e["trials"] for e in entries) == 12
    assert job["progress"] == {
        "tasks_done": 2,
        "tasks_total": 2,
        "estimated_ms": job["progress"]["estimated_ms"],
    }
    assert job["progress"]["estimated_ms"] > 0
    records = FileLog(settings.data_dir / "tuning.jsonl").records()
    assert sum(not r.retimed for r in records) == 12  # the trials; then the best re-timed
    assert {r.workload_key for r in records} == {e["key"] for e in entries}
    events = [e for _, e in ledger.read_events("c-1") if e["type"] == "tuning"]
    assert {e["status"] for e in events if e["trials"] > 0} >= {"done"}
    # Then the tuned workloads timed inside the model, tuned and untuned, before the build.
    (checked,) = [e for _, e in ledger.read_events("c-1") if e["type"] == "in_model"]
    in_model = [r for r in records if r.in_model]
    assert len(in_model) == 2 * checked["checked"] and checked["checked"] <= 2
    assert len(checked["kept_default"]) <= checked["checked"]


def test_budget_a_converged_search_leaves_goes_to_the_next_workload(platform):  # noqa: F811
    """The first workload's search ends before its share (its space is small): what it left
    is added to the next workload's budget, so the job spends what it was given."""
    settings, ledger, store = platform
    new_job(platform, two_matmul_model())
    ledger.update_job("c-1", tuning={"trials": 400})
    job = service_run(platform, send=None)
    assert job["status"] == "done", job
    first, second = ledger.tuning_tasks("c-1")
    assert first["trials"] < first["trials_budget"]  # converged early
    left = first["trials_budget"] - first["trials"]
    assert second["trials_budget"] == 400 - first["trials_budget"] + left
    # What the second left stays with the job (nothing is left to tune).
    assert ledger.take_spare("c-1") == (second["trials_budget"] - second["trials"], 0.0)


def test_a_worker_s_message_tunes_its_workload_from_the_job_s_model(platform):  # noqa: F811
    settings, ledger, store = platform
    job = new_job(platform, two_matmul_model())
    ledger.update_job("c-1", status="running", tuning={"trials": 10})
    tasks = tuning.job_tasks(store, job, parse_target("llvm"))
    entries = ledger.add_tuning_tasks("c-1", tuning.budget_shares(list(tasks.values()), 10, None))
    first = entries[0]
    entry = tuning.run_tune_message(ledger, store, settings, "c-1", first["key"])
    assert entry["status"] == "done" and entry["trials"] == first["trials_budget"] > 0
    assert entry["best_gflops"] > 0 and entry["owner"]
    records = FileLog(settings.data_dir / "tuning.jsonl").records()
    assert {r.workload_key for r in records} == {first["key"]}
    # A second message for the same workload finds it ended and measures nothing.
    again = tuning.run_tune_message(ledger, store, settings, "c-1", first["key"])
    assert again["status"] == "done"
    assert len(FileLog(settings.data_dir / "tuning.jsonl").records()) == len(records)


def test_a_workload_whose_worker_stopped_heartbeating_is_taken_over(platform):  # noqa: F811
    """Another host claims a workload and goes silent: the job waits out its lease, then
    tunes it itself."""
    settings, ledger, store = platform
    new_job(platform, two_matmul_model())
    ledger.update_job("c-1", tuning={"trials": 8})
    taken = []

    def claim_elsewhere(job_id, key):
        if not taken:
            entry = ledger.claim_tuning_task(job_id, key, "elsewhere:1", settings.job_lease_seconds)
            taken.append(entry["key"])

    started = time.monotonic()
    job = service_run(platform, send=claim_elsewhere)
    assert job["status"] == "done", job
    assert time.monotonic() - started >= settings.job_lease_seconds
    entry = ledger.get_tuning_task("c-1", taken[0])
    assert entry["status"] == "done" and entry["attempts"] == 2
    assert entry["owner"] != "elsewhere:1"


def test_cancelling_a_job_stops_its_tuning(platform):  # noqa: F811
    settings, ledger, store = platform
    new_job(platform, two_matmul_model())
    ledger.update_job("c-1", tuning={"time_budget": 600})

    def cancel_soon(job_id, key):
        if key == ledger.tuning_tasks(job_id)[0]["key"]:
            cancel = lambda: ledger.update_job(job_id, status="cancelled")  # noqa: E731
            threading.Timer(0.5, cancel).start()

    started = time.monotonic()
    job = service_run(platform, send=cancel_soon)
    assert job["status"] == "cancelled"
    assert time.monotonic() - started < 60
    assert not all(e["status"] == "done" for e in ledger.tuning_tasks("c-1"))


def service_run(platform, send, job_id="c-1"):  # noqa: F811
    from tuner_workers import service

    settings, ledger, store = platform
    return service.run_compile_job(job_id, ledger, store, settings, send_tuning=send)
