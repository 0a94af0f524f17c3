"""Converters for indexing operators. Operators whose output shape depends on data values
(NonZero, Unique, Compress's condition) need those values at compile time: they are computed
here, once, and become constants (or a constant-index Gather)."""

from __future__ import annotations

import numpy as np

from compiler_core.frontend.common import onnx_dtype_name
from compiler_core.frontend.convert_utils import (
    Converter,
    all_inputs,
    all_outputs,
    direct,
    input_at,
    ints,
)


def convert_scatter_elements(ctx, node, attrs):
    ctx.emit(
        "ScatterElements",
        all_inputs(node),
        all_outputs(node),
        axis=attrs.get("axis", 0),
        reduction=attrs.get("reduction", "none"),
    )


def convert_scan(op):
    def convert(ctx, node, attrs):
        axis = int(np.asarray(ctx.value(node.input[1], f"{op} axis")).reshape(-1)[0])
        ctx.emit(
            op,
            [node.input[0]],
            all_outputs(node),
            axis=axis,
            exclusive=attrs.get("exclusive", 0),
            reverse=attrs.get("reverse", 0),
        )

    return convert


def convert_top_k(ctx, node, attrs):
    k = int(np.asarray(ctx.value(node.input[1], "TopK k")).reshape(-1)[0])
    attrs.ignore("sorted")  # results are always sorted, which satisfies both settings
    ctx.emit(
        "TopK",
        [node.input[0]],
        all_outputs(node) + [""] * (2 - len(node.output)),
        k=k,
        axis=attrs.get("axis", -1),
        largest=attrs.get("largest", 1),
    )


def convert_one_hot(ctx, node, attrs):
    depth = int(np.asarray(ctx.value(node.input[1], "OneHot depth")).reshape(-1)[0])
    ctx.emit(
        "OneHot",
        [node.input[0], node.input[2]],
        all_outputs(node),
        depth=depth,
        axis=attrs.get("axis", -1),
    )


def convert_trilu(ctx, node, attrs):
    k = 0
    if input_at(node, 1):
        k = int(np.asarray(ctx.value(node.input[1], "Trilu k")).reshape(-1)[0])
    ctx.emit("Trilu", [node.input[0]], all_outputs(node), k=k, upper=attrs.get("upper", 1))


def convert_center_crop_pad(ctx, node, attrs):
    rank = ctx.type(node.input[0]).rank
    shape = ints(ctx.value(node.input[1], "CenterCropPad shape"))
    axes = tuple(a % rank for a in (attrs.get("axes") or range(rank)))
    ctx.emit("CenterCropPad", [node.input[0]], all_outputs(node), shape=shape, axes=axes)


def convert_bit_cast(ctx, node, attrs):
    ctx.emit("BitCast", [node.input[0]], all_outputs(node), to=onnx_dtype_name(attrs.get("to")))


def convert_non_zero(ctx, node, attrs):
    data = ctx.value(node.input[0], "NonZero input (its output shape depends on it)")
    ctx.add_constant(
        np.array(np.nonzero(data), dtype=np.int64).reshape(data.ndim, -1), name=node.output[0]
    )


def convert_unique(ctx, node, attrs):
    data = ctx.value(node.input[0], "Unique input (its output shape depends on it)")
    axis = attrs.get("axis")
    keep_sorted = attrs.get("sorted", 1)
    values, first, inverse, counts = np.unique(
        data, return_index=True, return_inverse=True, return_counts=True, axis=axis
    )
    if not keep_sorted:  # order of first occurrence
        order = np.argsort(first, kind="stable")
        remap = np.empty_like(order)
        remap[order] = np.arange(len(order))
        values = np.take(values, order, axis=0 if axis is None else axis)
        first, counts, inverse = first[order], counts[order], remap[inverse.reshape(-1)]
    results = [values, first, inverse.reshape(-1), counts]
    dtypes = [data.dtype, np.int64, np.int64, np.int64]
    for name, value, dtype in zip(node.output, results, dtypes, strict=False):
        if name:
            ctx.add_constant(np.asarray(value).astype(dtype), name=name)


def convert_compress(ctx, node, attrs):
    condition = ctx.value(node.input[1], "Compress condition (its output shape depends on it)")
    positions = np.nonzero(np.asarray(condition).astype(bool).reshape(-1))[0].astype(np.int64)
    axis = attrs.get("axis")
    data = node.input[0]
    if axis is None:
        size = ctx.type(data).size
        data = ctx.emit("Reshape", [data], 1, shape=(size,))
        axis = 0
    length = ctx.type(data).shape[axis]
    index = ctx.add_constant(positions[positions < length], prefix="compress_index")
    ctx.emit("Gather", [data, index], all_outputs(node), axis=axis)


def convert_eye_like(ctx, node, attrs):
    t = ctx.type(node.input[0])
    dtype = onnx_dtype_name(attrs.get("dtype")) if attrs.has("dtype") else t.dtype
    eye = np.eye(t.shape[0], t.shape[1], k=attrs.get("k", 0), dtype=dtype)
    ctx.add_constant(eye, name=node.output[0])


CONVERTERS: dict[str, dict[int, Converter]] = {
    "GatherElements": {11: direct(axis=0)},
    "GatherND": {11: direct(batch_dims=0)},
    "ScatterElements": {11: convert_scatter_elements},
    "Scatter": {9: convert_scatter_elements},
    "ScatterND": {11: direct(reduction="none")},
    "CumSum": {11: convert_scan("CumSum")},
    "CumProd": {26: convert_scan("CumProd")},
    "TopK": {10: convert_top_k},
    "OneHot": {9: convert_one_hot},
    "Trilu": {14: convert_trilu},
    "ReverseSequence": {10: direct(batch_axis=1, time_axis=0)},
    "CenterCropPad": {18: convert_center_crop_pad},
    "BitCast": {26: convert_bit_cast},
    "TensorScatter": {24: direct(axis=-2, mode="linear")},
    "NonZero": {9: convert_non_zero},
    "Unique": {11: convert_unique},
    "Compress": {9: convert_compress},
    "EyeLike": {9: convert_eye_like},
}
