"""bench.ab: builds of one model timed side by side as the acceptance checks time them, each
checked against the first build's answer before it is timed."""

from __future__ import annotations

import json

import numpy as np
from onnx import TensorProto, helper, numpy_helper

import compiler_core
from bench import ab
from bench.engines import timed_by_position


def dense_model(seed: int = 0) -> bytes:
    weights = np.random.default_rng(seed).standard_normal((32, 8)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["y"])],
        "dense",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
        [numpy_helper.from_array(weights, "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def test_blocks_keep_every_run_by_position_and_reverse_the_order_every_other_block():
    starts = []

    def engine(name):
        def run():
            starts.append(name)

        return run

    times = timed_by_position({"a": engine("a"), "b": engine("b")}, blocks=3, block=2, pause=0)
    assert {name: t.shape for name, t in times.items()} == {"a": (3, 2), "b": (3, 2)}
    assert starts[::2] == ["a", "b", "b", "a", "a", "b"]  # the first run of each block


def test_builds_are_checked_then_timed_and_reported(tmp_path):
    model = tmp_path / "dense.onnx"
    model.write_bytes(dense_model())
    archive = tmp_path / "dense.kiln"
    compiler_core.compile(str(model)).save(archive)
    report = tmp_path / "ab.json"
    argv = [str(model), "--build", "untuned", "--build", f"archive={archive}", "--ort"]
    argv += ["--blocks", "2", "--block", "3", "--pause", "0", "--back-to-back", "3"]
    assert ab.main([*argv, "--json", str(report)]) == 0
    result = json.loads(report.read_text())
    assert set(result) == {"model", "builds", "untuned", "archive", "onnxruntime"}
    assert result["untuned"]["ratio_to_first"] == 1.0
    assert len(result["archive"]["by_position_ms"]) == 3


def test_a_build_with_another_answer_or_a_missing_log_is_refused_by_name(tmp_path, capsys):
    model = tmp_path / "dense.onnx"
    model.write_bytes(dense_model())
    other = tmp_path / "other.kiln"
    other_model = tmp_path / "other.onnx"
    other_model.write_bytes(dense_model(seed=1))  # the same signature, other weights
    compiler_core.compile(str(other_model)).save(other)
    quick = ["--blocks", "1", "--block", "2", "--pause", "0"]
    assert ab.main([str(model), "--build", "untuned", "--build", f"x={other}", *quick]) == 2
    assert "'x' differs from 'untuned'" in capsys.readouterr().err
    missing = tmp_path / "missing.jsonl"
    assert ab.main([str(model), "--build", f"log={missing}", *quick]) == 2
    assert f"no file {str(missing)!r}" in capsys.readouterr().err
