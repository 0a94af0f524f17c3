"""Crash tests: SIGKILL the worker mid-compilation; a restarted worker takes the job up again
and stores the artifact a direct build makes (`same_build`), and a tuning job resumes its search
from the log. On
SQLite the broker never redelivers the fetched message and on Redis only after the visibility
timeout: the ledger's orphan watch does it."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import zipfile

import httpx
import pytest

import compiler_core
from compiler_core.autotune.records import RedisLog
from tests.autotune.test_tuner import dense_model
from tests.conftest import shared_model
from tests.e2e.platform import Platform, free_port, redis_url, stop_group, wait_until

KEY = "crash-key"


def start(module_args: list[str], env: dict, log) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", *module_args],
        env=env,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


class Processes:
    """The api and a worker as processes of their own (not `kiln serve`: the test kills the
    worker alone), a way to start the next worker, and a clean stop of all of them."""

    def __init__(self, tmp_path, redis: str | None, worker_concurrency: int = 1):
        self.env = dict(os.environ, KILN_DATA_DIR=str(tmp_path), KILN_API_KEYS=f"tests:{KEY}")
        self.env["KILN_WORKER_CONCURRENCY"] = str(worker_concurrency)
        self.env.update(KILN_HEARTBEAT_SECONDS="0.5", KILN_JOB_LEASE_SECONDS="60")
        self.env.update(KILN_NUM_THREADS="1")
        self.env.pop("KILN_REDIS_URL", None)
        if redis:
            self.env["KILN_REDIS_URL"] = redis
        self.log = tmp_path / "platform.log"
        port = free_port()
        self.running = [start(["api", "--port", str(port)], self.env, self.log)]
        self.worker = self.start_worker()
        self.platform = Platform(f"http://127.0.0.1:{port}", "", KEY, self.log)
        ready = lambda: httpx.get(self.platform.api + "/health/ready").is_success  # noqa: E731
        wait_until(ready, 60, "api", self.log)

    def start_worker(self) -> subprocess.Popen:
        self.worker = start(["tuner_workers", "worker", "-Q", "cpu"], self.env, self.log)
        self.running.append(self.worker)
        return self.worker

    def kill_worker(self) -> None:
        os.killpg(self.worker.pid, signal.SIGKILL)
        self.worker.wait(10)

    def stop(self) -> None:
        for process in self.running:
            stop_group(process)


def same_build(a: bytes, b: bytes) -> bool:
    """Whether two module archives hold the same build: every member byte for byte, the
    manifest but for the verification's measured error. That error comes from the reference
    executor's float32 sums, which numpy's BLAS rounds by its thread count: a worker runs with
    one thread, and this process's may differ (MobileNetV2: 2.2e-6 with two, 2.5e-6 with one)."""

    def members(archive: bytes) -> dict[str, object]:
        with zipfile.ZipFile(io.BytesIO(archive)) as z:
            found: dict[str, object] = {name: z.read(name) for name in z.namelist()}
        manifest = json.loads(found["manifest.json"])
        assert manifest["verification"].pop("max_abs_error") < 1e-4
        found["manifest.json"] = manifest
        return found

    return members(a) == members(b)


@pytest.mark.parametrize("backend", ["embedded", "redis"])
def test_a_killed_worker_s_job_is_finished_by_the_next_worker(backend, tmp_path):
    processes = Processes(tmp_path, redis_url(13) if backend == "redis" else None)
    platform = processes.platform
    try:
        path = shared_model("mobilenet_v2")
        model = platform.upload(path.read_bytes())
        shapes = {model["inputs"][0]["name"]: [1, 3, 224, 224]}
        job_id = platform.compile(model["id"], shapes)["id"]
        building = wait_until(
            lambda: platform.job(job_id)["stage"] == "building",
            120,
            "job never built",
            platform.log,
        )
        assert building
        processes.kill_worker()
        orphan = platform.job(job_id)
        assert orphan["status"] == "running" and orphan["stage"] == "building"

        processes.start_worker()
        job = platform.wait_job(job_id, seconds=300)
        assert job["status"] == "done", job
        assert job["attempts"] == 2
        events = platform.client.get(f"/v1/compilations/{job_id}/events").text
        assert "event: requeued" in events

        stored = platform.client.get(f"/v1/artifacts/{job['artifact']}").content
        direct = compiler_core.compile(path.read_bytes(), "llvm", shapes=shapes).to_bytes()
        assert same_build(stored, direct)
    finally:
        processes.stop()


def test_a_tuning_job_killed_mid_search_resumes_without_losing_or_repeating_records(tmp_path):
    """The shared Redis tuning log keeps every measured record; the job taken up again resumes
    its search from the log instead of measuring a config twice."""
    redis = redis_url(13)
    processes = Processes(tmp_path, redis)
    platform = processes.platform
    tuning_log = RedisLog(redis)
    try:
        model = platform.upload(dense_model().SerializeToString())
        body = {"model": model["id"], "target": "llvm", "tuning": {"trials": 16}}
        job_id = platform.client.post("/v1/compilations", json=body).json()["id"]

        def measuring():
            return platform.job(job_id)["stage"] == "tuning" and len(tuning_log.records()) >= 4

        wait_until(measuring, 120, "the job never measured", platform.log)
        processes.kill_worker()
        measured_before = len(tuning_log.records())
        processes.start_worker()
        job = platform.wait_job(job_id, seconds=300)
        assert job["status"] == "done", job
        records = tuning_log.records()
        pairs = [(r.workload_key, r.config_key) for r in records if not r.retimed]
        assert len(pairs) == len(set(pairs))  # no config measured twice by the search
        assert len(records) > measured_before  # the search went on after the restart
        manifest = platform.client.get(f"/v1/artifacts/{job['artifact']}/manifest").json()
        assert manifest["verification"]["passed"]
    finally:
        processes.stop()
