"""The benches' yardsticks: ONNX Runtime and OpenVINO run the same model, in float32, and
compare_and_time refuses to time a wrong answer."""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from bench.engines import (
    compare_and_time,
    openvino_runner,
    ort_runner,
    ratio_cells,
    ratio_columns,
    timed_in_blocks,
    yardsticks,
)
from tests.kernels.test_tfidf import tfidf_model

pytest.importorskip("openvino")


def dense_model(batch="n") -> bytes:
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((32, 8)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["y"])],
        "dense",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 8])],
        [numpy_helper.from_array(weights, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return model.SerializeToString()


def numpy_dense(feeds: dict) -> dict:
    """The dense model's answer, computed by numpy: the stand-in for a Kiln module's run."""
    weights = np.random.default_rng(0).standard_normal((32, 8)).astype(np.float32)
    return {"y": np.maximum(feeds["x"] @ weights, 0)}


def test_openvino_runs_float32_and_agrees_with_onnx_runtime_at_fixed_shapes():
    x = np.random.default_rng(1).standard_normal((4, 32)).astype(np.float32)
    shapes = {"x": [4, 32]}
    engines = yardsticks(dense_model(), threads=1, shapes=shapes)
    assert list(engines) == ["onnxruntime", "openvino"]
    expected = numpy_dense({"x": x})["y"]
    for run in engines.values():
        (name, value), *rest = run({"x": x}).items()
        assert (name, rest) == ("y", [])
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-5)


def test_compare_and_time_times_every_engine_and_rates_against_the_faster():
    x = np.random.default_rng(2).standard_normal((4, 32)).astype(np.float32)
    references = yardsticks(dense_model(4), threads=1)
    result = compare_and_time(numpy_dense, references, {"x": x}, blocks=2)
    assert "failed" not in result
    assert set(result["max_error"]) == {"onnxruntime", "openvino"}
    assert max(result["max_error"].values()) < 1e-5
    for name in ("kiln", "onnxruntime", "openvino"):
        assert result[name]["median_ms"] > 0
    fastest = min(result[name]["median_ms"] for name in references)
    assert result["ratio"]["best"] == pytest.approx(result["kiln"]["median_ms"] / fastest)
    assert result["ratio_median"] == result["ratio"]["onnxruntime"]
    header, cells = ratio_columns(list(references)), ratio_cells(result, list(references))
    assert header.split() == ["ORT", "ms", "OV", "ms", "/ORT", "/OV", "/best"]
    assert len(cells.split()) == 5


def test_a_wrong_answer_is_a_failed_result_and_is_not_timed():
    x = np.random.default_rng(3).standard_normal((4, 32)).astype(np.float32)
    references = {"onnxruntime": ort_runner(dense_model(4), threads=1)}

    def off_by_a_little(feeds):
        return {"y": numpy_dense(feeds)["y"] * 1.001}

    result = compare_and_time(off_by_a_little, references, {"x": x}, blocks=1)
    assert result["failed"].startswith("output differs from ORT")
    assert "kiln" not in result and "ratio" not in result


def test_openvino_is_refused_where_it_would_not_run_float32(monkeypatch):
    import openvino

    class Bf16Compiled:
        def __init__(self, compiled):
            self.compiled = compiled

        def get_property(self, name):
            return (
                "bf16" if name == "INFERENCE_PRECISION_HINT" else self.compiled.get_property(name)
            )

    real = openvino.Core.compile_model

    def compile_model(core, *args, **kwargs):
        return Bf16Compiled(real(core, *args, **kwargs))

    monkeypatch.setattr(openvino.Core, "compile_model", compile_model)
    with pytest.raises(RuntimeError, match="not float32"):
        openvino_runner(dense_model(4), threads=1)


def test_blocks_alternate_and_drop_each_blocks_first_run():
    calls = []
    times = timed_in_blocks(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, blocks=2, block=3
    )
    assert calls == ["a"] * 3 + ["b"] * 3 + ["a"] * 3 + ["b"] * 3
    assert {name: len(seconds) for name, seconds in times.items()} == {"a": 4, "b": 4}


def test_a_model_openvino_cannot_read_is_timed_against_onnx_runtime_alone(capsys):
    """TfIdfVectorizer has no OpenVINO front-end conversion: the row keeps ORT's time and
    ratios and shows dashes for OpenVINO's."""
    model = tfidf_model(
        (4,),
        mode="TF",
        min_gram_length=1,
        max_gram_length=1,
        max_skip_count=0,
        ngram_counts=[0],
        ngram_indexes=[0, 1],
        pool_int64s=[2, 3],
    )
    references = yardsticks(model.SerializeToString(), threads=1)
    assert list(references) == ["onnxruntime"]
    assert "OpenVINO skipped" in capsys.readouterr().err

    def counts(feeds):
        return {"y": np.array([1.0, 2.0], np.float32)}

    result = compare_and_time(counts, references, {"x": np.array([2, 3, 3, 5])}, blocks=1)
    assert "failed" not in result and "openvino" not in result
    cells = ratio_cells(result, ["onnxruntime", "openvino"]).split()
    assert cells[1] == "-" and cells[3] == "-" and cells[4] == cells[2]
