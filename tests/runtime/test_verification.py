"""The compile's verification: an output agrees with the reference executor when its error is
small against the output's scale, with NaN and infinities where the reference has them."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import compiler_core
from compiler_core.compiler import VERIFY_RTOL, compile_graph, output_error
from compiler_core.frontend.onnx import import_model
from compiler_core.target import host_target

RNG = np.random.default_rng(0)


def test_float32_rounding_of_a_long_reduction_agrees():
    """A float32 product summed over 1024 terms one after the other (as a kernel's
    accumulator does), against the float64 sum: outputs near zero are off by far more than
    1e-4 of themselves, and still agree (the whole output's scale). The sum is a cumsum, not
    `a @ b`: how a BLAS rounds depends on the CPU it picks kernels for."""
    a = RNG.standard_normal((64, 1024)).astype(np.float32)
    b = RNG.standard_normal((1024, 64)).astype(np.float32)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    rounded = np.cumsum(a[:, :, None] * b[None, :, :], axis=1, dtype=np.float32)[:, -1, :]
    assert not np.allclose(rounded, exact, rtol=VERIFY_RTOL, atol=1e-5)  # per element: fails
    error, agrees = output_error(rounded, exact)
    assert agrees and 0 < error < VERIFY_RTOL * np.abs(exact).max()


def test_a_wrong_element_nan_or_shape_disagrees():
    expected = RNG.standard_normal((8, 8))
    wrong = expected.copy()
    wrong[3, 4] += 0.01 * np.abs(expected).max()
    assert not output_error(wrong, expected)[1]
    with_nan = expected.copy()
    with_nan[0, 0] = np.nan
    error, agrees = output_error(with_nan, expected)
    assert not agrees and error == math.inf
    assert output_error(expected[:4], expected) == (math.inf, False)


def test_nan_and_infinities_agree_only_where_the_reference_has_them():
    expected = np.array([1.0, np.nan, np.inf, -np.inf, 2.0])
    assert output_error(expected.copy(), expected) == (0.0, True)
    swapped = np.array([1.0, np.nan, -np.inf, np.inf, 2.0])
    assert not output_error(swapped, expected)[1]
    finite_for_nan = np.array([1.0, 0.0, np.inf, -np.inf, 2.0])
    assert not output_error(finite_for_nan, expected)[1]


def test_a_long_gemm_compiles_verified():
    """A 64x2048 @ 2048x64 MatMul (random inputs of unit scale): its blocked float32 sums
    differ from the reference's in the low bits, and the compile's verification passes."""
    weights = RNG.standard_normal((2048, 64)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "b"], ["c"])],
        "long_gemm",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [64, 2048])],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, [64, 64])],
        [numpy_helper.from_array(weights, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    check = compiler_core.compile(model.SerializeToString()).manifest["verification"]
    assert check["passed"] is True and check["max_abs_error"] > 0, check


def test_a_graph_the_pipeline_did_not_fuse_is_refused_not_built_wrong():
    """compile_graph takes an optimized graph: one without fusion groups would build no
    kernels and leave its outputs unwritten."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(ValueError, match="no fusion group"):
        compile_graph(import_model(model), host_target())
