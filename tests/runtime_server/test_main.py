"""`python -m runtime_server` as an operator runs it: a separate process, preloading a model."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from artifact_store import FileStore
from runtime_server.__main__ import parse_preload
from tests.runtime_server.conftest import IN, REPO_ROOT, expected, free_port


def test_parse_preload():
    digest = "sha256:" + "a" * 64
    assert parse_preload(f"m={digest}") == ("m", digest, None)
    assert parse_preload(f"m:2={digest}") == ("m", digest, "2")
    with pytest.raises(argparse.ArgumentTypeError):
        parse_preload("m")


def wait_ready(url: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the server exited: {process.communicate()[1]}")
        try:
            if httpx.get(f"{url}/v2/models/tiny/ready", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    pytest.fail("the server did not become ready")


def test_serves_a_preloaded_model(tmp_path, archives):
    digest = FileStore(tmp_path / "store").put_blob(archives["1"])
    port = free_port()
    env = {**os.environ, "KILN_STORE_URL": f"file://{tmp_path / 'store'}", "KILN_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "runtime_server", "--port", str(port), "--load"]
    process = subprocess.Popen(
        [*command, f"tiny={digest}"],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, process)
        x = np.ones((1, IN), np.float32)
        body = {"inputs": [{"name": "x", "shape": [1, IN], "datatype": "FP32", "data": x.tolist()}]}
        response = httpx.post(f"{url}/v2/models/tiny/infer", json=body, timeout=10)
        assert response.status_code == 200, response.text
        y = response.json()["outputs"][0]["data"]
        np.testing.assert_allclose(np.reshape(y, (1, -1)), expected(x)["y"], atol=1e-6)
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_a_bad_preload_exits_with_a_message(tmp_path):
    env = {**os.environ, "KILN_STORE_URL": str(tmp_path / "store")}
    missing = "sha256:" + "0" * 64
    result = subprocess.run(
        [sys.executable, "-m", "runtime_server", "--load", f"tiny={missing}"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "cannot load 'tiny'" in result.stderr and "not in the artifact store" in result.stderr


def test_the_server_imports_no_compiler_beyond_the_runtime():
    probe = (
        "import sys, runtime_server.app, runtime_server.__main__\n"
        "ours = ('compiler_core', 'compiler_core.runtime')\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('llvmlite', 'lightgbm', 'onnx')\n"
        "         or (m.startswith('compiler_core') and not m.startswith(ours))]\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
