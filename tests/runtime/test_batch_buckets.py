"""Batch buckets: one archive, a plan per batch size; any batch up to the largest runs the
smallest bucket that holds it and matches ONNX Runtime; bad batches and models get clear
errors."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

import compiler_core
from compiler_core.batching import BatchBucketError, with_symbolic_batch
from compiler_core.runtime import InputError, load
from tests.conftest import FLOAT, assert_close_to_scale, make_model, shared_model
from tests.zoo.graphs import resnext_block


def ort_session(model: onnx.ModelProto) -> ort.InferenceSession:
    data = with_symbolic_batch(model).SerializeToString()
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def mlp_buckets():
    return compiler_core.compile(
        str(shared_model("mlp")), shapes={"x": [1, 784]}, batch_buckets=[1, 2, 4, 8, 16]
    )


@pytest.mark.parametrize("batch", [1, 3, 7, 16])
def test_mlp_runs_any_batch_up_to_the_largest_bucket(mlp_buckets, batch):
    module = load(mlp_buckets, num_threads=2)
    x = np.random.default_rng(batch).standard_normal((batch, 784)).astype(np.float32)
    (actual,) = module.run({"x": x}).values()
    (expected,) = ort_session(onnx.load(str(shared_model("mlp")))).run(None, {"x": x})
    assert actual.shape == expected.shape == (batch, 10)
    assert_close_to_scale(actual, expected, label=f"batch {batch}")


def test_bucketed_archive_verifies_every_bucket_and_stores_weights_once(mlp_buckets):
    manifest = mlp_buckets.manifest
    assert manifest["batch_buckets"] == [1, 2, 4, 8, 16]
    assert manifest["verification"]["passed"]
    assert manifest["verification"]["batches"] == [1, 2, 4, 8, 16]
    single = compiler_core.compile(str(shared_model("mlp")), shapes={"x": [16, 784]})
    assert len(mlp_buckets.members["weights.bin"]) == len(single.members["weights.bin"])


def test_a_static_batch_conv_model_gets_buckets():
    model = resnext_block()  # declared with a static batch of 1
    archive = compiler_core.compile(model, batch_buckets=[1, 2, 4])
    module = load(archive, num_threads=2)
    session = ort_session(model)
    for batch in (1, 3, 4):
        x = np.random.default_rng(batch).standard_normal((batch, 16, 14, 14)).astype(np.float32)
        (actual,) = module.run({"x": x}).values()
        (expected,) = session.run(None, {"x": x})
        assert_close_to_scale(actual, expected, label=f"batch {batch}")


def test_batches_outside_the_buckets_are_input_errors(mlp_buckets):
    module = load(mlp_buckets, num_threads=1)
    with pytest.raises(InputError, match=r"batch 17 is outside .*\(the largest is 16\)"):
        module.run({"x": np.zeros((17, 784), np.float32)})
    with pytest.raises(InputError, match=r"expects float32\['N', 784\]"):
        module.run({"x": np.zeros((2, 783), np.float32)})
    with pytest.raises(InputError, match="batch N of 1 to 16"):
        module.run({"x": np.zeros((2, 784), np.float64)})
    with pytest.raises(InputError, match="batch 0 is outside"):
        module.run({"x": np.zeros((0, 784), np.float32)})


def test_inputs_must_agree_on_the_batch():
    model = make_model(
        [helper.make_node("Add", ["a", "b"], ["y"])],
        [("a", FLOAT, [1, 4]), ("b", FLOAT, [1, 4])],
        [("y", FLOAT, [1, 4])],
    )
    module = load(compiler_core.compile(model, batch_buckets=[1, 4]), num_threads=1)
    with pytest.raises(InputError, match=r"disagree on the batch .*\[2, 3\]"):
        module.run({"a": np.zeros((2, 4), np.float32), "b": np.zeros((3, 4), np.float32)})
    (y,) = module.run({"a": np.ones((3, 4), np.float32), "b": np.ones((3, 4), np.float32)}).values()
    np.testing.assert_array_equal(y, np.full((3, 4), 2.0, np.float32))


@pytest.mark.parametrize("buckets", [[], [0, 2], [1.5], ["4"], [True]])
def test_malformed_buckets_are_refused(buckets):
    with pytest.raises(BatchBucketError):
        compiler_core.compile(
            str(shared_model("mlp")), shapes={"x": [1, 784]}, batch_buckets=buckets
        )


def test_a_model_whose_output_does_not_follow_the_batch_is_refused():
    summed = make_model(
        [helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=1)],
        [("x", FLOAT, [1, 4])],
        [("y", FLOAT, [1, 4])],
        {"axes": np.array([0], np.int64)},
    )
    with pytest.raises(BatchBucketError, match=r"output 'y' has shape \[1, 4\] at batch 2"):
        compiler_core.compile(summed, batch_buckets=[1, 2])
    scalar = make_model(
        [helper.make_node("ReduceSum", ["x"], ["y"], keepdims=0)],
        [("x", FLOAT, [1, 4])],
        [("y", FLOAT, [])],
    )
    with pytest.raises(BatchBucketError, match="'y' is a scalar"):
        compiler_core.compile(scalar, batch_buckets=[1, 2])


def test_kiln_compile_takes_batch_buckets(tmp_path):
    output = tmp_path / "mlp.kiln"
    command = [sys.executable, "-m", "compiler_core.cli", "compile", str(shared_model("mlp"))]
    result = subprocess.run(
        [*command, "--shape", "x=N,784", "--batch-buckets", "1,4", "-o", str(output)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "batch buckets: [1, 4]" in result.stdout
    with zipfile.ZipFile(output) as archive:
        assert "plan.json" in archive.namelist()
    refused = subprocess.run(
        [*command, "--shape", "x=N,784", "-o", str(output)], capture_output=True, text=True
    )
    assert refused.returncode == 2 and "--batch-buckets" in refused.stderr
