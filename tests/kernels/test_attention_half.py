"""Attention on half-precision data (float16 and bfloat16) runs natively, accumulating in
float32 and rounding once: within half an ulp of the float32 computation on the same inputs
(the ONNX node suite's bfloat16 cases round after every step and expect that rounding)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import compiler_core
from compiler_core.runtime import load

RNG = np.random.default_rng(5)
SHAPE = [2, 3, 7, 16]  # batch, heads, tokens, head size
HALF = {
    "bfloat16": (TensorProto.BFLOAT16, ml_dtypes.bfloat16),
    "float16": (TensorProto.FLOAT16, np.float16),
}


def attention_model(elem_type):
    node = helper.make_node("Attention", ["q", "k", "v"], ["y"], is_causal=1)
    inputs = [helper.make_tensor_value_info(n, elem_type, SHAPE) for n in "qkv"]
    graph = helper.make_graph(
        [node], "attention", inputs, [helper.make_tensor_value_info("y", elem_type, SHAPE)]
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


@pytest.mark.parametrize("dtype", sorted(HALF))
def test_half_precision_attention_is_the_float32_result_rounded_once(dtype):
    elem_type, numpy_type = HALF[dtype]
    feeds = {n: RNG.standard_normal(SHAPE).astype(np.float32).astype(numpy_type) for n in "qkv"}
    module = load(compiler_core.compile(attention_model(elem_type)))
    actual = module.run(feeds)["y"].astype(np.float32)
    # The same (rounded) inputs through the reference in float32.
    wide = {n: v.astype(np.float32) for n, v in feeds.items()}
    (expected,) = ReferenceEvaluator(attention_model(TensorProto.FLOAT)).run(None, wide)
    ulp = np.spacing(np.abs(expected).astype(numpy_type)).astype(np.float32)
    assert np.all(np.abs(actual - expected) <= 0.5 * ulp + 1e-6), dtype
