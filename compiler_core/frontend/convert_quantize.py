"""Converters for the quantization operators."""

from __future__ import annotations

from compiler_core.frontend.common import onnx_dtype_name
from compiler_core.frontend.convert_utils import (
    Converter,
    all_inputs,
    all_outputs,
    convert_conv,
    input_at,
)


def convert_quantize(ctx, node, attrs):
    attrs.ignore("saturate", "precision")
    if attrs.has("output_dtype") and attrs.get("output_dtype"):
        dtype = onnx_dtype_name(attrs.get("output_dtype"))
    elif input_at(node, 2):
        dtype = ctx.type(node.input[2]).dtype
    else:
        dtype = "uint8"
    ctx.emit(
        "QuantizeLinear",
        all_inputs(node),
        all_outputs(node),
        output_dtype=dtype,
        axis=attrs.get("axis", 1),
        block_size=attrs.get("block_size", 0),
    )


def convert_dequantize(ctx, node, attrs):
    values = {"axis": attrs.get("axis", 1), "block_size": attrs.get("block_size", 0)}
    if attrs.has("output_dtype") and attrs.get("output_dtype"):
        values["output_dtype"] = onnx_dtype_name(attrs.get("output_dtype"))
    ctx.emit("DequantizeLinear", all_inputs(node), all_outputs(node), **values)


def passthrough(op: str) -> Converter:
    def convert(ctx, node, attrs):
        ctx.emit(op, all_inputs(node), all_outputs(node))

    return convert


CONVERTERS: dict[str, dict[int, Converter]] = {
    "QuantizeLinear": {10: convert_quantize},
    "DequantizeLinear": {10: convert_dequantize},
    "DynamicQuantizeLinear": {11: passthrough("DynamicQuantizeLinear")},
    "MatMulInteger": {10: passthrough("MatMulInteger")},
    "ConvInteger": {10: convert_conv("ConvInteger")},
    "QLinearMatMul": {10: passthrough("QLinearMatMul")},
    "QLinearConv": {10: convert_conv("QLinearConv", weight_input=3)},
}
