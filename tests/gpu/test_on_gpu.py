"""On a machine with an NVIDIA GPU (marker `gpu`, skipped elsewhere): the four shared models'
CUDA archives run through pycuda and match ONNX Runtime."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper

import compiler_core
from compiler_core.runtime import load
from compiler_core.runtime.cuda import CudaBackend, NoCudaDeviceError
from tests.conftest import (
    SHARED_MODELS,
    assert_close_to_scale,
    make_model,
    random_feeds,
    shared_model,
)


def _arch() -> str | None:
    try:
        return CudaBackend().arch
    except NoCudaDeviceError:
        return None


ARCH = _arch()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(ARCH is None, reason="no CUDA device (pycuda and an NVIDIA GPU needed)"),
]


@pytest.mark.parametrize("name", SHARED_MODELS)
def test_shared_model_on_the_gpu_matches_onnxruntime(name):
    shapes = {"x": [1, 784]} if name == "mlp" else None
    path = shared_model(name)
    module = load(compiler_core.compile(str(path), target=f"cuda -arch={ARCH}", shapes=shapes))
    feeds = random_feeds(module.inputs)
    ours = module.run(feeds)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    for key, value in zip(names, session.run(None, feeds), strict=True):
        assert_close_to_scale(ours[key], value, 1e-4, f"{name}:{key}")
    assert module.profile(feeds, repeats=3)  # CUDA events time every launch


def test_tuning_on_the_gpu_measures_with_cuda_events_and_the_build_applies_it(tmp_path):
    from compiler_core.autotune.measure import MeasureOptions, Measurer
    from compiler_core.autotune.records import FileLog
    from compiler_core.autotune.search import Tuner
    from compiler_core.autotune.tasks import extract_tasks
    from compiler_core.frontend.onnx import import_model
    from compiler_core.passes.pipeline import optimize
    from compiler_core.target import parse_target

    target = parse_target(f"cuda -arch={ARCH}")
    path = shared_model("mlp")
    graph = optimize(import_model(str(path), shapes={"x": [1, 784]}), target=target)
    log = FileLog(tmp_path / "gpu.jsonl")
    options = MeasureOptions(repeats=3, min_repeat_seconds=0.005)
    with Measurer(target, options) as measurer:
        assert measurer.device == "cuda" and measurer.fingerprint == target.fingerprint
        Tuner(extract_tasks(graph, target), target, log, measurer, batch=4).run(trials=12)
    records = log.records()
    assert len(records) == 12 and all(r.error in ("ok", "invalid_config") for r in records)
    module = load(compiler_core.compile(str(path), target=str(target), tuning=str(log.path)))
    assert any(isinstance(k, dict) for k in module.manifest["kernels"].values())
    feeds = random_feeds(module.inputs)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    expected = session.run(None, feeds)[0]
    assert_close_to_scale(module.run(feeds)[session.get_outputs()[0].name], expected, 1e-4, "mlp")


def _relu_archive():
    model = make_model(
        [helper.make_node("Relu", ["x"], ["y"])], [("x", 1, [3, 5])], [("y", 1, [3, 5])]
    )
    return compiler_core.compile(model, target=f"cuda -arch={ARCH}")


def test_a_module_loaded_on_one_thread_runs_on_another():
    # A server loads a module once and runs requests on its worker threads: CUDA's context
    # is per thread, so the backend makes it current around each use.
    module = load(_relu_archive())
    x = np.linspace(-1, 1, 15, dtype=np.float32).reshape(3, 5)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: module.run({"x": x})["y"], range(4)))
    for y in results:
        np.testing.assert_array_equal(y, np.maximum(x, 0))


def test_a_process_that_ran_a_cuda_module_exits_cleanly(tmp_path):
    # pycuda aborts a process that exits with a context still on its stack.
    path = tmp_path / "relu.kiln"
    path.write_bytes(_relu_archive().to_bytes())
    code = (
        "import numpy as np; from compiler_core.runtime import load;"
        f"m = load({str(path)!r}); print(m.run({{'x': np.ones((3, 5), np.float32)}})['y'].sum())"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "15.0" and "PyCUDA ERROR" not in done.stderr
