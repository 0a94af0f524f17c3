"""Indexing operators: gathers and scatters, scans, sorting, one-hot, triangles."""

from __future__ import annotations

import numpy as np

from compiler_core.graph.ir import OpKind
from compiler_core.graph.ops.base import (
    OpDef,
    ShapeError,
    evaluated,
    normalize_axis,
    opdef,
    same_as,
)


def _wrap(indices: np.ndarray, size: int) -> np.ndarray:
    indices = indices.astype(np.int64)
    wrapped = np.where(indices < 0, indices + size, indices)
    if wrapped.size and (wrapped.min() < 0 or wrapped.max() >= size):
        raise IndexError(f"index out of range for dimension {size}")
    return wrapped


def _gather_elements(node, inputs):
    data, indices = inputs
    axis = normalize_axis(node.attr("axis", 0), data.ndim, node)
    return [np.take_along_axis(data, _wrap(indices, data.shape[axis]), axis=axis)]


def _gather_nd(node, inputs):
    data, indices = inputs
    batch = node.attr("batch_dims", 0)
    depth = indices.shape[-1]
    batch_shape = data.shape[:batch]
    flat_data = data.reshape((-1,) + data.shape[batch:])
    flat_idx = indices.reshape((int(np.prod(batch_shape, dtype=np.int64)), -1, depth))
    rows = []
    for b in range(flat_data.shape[0]):
        idx = flat_idx[b]
        wrapped = [_wrap(idx[:, d], flat_data.shape[1 + d]) for d in range(depth)]
        rows.append(flat_data[b][tuple(wrapped)])
    out = np.stack(rows)
    return [out.reshape(indices.shape[:-1] + data.shape[batch + depth :])]


_REDUCE = {
    "none": None,
    "add": np.add,
    "mul": np.multiply,
    "max": np.maximum,
    "min": np.minimum,
}


def _scatter_elements(node, inputs):
    data, indices, updates = inputs
    axis = normalize_axis(node.attr("axis", 0), data.ndim, node)
    out = data.copy()
    index = _wrap(indices, data.shape[axis])
    grid = list(np.indices(index.shape, sparse=False))
    grid[axis] = index
    combine = _REDUCE[node.attr("reduction", "none")]
    if combine is None:
        out[tuple(grid)] = updates
    else:
        combine.at(out, tuple(grid), updates)
    return [out]


def _scatter_nd(node, inputs):
    data, indices, updates = inputs
    out = data.copy()
    depth = indices.shape[-1]
    flat_idx = indices.reshape(-1, depth)
    flat_upd = updates.reshape((flat_idx.shape[0],) + data.shape[depth:])
    combine = _REDUCE[node.attr("reduction", "none")]
    for k in range(flat_idx.shape[0]):
        where = tuple(_wrap(flat_idx[k, d], data.shape[d]) for d in range(depth))
        out[where] = flat_upd[k] if combine is None else combine(out[where], flat_upd[k])
    return [out]


def _scan(fn):
    def compute(node, inputs):
        x = inputs[0]
        axis = normalize_axis(node.attr("axis"), x.ndim, node)
        v = np.flip(x, axis) if node.attr("reverse", 0) else x
        out = fn(v, axis=axis, dtype=x.dtype)
        if node.attr("exclusive", 0):
            identity = 0 if fn is np.cumsum else 1
            out = np.concatenate(
                [
                    np.full_like(np.take(out, [0], axis=axis), identity),
                    np.delete(out, -1, axis=axis),
                ],
                axis=axis,
            )
        out = np.flip(out, axis) if node.attr("reverse", 0) else out
        return [np.ascontiguousarray(out)]

    return compute


def _top_k(node, inputs):
    x = inputs[0]
    axis = normalize_axis(node.attr("axis", -1), x.ndim, node)
    k = node.attr("k")
    keys = -x if node.attr("largest", 1) else x
    if x.dtype.kind == "u" and node.attr("largest", 1):
        keys = np.iinfo(x.dtype).max - x
    order = np.argsort(keys, axis=axis, kind="stable")
    indices = np.take(order, np.arange(k), axis=axis)
    values = np.take_along_axis(x, indices, axis=axis)
    return [values, indices.astype(np.int64)]


def _one_hot(node, inputs):
    indices, values = inputs[0], inputs[1]
    depth = node.attr("depth")
    rank = indices.ndim + 1
    axis = node.attr("axis", -1)
    axis = axis + rank if axis < 0 else axis
    idx = indices.astype(np.int64)
    idx = np.where(idx < 0, idx + depth, idx)
    classes = np.arange(depth).reshape([depth if d == axis else 1 for d in range(rank)])
    hot = np.expand_dims(idx, axis) == classes
    return [np.where(hot, values[1], values[0]).astype(values.dtype)]


def _trilu(node, inputs):
    x = inputs[0]
    k = node.attr("k", 0)
    out = np.triu(x, k) if node.attr("upper", 1) else np.tril(x, k)
    return [out]


