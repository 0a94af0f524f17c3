"""Run the platform's processes for end-to-end tests: `kiln serve`, or the api and workers as
separate processes (for the crash test), on free loopback ports, and drive them over HTTP."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

KILN = str(Path(sys.executable).parent / "kiln")
REDIS_URL = "redis://127.0.0.1:6379"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_url(db: int) -> str:
    """A Redis database of the test's own, emptied first (the tests' DB numbers differ)."""
    import redis

    url = f"{REDIS_URL}/{db}"
    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    except redis.ConnectionError as err:
        pytest.fail(f"Redis must answer on {REDIS_URL} (`.ci/run` starts one): {err}")
    return url


def wait_until(predicate, seconds: float, what: str, log: Path | None = None):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            value = predicate()
            if value:
                return value
        time.sleep(0.3)
    tail = log.read_text()[-3000:] if log and log.exists() else ""
    raise AssertionError(f"{what} within {seconds} s\n{tail}")


def stop_group(process: subprocess.Popen, sig=signal.SIGTERM, wait: float = 30) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)
    try:
        process.wait(wait)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


class Platform:
    """The HTTP flow of the platform: upload -> compile -> deploy."""

    def __init__(self, api: str, runtime: str, key: str, log: Path):
        self.api, self.runtime, self.log = api, runtime, log
        self.client = httpx.Client(base_url=api, headers={"X-API-Key": key}, timeout=120)

    def upload(self, data: bytes) -> dict:
        response = self.client.post(
            "/v1/models", content=data, headers={"Content-Type": "application/octet-stream"}
        )
        assert response.status_code == 201, response.text
        return response.json()

    def compile(self, model_id: str, shapes=None) -> dict:
        body = {"model": model_id, "target": "llvm", "shapes": shapes}
        response = self.client.post("/v1/compilations", json=body)
        assert response.status_code == 202, response.text
        return response.json()

    def job(self, job_id: str) -> dict:
        return self.client.get(f"/v1/compilations/{job_id}").json()

    def wait_job(self, job_id: str, seconds: float = 300, until=("done", "failed")) -> dict:
        def ended():
            job = self.job(job_id)
            return job if job["status"] in until else None

        return wait_until(ended, seconds, f"job {job_id} did not end", self.log)

    def deploy(self, artifact: str, name: str, version: str = "1") -> dict:
        body = {"artifact": artifact, "name": name, "version": version}
        response = self.client.post("/v1/deployments", json=body)
        assert response.status_code == 201, response.text
        return response.json()


S3_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}


@contextlib.contextmanager
def moto_s3(bucket: str = "kiln-e2e"):
    """A real S3 endpoint (moto's server mode) on loopback, with one bucket: yields the
    environment that points the platform's store at it."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    try:
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )
        client.create_bucket(Bucket=bucket)
        yield {
            **S3_CREDENTIALS,
            "KILN_STORE_URL": f"s3://{bucket}/platform",
            "KILN_S3_ENDPOINT_URL": endpoint,
        }
    finally:
        server.stop()


@contextlib.contextmanager
def kiln_serve(data_dir: Path, key: str, redis: str | None = None, extra_env: dict | None = None):
    api_port, runtime_port = free_port(), free_port()
    env = dict(os.environ, KILN_API_KEYS=f"tests:{key}", KILN_NUM_THREADS="1")
    env.pop("KILN_REDIS_URL", None)
    env.pop("KILN_STORE_URL", None)
    if redis:
        env["KILN_REDIS_URL"] = redis
    env.update(extra_env or {})
    log = data_dir / "serve.log"
    data_dir.mkdir(parents=True, exist_ok=True)
    command = [KILN, "serve", "--api-port", str(api_port), "--runtime-port", str(runtime_port)]
    process = subprocess.Popen(
        [*command, "--data-dir", str(data_dir)],
        env=env,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    platform = Platform(
        f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{runtime_port}", key, log
    )
    try:
        wait_until(lambda: httpx.get(platform.api + "/health/ready").is_success, 60, "api up", log)
        wait_until(
            lambda: httpx.get(platform.runtime + "/v2/health/ready").is_success, 60, "runtime", log
        )
        yield platform
    finally:
        stop_group(process)
        assert process.returncode is not None
