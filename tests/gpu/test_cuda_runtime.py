"""Loading a CUDA archive: lazy pycuda, a clear error where no GPU is, the CLI around it."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import zipfile

import numpy as np
import pytest
from onnx import helper

import compiler_core
from compiler_core.cli import main
from compiler_core.runtime import ArchiveError, load
from compiler_core.runtime.cuda import NoCudaDeviceError
from compiler_core.runtime.opencl import opencl_available
from tests.conftest import make_model

TINY = make_model(
    [helper.make_node("Relu", ["x"], ["y"])],
    [("x", 1, [3, 5])],
    [("y", 1, [3, 5])],
)


def has_gpu() -> bool:
    try:
        from compiler_core.runtime.cuda import CudaBackend

        CudaBackend()
    except NoCudaDeviceError:
        return False
    return True


def test_importing_the_runtime_does_not_import_pycuda_or_start_cuda():
    code = (
        "import sys, compiler_core, compiler_core.runtime, compiler_core.compiler;"
        "import compiler_core.runtime.cuda;"
        "assert 'pycuda' not in sys.modules and 'pycuda.driver' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(has_gpu(), reason="this machine has a GPU")
def test_loading_a_cuda_archive_without_a_gpu_is_a_clear_error():
    archive = compiler_core.compile(TINY, target="cuda -arch=sm_90")
    with pytest.raises(NoCudaDeviceError, match="no CUDA device"):
        load(archive)


@pytest.mark.skipif(has_gpu(), reason="this machine has a GPU")
def test_kiln_compile_for_cuda_then_run(tmp_path, capsys):
    model = tmp_path / "tiny.onnx"
    model.write_bytes(TINY.SerializeToString())
    out = tmp_path / "tiny.kiln"
    assert main(["compile", str(model), "--target", "cuda -arch=sm_90", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "for cuda -arch=sm_90" in printed
    assert main(["run", str(out)]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    if opencl_available()[0]:
        assert main(["run", str(out), "--device", "opencl"]) == 0
        assert "y: float32[3, 5]" in capsys.readouterr().out


def test_unknown_architecture_and_bad_options_are_refused(capsys):
    with pytest.raises(compiler_core.target.TargetError, match="unsupported CUDA architecture"):
        compiler_core.compile(TINY, target="cuda -arch=sm_99")
    with pytest.raises(compiler_core.target.TargetError, match="unknown target option"):
        compiler_core.compile(TINY, target="cuda -mcpu=sm_90")
    with pytest.raises(compiler_core.target.TargetError, match="batch buckets"):
        compiler_core.compile(TINY, target="cuda", batch_buckets=[1, 2])


def test_a_tampered_cuda_archive_is_refused():
    data = compiler_core.compile(TINY, target="cuda -arch=sm_90").to_bytes()
    source = zipfile.ZipFile(io.BytesIO(data))
    rebuilt = io.BytesIO()
    with zipfile.ZipFile(rebuilt, "w") as out:
        for name in source.namelist():
            payload = source.read(name)
            if name == "model.ptx":
                payload = payload.replace(b".entry", b".entry ", 1)
            out.writestr(name, payload)
    with pytest.raises(ArchiveError, match="model.ptx"):
        load(rebuilt.getvalue(), device="opencl")


@pytest.mark.skipif(not opencl_available()[0], reason="no OpenCL device")
def test_opencl_twin_runs_and_rejects_bad_inputs():
    module = load(compiler_core.compile(TINY, target="cuda -arch=sm_90"), device="opencl")
    x = np.linspace(-1, 1, 15, dtype=np.float32).reshape(3, 5)
    np.testing.assert_array_equal(module.run({"x": x})["y"], np.maximum(x, 0))
    with pytest.raises(compiler_core.runtime.InputError, match="expects float32"):
        module.run({"x": x.astype(np.float64)})
    with pytest.raises(compiler_core.runtime.InputError, match="missing"):
        module.run({})


def _convs_then_dense():
    """Two convs (one with 144 KB of weights) and a batch-1 MatMul (256 KB)."""
    rng = np.random.default_rng(0)
    weights = {
        "big": rng.standard_normal((64, 64, 3, 3)).astype(np.float32),
        "small": rng.standard_normal((8, 64, 1, 1)).astype(np.float32),
        "dense": rng.standard_normal((512, 128)).astype(np.float32),
    }
    return make_model(
        [
            helper.make_node("Conv", ["x", "big"], ["h"], pads=[1, 1, 1, 1]),
            helper.make_node("Conv", ["h", "small"], ["c"]),
            helper.make_node("Flatten", ["c"], ["f"]),
            helper.make_node("MatMul", ["f", "dense"], ["y"]),
        ],
        [("x", 1, [1, 64, 8, 8])],
        [("y", 1, [1, 128])],
        weights,
    )


@pytest.mark.skipif(not opencl_available()[0], reason="no OpenCL device")
def test_the_profile_times_every_launch_inside_a_run_of_the_plan():
    archive = compiler_core.compile(_convs_then_dense(), target="cuda -arch=sm_90")
    plan = json.loads(archive.members["plan.json"])
    module = load(archive, device="opencl")
    x = np.random.default_rng(1).standard_normal((1, 64, 8, 8)).astype(np.float32)
    before = module.run({"x": x})["y"]
    rows = module.profile({"x": x}, repeats=3)
    assert [name for name, _ in rows] == [launch["kernel"] for launch in plan["launches"]]
    assert all(seconds > 0 for _, seconds in rows)
    np.testing.assert_array_equal(module.run({"x": x})["y"], before)


def test_the_plan_prefetches_the_large_weights_a_direct_conv_reads():
    # A direct conv's threads read its weights themselves: its weights of 64 KB or more are
    # streamed into L2 just before it; small ones are not, nor those of a kernel that stages
    # them through shared memory or folds them across a block (the batch-1 MatMul here).
    from compiler_core.gpu.archive import PREFETCH_MIN_BYTES

    model = _convs_then_dense()
    archive = compiler_core.compile(model, target="cuda -arch=sm_90")
    plan = json.loads(archive.members["plan.json"])
    sizes = {v["name"]: v["nbytes"] for v in plan["values"]}
    prefetching = [launch for launch in plan["launches"] if launch["prefetch"]]
    assert len(prefetching) == 1 and "Conv" in prefetching[0]["kernel"]
    (weight,) = prefetching[0]["prefetch"]
    assert weight in prefetching[0]["args"] and sizes[weight] >= PREFETCH_MIN_BYTES
    assert plan["prefetch_kernel"].encode() in archive.members["model.ptx"]