def _reverse_sequence(node, inputs):
    x, lengths = inputs
    batch_axis, time_axis = node.attr("batch_axis", 1), node.attr("time_axis", 0)
    out = x.copy()
    for b, length in enumerate(lengths.astype(np.int64)):
        index = [slice(None)] * x.ndim
        index[batch_axis] = b
        index[time_axis] = slice(0, length)
        source = list(index)
        source[time_axis] = slice(length - 1, None, -1) if length > 0 else slice(0, 0)
        out[tuple(index)] = x[tuple(source)]
    return [out]


def _center_crop_pad(node, inputs):
    x = inputs[0]
    target = node.attr("shape")
    axes = node.attr("axes")
    out = x
    for axis, size in zip(axes, target, strict=True):
        current = out.shape[axis]
        if size < current:  # crop, the extra element on the right when odd
            start = (current - size) // 2
            out = np.take(out, np.arange(start, start + size), axis=axis)
        elif size > current:  # pad with zeros, the extra element on the right when odd
            before = (size - current) // 2
            widths = [(0, 0)] * out.ndim
            widths[axis] = (before, size - current - before)
            out = np.pad(out, widths)
    return [np.ascontiguousarray(out)]


def _bit_cast(node, inputs):
    x = inputs[0]
    target = np.dtype(node.attr("to"))
    if target.itemsize == x.dtype.itemsize:
        return [np.array(x, order="C").view(target)]
    if target.itemsize < x.dtype.itemsize:  # each element splits along a new last axis
        ratio = x.dtype.itemsize // target.itemsize
        return [np.ascontiguousarray(x).view(target).reshape(x.shape + (ratio,))]
    return [np.ascontiguousarray(x).view(target).reshape(x.shape[:-1])]


def _tensor_scatter(node, inputs):
    """Write `update` into a copy of the cache along the sequence axis, at each batch row's
    write index (zero when absent); circular mode wraps positions around the cache length."""
    past, update = inputs[0], inputs[1]
    axis = normalize_axis(node.attr("axis", -2), past.ndim, node)
    batch = past.shape[0]
    starts = np.zeros(batch, np.int64) if inputs[2] is None else inputs[2].astype(np.int64)
    capacity, length = past.shape[axis], update.shape[axis]
    out = past.copy()
    for b in range(batch):
        positions = starts[b] + np.arange(length)
        if node.attr("mode", "linear") == "circular":
            positions = positions % capacity
        elif positions.size and (positions.min() < 0 or positions.max() >= capacity):
            raise IndexError(f"TensorScatter writes past the cache length {capacity}")
        # Axis 0 is the batch: within a row the sequence axis is axis - 1.
        target = np.moveaxis(out[b], axis - 1, 0)
        target[positions] = np.moveaxis(update[b], axis - 1, 0)
    return [out]


def _tensor_scatter_rule(node, types):
    past, update = types[0], types[1]
    axis = normalize_axis(node.attr("axis", -2), past.rank, node)
    if axis == 0:
        raise ShapeError(f"TensorScatter {node.name!r}: the sequence axis cannot be the batch axis")
    fixed = [d for k, d in enumerate(past.shape) if k != axis]
    if update.rank != past.rank or fixed != [d for k, d in enumerate(update.shape) if k != axis]:
        raise ShapeError(
            f"TensorScatter {node.name!r}: update {update.shape} does not fit cache {past.shape}"
        )
    if update.shape[axis] > past.shape[axis]:
        raise ShapeError(f"TensorScatter {node.name!r}: update is longer than the cache")
    return [past]


OPS: dict[str, OpDef] = {
    "GatherElements": opdef(
        "GatherElements", OpKind.INJECTIVE, evaluated(_gather_elements), _gather_elements
    ),
    "GatherND": opdef("GatherND", OpKind.INJECTIVE, evaluated(_gather_nd), _gather_nd),
    "ScatterElements": opdef("ScatterElements", OpKind.INJECTIVE, same_as(0), _scatter_elements),
    "ScatterND": opdef("ScatterND", OpKind.INJECTIVE, same_as(0), _scatter_nd),
    "CumSum": opdef("CumSum", OpKind.OPAQUE, same_as(0), _scan(np.cumsum)),
    "CumProd": opdef("CumProd", OpKind.OPAQUE, same_as(0), _scan(np.cumprod)),
    "TopK": opdef("TopK", OpKind.OPAQUE, evaluated(_top_k), _top_k),
    "OneHot": opdef("OneHot", OpKind.INJECTIVE, evaluated(_one_hot), _one_hot),
    "Trilu": opdef("Trilu", OpKind.INJECTIVE, same_as(0), _trilu),
    "ReverseSequence": opdef("ReverseSequence", OpKind.INJECTIVE, same_as(0), _reverse_sequence),
    "CenterCropPad": opdef(
        "CenterCropPad", OpKind.INJECTIVE, evaluated(_center_crop_pad), _center_crop_pad
    ),
    "BitCast": opdef("BitCast", OpKind.INJECTIVE, evaluated(_bit_cast), _bit_cast),
    "TensorScatter": opdef(
        "TensorScatter", OpKind.INJECTIVE, _tensor_scatter_rule, _tensor_scatter
    ),
}
