"""`kiln submit` as a user runs it: a subprocess against `kiln serve`, stdout captured (so the
plain-line progress), exit statuses 0 / 1 / 2 / 130."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import pytest

from api.client import Client
from tests.client.conftest import API_KEY, custom_op_model, matmul_model
from tests.e2e.platform import KILN


def submit(served, *args: str, key: str | None = API_KEY, **popen) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "KILN_API_KEY"}
    if key is not None:
        env["KILN_API_KEY"] = key
    return subprocess.Popen(
        [KILN, "submit", *args, "--server", served.api],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def run_submit(served, *args: str, key: str | None = API_KEY) -> tuple[int, str, str]:
    process = submit(served, *args, key=key)
    out, err = process.communicate(timeout=240)
    return process.returncode, out, err


def write(tmp_path, name: str, data: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def test_submit_tune_deploy_wait(served, tmp_path):
    model = write(tmp_path, "sub.onnx", matmul_model(11)[0])
    args = ("--shape", "x=2,64", "--trials", "6", "--deploy", "sub", "--wait")
    code, out, err = run_submit(served, model, *args)
    assert code == 0, out + err
    assert "stage tuning" in out and "tuning task 0" in out and "GFLOP/s" in out
    digest = next(line.split()[1] for line in out.splitlines() if line.startswith("artifact"))
    assert digest.startswith("sha256:") and len(digest) == 71
    assert "latency    " in out and " ms" in out
    infer_url = f"{served.runtime}/v2/models/sub/versions/1/infer"
    assert f"infer URL  {infer_url}" in out
    assert httpx.get(f"{served.runtime}/v2/models/sub/ready").status_code == 200


def test_submit_time_budget(served, tmp_path):
    model = write(tmp_path, "budget.onnx", matmul_model(12)[0])
    code, out, err = run_submit(served, model, "--shape", "x=1,64", "--tune", "1s", "--wait")
    assert code == 0, out + err
    with Client(served.api, API_KEY) as client:
        job = client.compilations()
    tuned = [j for j in job if (j.get("tuning") or {}).get("time_budget") == 1.0]
    assert tuned and tuned[0]["status"] == "done"
    assert "download   " in out  # not deployed: where to get the artifact instead


def test_submit_non_onnx_exits_2_with_the_problem(served, tmp_path):
    code, out, err = run_submit(served, write(tmp_path, "notes.onnx", b"not a model"), "--wait")
    assert code == 2, out + err
    assert "422 Invalid ONNX model" in err and "not an ONNX model" in err


def test_submit_usage_errors_exit_2(served, tmp_path):
    model = write(tmp_path, "u.onnx", matmul_model(13)[0])
    assert run_submit(served, str(tmp_path / "missing.onnx"))[0] == 2
    code, _, err = run_submit(served, model, "--tune", "ten minutes")
    assert code == 2 and "--tune" in err
    code, _, err = run_submit(served, model, key=None)
    assert code == 2 and "401" in err and "KILN_API_KEY" in err


def test_submit_failed_job_exits_1_naming_the_node(served, tmp_path):
    code, out, err = run_submit(served, write(tmp_path, "foo.onnx", custom_op_model()), "--wait")
    assert code == 1, out + err
    assert "failed" in err and "the_foo_node" in err and "custom.x" in err


def start_long_job(served, tmp_path, seed: int, *extra: str) -> tuple[subprocess.Popen, str]:
    """A `kiln submit` with a long tuning budget, once it reports the tuning stage: (process,
    compilation id)."""
    model = write(tmp_path, f"long{seed}.onnx", matmul_model(seed, 128, 128)[0])
    process = submit(served, model, "--shape", "x=8,128", "--tune", "2m", "--wait", *extra)
    job_id = None
    for line in process.stdout:
        if line.startswith("compiling"):
            job_id = line.rsplit("/", 1)[1].strip()
        if line.startswith("stage tuning"):
            return process, job_id
    pytest.fail(f"kiln submit ended early: {process.wait()} {process.stderr.read()}")


def test_ctrl_c_cancels_the_job(served, tmp_path):
    process, job_id = start_long_job(served, tmp_path, 14)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 130, out + err
    assert f"cancelled compilation {job_id}" in out  # stdin is no terminal: no question asked
    with Client(served.api, API_KEY) as client:
        assert client.compilation(job_id)["status"] == "cancelled"


def test_ctrl_c_with_detach_leaves_the_job_running(served, tmp_path):
    process, job_id = start_long_job(served, tmp_path, 15, "--detach")
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 130, out + err
    assert f"detached; the job goes on: {served.api}/v1/compilations/{job_id}" in out
    with Client(served.api, API_KEY) as client:
        time.sleep(1)
        assert client.compilation(job_id)["status"] == "running"
        client.cancel(job_id)  # not to tune for two minutes in the tests' background
