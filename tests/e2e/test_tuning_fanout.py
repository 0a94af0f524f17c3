"""A tuned compile job shared by real Celery worker processes: the job fans its workloads out
on its queue, a second process of the worker takes some of them, both write to the shared
Redis log, and the job builds with what they found."""

from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import helper

from compiler_core.autotune.records import RedisLog
from compiler_core.runtime import load
from tests.conftest import FLOAT, make_model
from tests.e2e.platform import redis_url
from tests.e2e.test_crash_recovery import Processes

RNG = np.random.default_rng(2)


def three_matmul_model() -> onnx.ModelProto:
    """Three dense workloads of different shapes: three tuning tasks."""
    widths = [48, 64, 40, 24]
    weights = {
        f"w{k}": RNG.standard_normal((widths[k], widths[k + 1])).astype(np.float32)
        for k in range(3)
    }
    nodes = [
        helper.make_node("MatMul", ["x", "w0"], ["h0"]),
        helper.make_node("Relu", ["h0"], ["r0"]),
        helper.make_node("MatMul", ["r0", "w1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["r1"]),
        helper.make_node("MatMul", ["r1", "w2"], ["z"]),
    ]
    return make_model(nodes, [("x", FLOAT, [8, 48])], [("z", FLOAT, [8, 24])], weights)


def test_two_worker_processes_share_a_job_s_tuning_tasks(tmp_path):
    redis = redis_url(12)
    processes = Processes(tmp_path, redis, worker_concurrency=2)
    platform = processes.platform
    try:
        model = platform.upload(three_matmul_model().SerializeToString())
        body = {"model": model["id"], "target": "llvm", "tuning": {"trials": 48}}
        job_id = platform.client.post("/v1/compilations", json=body).json()["id"]
        job = platform.wait_job(job_id, seconds=300)
        assert job["status"] == "done", job
        assert job["progress"]["tasks_done"] == job["progress"]["tasks_total"] == 3
        assert job["progress"]["estimated_ms"] > 0

        events = _events(platform, job_id)
        ended = [e for e in events if e.get("status") == "done"]
        assert sorted(e["task"] for e in ended) == [0, 1, 2]
        workers = {e["worker"] for e in ended}
        assert len(workers) == 2, ended  # the job's process and the worker's other one
        records = RedisLog(redis).records()
        searched = [r for r in records if not r.retimed]
        assert len(searched) == sum(e["trials"] for e in ended) == 48
        assert len({r.workload_key for r in records}) == 3
        pairs = [(r.workload_key, r.config_key) for r in searched]
        assert len(pairs) == len(set(pairs))  # no config measured twice by the search
        # ... and each workload's best configs timed again once its search ended.
        retimed = {(r.workload_key, r.config_key) for r in records if r.retimed}
        assert retimed and retimed <= set(pairs)
        manifest = platform.client.get(f"/v1/artifacts/{job['artifact']}/manifest").json()
        assert manifest["verification"]["passed"]
        archive = load(platform.client.get(f"/v1/artifacts/{job['artifact']}").content)
        kernels = archive.manifest["kernels"].values()
        tuned = [k for k in kernels if isinstance(k, dict) and k.get("schedule") == "tuned"]
        assert tuned
    finally:
        processes.stop()


def _events(platform, job_id: str) -> list[dict]:
    text = platform.client.get(f"/v1/compilations/{job_id}/events").text
    assert "event: done" in text
    return [
        json.loads(line.removeprefix("data: "))
        for block in text.split("\n\n")
        if "event: tuning" in block
        for line in block.splitlines()
        if line.startswith("data: ")
    ]
