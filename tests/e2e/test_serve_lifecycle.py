"""`kiln serve` on its own: a development key when none is configured, a clean stop of all
three processes on SIGINT or SIGTERM, and deployments that survive a restart."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as triton

from tests.conftest import shared_model
from tests.e2e.platform import KILN, free_port, kiln_serve, wait_until


def children_of(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM])
def test_serve_makes_a_dev_key_and_stops_cleanly(stop_signal, tmp_path):
    api_port, runtime_port = free_port(), free_port()
    env = dict(os.environ)
    for name in ("KILN_API_KEYS", "KILN_REDIS_URL"):
        env.pop(name, None)
    log = tmp_path / "serve.log"
    process = subprocess.Popen(
        [KILN, "serve", "--api-port", str(api_port), "--runtime-port", str(runtime_port),
         "--data-dir", str(tmp_path)],
        env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        api = f"http://127.0.0.1:{api_port}"
        wait_until(lambda: httpx.get(api + "/health/ready").is_success, 60, "api up", log)
        wait_until(
            lambda: httpx.get(f"http://127.0.0.1:{runtime_port}/v2/health/live").is_success,
            60,
            "runtime up",
            log,
        )
        key_file = tmp_path / "dev-api-key"
        key = key_file.read_text().strip()
        assert oct(key_file.stat().st_mode & 0o777) == "0o600"
        assert key in log.read_text()  # printed for the developer
        assert httpx.get(api + "/v1/models", headers={"X-API-Key": key}).status_code == 200
        assert httpx.get(api + "/v1/models", headers={"X-API-Key": "nope"}).status_code == 401
        children = children_of(process.pid)
        assert len(children) == 3
        process.send_signal(stop_signal)
        assert process.wait(30) == 0
        assert not [pid for pid in children if alive(pid)]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_restarted_platform_still_serves_its_deployments(tmp_path):
    with kiln_serve(tmp_path, "restart-key") as platform:
        model = platform.upload(shared_model("mlp").read_bytes())
        job = platform.wait_job(platform.compile(model["id"], {"x": [2, 784]})["id"])
        platform.deploy(job["artifact"], "mlp")
    with kiln_serve(tmp_path, "restart-key") as platform:
        client = triton.InferenceServerClient(platform.runtime.removeprefix("http://"))
        assert client.is_model_ready("mlp")
        x = np.ones((2, 784), np.float32)
        request = triton.InferInput("x", [2, 784], "FP32")
        request.set_data_from_numpy(x)
        probs = client.infer("mlp", [request]).as_numpy("probs")
        np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-5)
        assert platform.client.get("/v1/deployments/mlp").status_code == 200
