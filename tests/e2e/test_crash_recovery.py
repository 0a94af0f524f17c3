"""Crash test: SIGKILL the worker mid-compilation; a restarted worker takes the job up again
and stores a byte-identical artifact. On SQLite the broker never redelivers the fetched
message and on Redis only after the visibility timeout: the ledger's orphan watch does it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

import compiler_core
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


@pytest.mark.parametrize("backend", ["embedded", "redis"])
def test_a_killed_worker_s_job_is_finished_by_the_next_worker(backend, tmp_path):
    env = dict(os.environ, KILN_DATA_DIR=str(tmp_path), KILN_API_KEYS=f"tests:{KEY}")
    env.update(KILN_HEARTBEAT_SECONDS="0.5", KILN_JOB_LEASE_SECONDS="60", KILN_NUM_THREADS="1")
    env.pop("KILN_REDIS_URL", None)
    if backend == "redis":
        env["KILN_REDIS_URL"] = redis_url(13)
    log = tmp_path / "platform.log"
    port = free_port()
    api = start(["api", "--port", str(port)], env, log)
    worker = start(["tuner_workers", "worker", "-Q", "cpu"], env, log)
    second = None
    try:
        platform = Platform(f"http://127.0.0.1:{port}", "", KEY, log)
        wait_until(lambda: httpx.get(platform.api + "/health/ready").is_success, 60, "api", log)
        path = shared_model("mobilenet_v2")
        model = platform.upload(path.read_bytes())
        shapes = {model["inputs"][0]["name"]: [1, 3, 224, 224]}
        job_id = platform.compile(model["id"], shapes)["id"]

        building = wait_until(
            lambda: platform.job(job_id)["stage"] == "building", 120, "job never built", log
        )
        assert building
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(10)
        orphan = platform.job(job_id)
        assert orphan["status"] == "running" and orphan["stage"] == "building"

        second = start(["tuner_workers", "worker", "-Q", "cpu"], env, log)
        job = platform.wait_job(job_id, seconds=300)
        assert job["status"] == "done", job
        assert job["attempts"] == 2
        events = platform.client.get(f"/v1/compilations/{job_id}/events").text
        assert "event: requeued" in events

        stored = platform.client.get(f"/v1/artifacts/{job['artifact']}").content
        direct = compiler_core.compile(path.read_bytes(), "llvm", shapes=shapes).to_bytes()
        assert stored == direct
    finally:
        for process in (api, worker, second):
            if process is not None:
                stop_group(process)
