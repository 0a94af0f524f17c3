"""Quantization operators (uint8/int8/uint16/int16/int32; float8 and 4-bit are out of scope)."""

from __future__ import annotations

import numpy as np

from compiler_core.graph.ir import OpKind, TensorType
from compiler_core.graph.ops.base import OpDef, evaluated, normalize_axis, opdef
from compiler_core.graph.ops.nn import _conv, _conv_rule


def expand_scale(node, scale: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Per-tensor, per-axis or blocked scale (or zero point) broadcast to x's shape."""
    if scale.ndim == 0 or scale.size == 1 and x.ndim <= 1:
        return scale.reshape(())
    axis = normalize_axis(node.attr("axis", 1), x.ndim, node)
    block = node.attr("block_size", 0)
    if block:
        expanded = np.repeat(scale, block, axis=axis)
        return np.take(expanded, np.arange(x.shape[axis]), axis=axis)
    shape = [1] * x.ndim
    shape[axis] = -1
    return scale.reshape(shape)


def _saturate(values: np.ndarray, dtype: str) -> np.ndarray:
    info = np.iinfo(dtype)
    return np.clip(values, info.min, info.max).astype(dtype)


def _quantize(node, inputs):
    x, scale = inputs[0], inputs[1]
    zero = inputs[2] if len(inputs) > 2 and inputs[2] is not None else None
    dtype = node.attr("output_dtype")
    s = expand_scale(node, scale, x).astype(np.float64)
    z = 0 if zero is None else expand_scale(node, zero, x).astype(np.float64)
    return [_saturate(np.rint(x.astype(np.float64) / s) + z, dtype)]


def _dequantize(node, inputs):
    x, scale = inputs[0], inputs[1]
    zero = inputs[2] if len(inputs) > 2 and inputs[2] is not None else None
    s = expand_scale(node, scale, x).astype(np.float64)
    z = 0 if zero is None else expand_scale(node, zero, x).astype(np.float64)
    dtype = node.attr("output_dtype", scale.dtype.name)
    return [((x.astype(np.float64) - z) * s).astype(dtype)]


def _quantize_rule(node, types):
    return [TensorType(types[0].shape, node.attr("output_dtype"))]


def _dequantize_rule(node, types):
    return [TensorType(types[0].shape, node.attr("output_dtype", types[1].dtype))]


def _dynamic_quantize(node, inputs):
    # Computed in float32, as the operator's definition (and every runtime) does.
    x = inputs[0].astype(np.float32)
    low, high = min(0.0, x.min(initial=0.0)), max(0.0, x.max(initial=0.0))
    scale = np.float32((high - low) / np.float32(255)) if high > low else np.float32(1.0)
    zero = np.clip(np.rint(-low / scale), 0, 255)
    y = _saturate(np.rint(x / scale) + zero, "uint8")
    return [y, np.asarray(scale, np.float32), np.asarray(zero, np.uint8)]


def _matmul_integer(node, inputs):
    a, b = inputs[0].astype(np.int64), inputs[1].astype(np.int64)
    a_zero = inputs[2] if len(inputs) > 2 else None
    b_zero = inputs[3] if len(inputs) > 3 else None
    if a_zero is not None:
        a = a - (
            a_zero.astype(np.int64).reshape(-1, 1)
            if a_zero.ndim == 1 and a_zero.size > 1
            else a_zero.astype(np.int64)
        )
    if b_zero is not None:
        b = b - b_zero.astype(np.int64)
    return [np.matmul(a, b).astype(np.int32)]


def _conv_integer(node, inputs):
    x, w = inputs[0].astype(np.int64), inputs[1].astype(np.int64)
    x_zero = inputs[2] if len(inputs) > 2 else None
    w_zero = inputs[3] if len(inputs) > 3 else None
    if x_zero is not None:
        x = x - x_zero.astype(np.int64)
    if w_zero is not None:
        w = (
            w - w_zero.astype(np.int64).reshape((-1,) + (1,) * (w.ndim - 1))
            if w_zero.size > 1
            else w - w_zero.astype(np.int64)
        )
    (out,) = _conv(node, [x.astype(np.float64), w.astype(np.float64)])
    return [np.rint(out).astype(np.int32)]


def _qlinear_matmul(node, inputs):
    a, a_scale, a_zero, b, b_scale, b_zero, y_scale, y_zero = inputs
    real_a = (a.astype(np.float64) - a_zero.astype(np.float64)) * a_scale.astype(np.float64)
    b_z = b_zero.astype(np.float64)
    b_s = b_scale.astype(np.float64)
    if b_z.ndim == 1 and b_z.size > 1:  # per-column
        b_z, b_s = b_z.reshape(1, -1), b_s.reshape(1, -1)
    real_b = (b.astype(np.float64) - b_z) * b_s
    product = np.matmul(real_a, real_b)
    y = np.rint(product / y_scale.astype(np.float64)) + y_zero.astype(np.float64)
    return [_saturate(y, y_zero.dtype.name)]


def _per_output_channel(values: np.ndarray, rank: int) -> np.ndarray:
    """A per-tensor scalar as is; a per-channel vector shaped to broadcast over (N, M, ...)."""
    if values.size == 1:
        return values.reshape(())
    return values.reshape((1, -1) + (1,) * (rank - 2))


def _qlinear_conv(node, inputs):
    x, x_scale, x_zero, w, w_scale, w_zero, y_scale, y_zero = inputs[:8]
    bias = inputs[8] if len(inputs) > 8 else None
    x_int = x.astype(np.int64) - x_zero.astype(np.int64)
    # The weight zero point (like its scale) is per tensor or per output channel (axis 0).
    w_int = w.astype(np.int64)
    if w_zero.size > 1:
        w_int = w_int - w_zero.astype(np.int64).reshape((-1,) + (1,) * (w.ndim - 1))
    else:
        w_int = w_int - w_zero.astype(np.int64).reshape(())
    # Integer products summed in float64 stay exact for any realistic accumulator size.
    (accumulated,) = _conv(node, [x_int.astype(np.float64), w_int.astype(np.float64)])
    if bias is not None:
        accumulated = accumulated + _per_output_channel(bias.astype(np.float64), x.ndim)
    multiplier = (
        x_scale.astype(np.float64).reshape(())
        * _per_output_channel(w_scale.astype(np.float64), x.ndim)
        / y_scale.astype(np.float64).reshape(())
    )
    y = np.rint(accumulated * multiplier) + y_zero.astype(np.float64).reshape(())
    return [_saturate(y, y_zero.dtype.name)]


def _qlinear_conv_rule(node, types):
    x, w, y_zero = types[0], types[3], types[7]
    (conv,) = _conv_rule(node, [x, w])
    return [TensorType(conv.shape, y_zero.dtype)]


OPS: dict[str, OpDef] = {
    "QuantizeLinear": opdef("QuantizeLinear", OpKind.BROADCAST, _quantize_rule, _quantize),
    "DequantizeLinear": opdef("DequantizeLinear", OpKind.BROADCAST, _dequantize_rule, _dequantize),
    "DynamicQuantizeLinear": opdef(
        "DynamicQuantizeLinear", OpKind.OPAQUE, evaluated(_dynamic_quantize), _dynamic_quantize
    ),
    "MatMulInteger": opdef(
        "MatMulInteger", OpKind.OUT_ELEMWISE_FUSABLE, evaluated(_matmul_integer), _matmul_integer
    ),
    "ConvInteger": opdef(
        "ConvInteger", OpKind.OUT_ELEMWISE_FUSABLE, evaluated(_conv_integer), _conv_integer
    ),
    "QLinearMatMul": opdef(
        "QLinearMatMul", OpKind.OUT_ELEMWISE_FUSABLE, evaluated(_qlinear_matmul), _qlinear_matmul
    ),
    "QLinearConv": opdef(
        "QLinearConv", OpKind.OUT_ELEMWISE_FUSABLE, _qlinear_conv_rule, _qlinear_conv
    ),
}
