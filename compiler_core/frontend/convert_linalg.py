"""Converters for linear-algebra operators."""

from __future__ import annotations

import math

from compiler_core.frontend.convert_utils import Converter, direct, emit_reshape


def convert_matmul(ctx, node, attrs) -> None:
    """MatMul; a batched A times a constant 2-D B becomes one GEMM over all of A's rows
    ([..., M, K] -> [rows, K] -> [rows, N] -> [..., M, N]), as ONNX Runtime runs it. PyTorch's
    attention exports the QKV projection as [197, 1, 768] @ [768, 2304]: 197 batches of one
    row each, which the GEMM would run row by row, reading all of B for every row."""
    a, b = node.input
    a_shape, b_shape = ctx.type(a).shape, ctx.type(b).shape
    batches = math.prod(a_shape[:-2]) if len(a_shape) > 2 else 1
    if not (ctx.has_value(b) and len(b_shape) == 2 and batches > 1):
        ctx.emit("MatMul", [a, b], list(node.output))
        return
    rows = math.prod(a_shape[:-1])
    flat = emit_reshape(ctx, a, (rows, a_shape[-1]))
    product = ctx.emit("MatMul", [flat, b], 1)
    emit_reshape(ctx, product, (*a_shape[:-1], b_shape[-1]), output=node.output[0])


CONVERTERS: dict[str, dict[int, Converter]] = {
    "Det": {11: direct()},
    "MatMul": {1: convert_matmul},
}
