"""The kiln command line, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys

import onnx
import pytest

from compiler_core import cli
from compiler_core.schedule.primitives import ScheduleError
from tests.conftest import shared_model


def kiln(*args):
    return subprocess.run(
        [sys.executable, "-m", "compiler_core.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_inspect_prints_before_after_and_groups():
    result = kiln("inspect", str(shared_model("resnet18")))
    assert result.returncode == 0, result.stderr
    assert "== imported:" in result.stdout
    assert "== after the pipeline" in result.stdout
    assert "Conv -> Add -> Relu" in result.stdout
    assert "BatchNormalization" not in result.stdout.split("== after")[1]


def test_inspect_can_stop_after_a_named_pass():
    result = kiln("inspect", str(shared_model("encoder4")), "--after", "fold_constants")
    assert result.returncode == 0, result.stderr
    after = result.stdout.split("== after fold_constants")[1]
    assert "= Shape(" not in after


def test_verify_reports_agreement_with_onnxruntime():
    result = kiln("verify", str(shared_model("mlp")), "--shape", "x=2,784")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "vs onnxruntime" in result.stdout and "ok" in result.stdout


def test_missing_shape_binding_is_a_usage_error(tmp_path):
    model = onnx.load(str(shared_model("mlp")))
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "features"
    path = tmp_path / "features.onnx"
    onnx.save(model, str(path))
    result = kiln("verify", str(path))
    assert result.returncode == 2
    assert "'features'" in result.stderr


def test_an_unbound_batch_is_compiled_as_one_with_a_note(tmp_path):
    out = tmp_path / "mlp.kiln"
    result = kiln("compile", str(shared_model("mlp")), "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert "symbolic batch compiled as [1, 784]" in result.stdout
    assert "'batch'" in result.stderr  # the warning names the dimension


def test_bad_shape_syntax_is_a_usage_error():
    result = kiln("inspect", str(shared_model("mlp")), "--shape", "x:1x784")
    assert result.returncode == 2
    assert "NAME=D0,D1" in result.stderr


def test_garbage_file_is_a_clear_error(tmp_path):
    path = tmp_path / "junk.onnx"
    path.write_bytes(b"\x08\x07garbage" * 10)
    result = kiln("inspect", str(path))
    assert result.returncode == 2
    assert "error" in result.stderr and "Traceback" not in result.stderr


def test_compile_then_run(tmp_path):
    archive = tmp_path / "mlp.kiln"
    result = kiln("compile", str(shared_model("mlp")), "--shape", "x=1,784", "-o", str(archive))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "verification vs reference executor" in result.stdout and "-> ok" in result.stdout
    import numpy as np

    x = tmp_path / "x.npy"
    np.save(x, np.zeros((1, 784), np.float32))
    result = kiln("run", str(archive), "--input", f"x={x}", "--repeat", "3")
    assert result.returncode == 0, result.stderr
    assert "probs: float32[1, 10]" in result.stdout
    assert "latency over 3 runs" in result.stdout
    assert (
        "memory: workspace " in result.stdout
        and "kept by the process's block cache" in result.stdout
    )
    result = kiln("run", str(archive), "--repeat", "2", "--profile", "3")
    assert result.returncode == 0, result.stderr
    assert "per-kernel medians" in result.stdout and "the 3 slowest" in result.stdout
    assert result.stdout.count(" alone ") == 3  # each listed kernel's time alone beside it


def test_run_refuses_a_wrong_input_shape(tmp_path):
    archive = tmp_path / "mlp.kiln"
    assert (
        kiln(
            "compile", str(shared_model("mlp")), "--shape", "x=1,784", "-o", str(archive)
        ).returncode
        == 0
    )
    import numpy as np

    x = tmp_path / "x.npy"
    np.save(x, np.zeros((2, 784), np.float32))
    result = kiln("run", str(archive), "--input", f"x={x}")
    assert result.returncode == 2
    assert "expects float32[1, 784]" in result.stderr


def test_bad_target_is_a_usage_error(tmp_path):
    output = str(tmp_path / "mlp.kiln")
    result = kiln(
        "compile", str(shared_model("mlp")), "--shape", "x=1,784", "--target", "gpu", "-o", output
    )
    assert result.returncode == 2
    assert "unsupported target 'gpu'" in result.stderr and "Traceback" not in result.stderr


def test_a_compiler_bug_is_not_reported_as_a_usage_error(monkeypatch):
    """Compiler errors subclass ValueError but are not the user's: they must keep their
    traceback instead of printing as a usage error with exit code 2."""

    def broken(*args, **kwargs):
        raise ScheduleError("Split('conv_i3', 0): the factor must be positive")

    monkeypatch.setattr(cli, "optimize", broken)
    with pytest.raises(ScheduleError, match="factor must be positive"):
        cli.main(["inspect", str(shared_model("mlp")), "--shape", "x=1,784"])
