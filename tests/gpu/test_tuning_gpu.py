"""Tuning a cuda target: its tasks come from the GPU templates, every candidate is split into
device kernels, checked against the target's limits and run on a device (here the OpenCL twin
on PoCL), a wrong one is caught, the twin's records are kept apart from a GPU's, and records
under the GPU's fingerprint are applied at build time."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import helper

from compiler_core.autotune.apply import tuned_schedules
from compiler_core.autotune.measure import (
    MeasureDeviceError,
    MeasureOptions,
    Measurer,
    measure_device,
)
from compiler_core.autotune.records import FileLog
from compiler_core.autotune.search import Tuner
from compiler_core.autotune.tasks import extract_tasks
from compiler_core.compiler import compile_graph
from compiler_core.frontend.onnx import import_model
from compiler_core.passes.pipeline import optimize
from compiler_core.reference.executor import run_graph
from compiler_core.runtime import load
from compiler_core.runtime.cuda import cuda_available
from compiler_core.runtime.opencl import opencl_available
from compiler_core.target import GPU_LIMITS, GpuLimits, parse_target
from tests.conftest import FLOAT, make_model, pairwise_cover

pytestmark = pytest.mark.skipif(
    not opencl_available()[0], reason=f"no OpenCL device: {opencl_available()[1]}"
)
SM90 = parse_target("cuda -arch=sm_90")
RNG = np.random.default_rng(0)
W1 = RNG.standard_normal((48, 64)).astype(np.float32)
W2 = RNG.standard_normal((64, 16)).astype(np.float32)
FAST = MeasureOptions(repeats=2, min_repeat_seconds=0.001, device="opencl")


def two_layer_model() -> onnx.ModelProto:
    """x @ W1 -> relu -> @ W2 -> softmax: two dense tasks and a row reduction."""
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("MatMul", ["r", "w2"], ["y"]),
        helper.make_node("Softmax", ["y"], ["z"], axis=-1),
    ]
    return make_model(nodes, [("x", FLOAT, [8, 48])], [("z", FLOAT, [8, 16])], {"w1": W1, "w2": W2})


@pytest.fixture(scope="module")
def graph():
    return optimize(import_model(two_layer_model()), target=SM90)


@pytest.fixture
def measurer():
    with Measurer(SM90, FAST) as m:
        yield m


def test_a_cuda_target_has_tasks_of_the_gpu_templates(graph):
    tasks = extract_tasks(graph, SM90)
    templates = sorted(t.template for t in tasks)
    assert templates.count("gpu_dense") == 2, [t.workload for t in tasks]
    assert all(t.template.startswith("gpu_") for t in tasks)
    cpu_keys = {t.key for t in extract_tasks(optimize(import_model(two_layer_model())))}
    assert not cpu_keys & {t.key for t in tasks}
    for task in tasks:
        assert len(task.space()) > 1 and task.flops > 0


def test_every_pair_of_knob_values_of_a_dense_task_computes_the_reference_on_the_twin(
    graph, measurer
):
    task = next(t for t in extract_tasks(graph, SM90) if t.template == "gpu_dense")
    configs = pairwise_cover(task.space())  # every pair of knob values
    results = measurer.measure(task, configs)
    errors = {r.error for r in results}
    # A config over the block's limits is refused before it runs; none computes a wrong answer.
    assert errors <= {"ok", "invalid_config"}, [
        (c, r) for c, r in zip(configs, results, strict=True) if r.error
    ]
    assert sum(r.error == "ok" for r in results) >= 2
    for result in results:
        if result.error == "ok":
            assert len(result.costs) == 2 and min(result.costs) > 0


def test_a_candidate_that_skips_a_launch_is_a_wrong_answer(graph, measurer):
    task = next(t for t in extract_tasks(graph, SM90) if t.template == "gpu_dense")
    reference = measurer._reference(task)
    (bundle_path,) = measurer.build(task, [task.space()[1]])
    bundle = json.loads(bundle_path.read_text())
    bundle["launches"] = bundle["launches"][:-1]  # the kernel that writes the output is gone
    bundle_path.write_text(json.dumps(bundle))
    result = measurer._run(task.lowered, bundle_path, reference=reference)
    assert result.error == "wrong_answer" and "differs from the reference" in result.detail


def test_a_config_over_the_shared_memory_limit_is_refused_with_the_numbers(
    graph, measurer, monkeypatch
):
    task = next(t for t in extract_tasks(graph, SM90) if t.template == "gpu_dense")
    # A part with 1 KiB of shared memory per block: the dense tiles staged through it do not
    # fit, and the measurer records why instead of running them.
    monkeypatch.setitem(GPU_LIMITS, "sm_90", GpuLimits(max_shared_bytes=1024))
    (result,) = measurer.measure(task, [task.tunable.default_config()])
    assert result.error == "invalid_config"
    assert "shared" in result.detail and "1024" in result.detail, result.detail


def test_twin_records_are_kept_apart_and_gpu_records_are_applied(graph, measurer, tmp_path):
    tasks = extract_tasks(graph, SM90)
    log = FileLog(tmp_path / "twin.jsonl")
    Tuner(tasks, SM90, log, measurer, batch=3).run(trials=9)
    records = log.records()
    assert len(records) == 9
    assert {r.fingerprint for r in records} == {measurer.fingerprint} != {SM90.fingerprint}
    assert all(r.target == "cuda -arch=sm_90 -device=opencl" for r in records)

    # The twin's timings are PoCL's: a GPU build does not take them.
    untuned = compile_graph(graph, SM90, verify=False, tuning=log)
    assert set(untuned.manifest["kernels"].values()) == {"default schedule"}

    # The same records as a GPU worker would have written them are applied, and the tuned
    # archive (every task at its best non-default point) still computes the model.
    best = {}
    for record in records:
        default = next(t for t in tasks if t.key == record.workload_key).tunable.default_config()
        if record.ok and record.config != default:
            best.setdefault(record.workload_key, record)
    assert best, "no non-default point measured"
    gpu_log = FileLog(tmp_path / "gpu.jsonl")
    gpu_log.extend(
        dataclasses.replace(r, fingerprint=SM90.fingerprint, target=str(SM90))
        for r in best.values()
    )
    schedules, notes, _ = tuned_schedules(graph, SM90, gpu_log)
    assert len(notes) == len(best)
    archive = compile_graph(graph, SM90, tuning=gpu_log)
    kernels = archive.manifest["kernels"]
    assert sum(isinstance(k, dict) and k["schedule"] == "tuned" for k in kernels.values()) == len(
        best
    )
    assert archive.manifest["verification"]["passed"], archive.manifest["verification"]
    x = RNG.standard_normal((8, 48)).astype(np.float32)
    got = load(archive.to_bytes(), device="opencl").run({"x": x})["z"]
    want = run_graph(graph, {"x": x})["z"]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_the_measuring_device_is_checked():
    with pytest.raises(MeasureDeviceError, match="host CPU"):
        measure_device(parse_target("llvm"), "cuda")
    with pytest.raises(MeasureDeviceError, match="expected one of"):
        measure_device(SM90, "rocm")
    assert measure_device(SM90, "opencl") == "opencl"
    assert measure_device(parse_target("llvm"), None) is None


@pytest.mark.skipif(cuda_available()[0], reason="a CUDA device is here")
def test_tuning_a_cuda_target_without_a_gpu_says_where_to_tune():
    with pytest.raises(MeasureDeviceError, match="no CUDA device.*OpenCL twin"):
        Measurer(SM90)


@pytest.mark.skipif(cuda_available()[0], reason="a CUDA device is here")
def test_kiln_tune_on_the_twin_and_without_a_gpu(tmp_path):
    model = tmp_path / "m.onnx"
    onnx.save(two_layer_model(), model)
    log = tmp_path / "log.jsonl"
    base = [sys.executable, "-m", "compiler_core.cli", "tune", str(model), "--target", str(SM90)]
    base += ["--trials", "4", "--log", str(log)]
    twin = subprocess.run([*base, "--device", "opencl"], capture_output=True, text=True)
    assert twin.returncode == 0, twin.stderr
    assert "measuring on opencl" in twin.stdout and "not applied to a GPU build" in twin.stdout
    records = FileLog(log).records()
    assert sum(not r.retimed for r in records) == 4  # the trials, then the best re-timed
    bare = subprocess.run(base, capture_output=True, text=True)
    assert bare.returncode == 2 and "no CUDA device" in bare.stderr
    assert len(FileLog(log).records()) == len(records)  # nothing lost, nothing added
