"""Fixtures: a tiny two-output model compiled once per session (two versions with different
weights), its numpy oracle, and a real uvicorn server on a free loopback port."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import uvicorn
from onnx import helper

import compiler_core
from runtime_server.app import create_app
from runtime_server.settings import RuntimeSettings
from tests.conftest import FLOAT, make_model

IN, OUT = 4, 3
REPO_ROOT = Path(__file__).resolve().parents[2]


def weights(version: str) -> tuple[np.ndarray, np.ndarray]:
    scale = {"1": 0.1, "2": -0.3}[version]
    w = (np.arange(IN * OUT, dtype=np.float32).reshape(IN, OUT) - 5) * np.float32(scale)
    b = np.array([0.5, -1.0, 0.25], np.float32) * np.float32(scale * 10)
    return w, b


def tiny_model(version: str):
    """y = relu(x @ W + b), z = 2 x: two outputs, with intermediates in the workspace."""
    w, b = weights(version)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("Add", ["h", "b"], ["a"]),
        helper.make_node("Relu", ["a"], ["y"]),
        helper.make_node("Mul", ["x", "two"], ["z"]),
    ]
    return make_model(
        nodes,
        [("x", FLOAT, [1, IN])],
        [("y", FLOAT, [1, OUT]), ("z", FLOAT, [1, IN])],
        {"W": w, "b": b, "two": np.array(2.0, np.float32)},
    )


def expected(x: np.ndarray, version: str = "1") -> dict[str, np.ndarray]:
    w, b = weights(version)
    return {"y": np.maximum(x @ w + b, 0), "z": 2 * x}


@pytest.fixture(scope="session")
def archives() -> dict[str, bytes]:
    """Module archive bytes by version."""
    return {v: compiler_core.compile(tiny_model(v), "llvm").to_bytes() for v in ("1", "2")}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class RunningServer:
    url: str
    address: str  # host:port, as tritonclient wants it
    app: object
    digests: dict[str, str]
    store: object


def make_settings(tmp_path) -> RuntimeSettings:
    return RuntimeSettings(
        data_dir=tmp_path, store_url=str(tmp_path / "store"), runtime_instances=2, num_threads=1
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory, archives):
    settings = make_settings(tmp_path_factory.mktemp("runtime"))
    store = settings.store()
    digests = {version: store.put_blob(data) for version, data in archives.items()}
    app = create_app(settings)
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not uv.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            pytest.fail("the runtime server did not start")
        time.sleep(0.02)
    yield RunningServer(f"http://127.0.0.1:{port}", f"127.0.0.1:{port}", app, digests, store)
    uv.should_exit = True
    thread.join(timeout=10)
