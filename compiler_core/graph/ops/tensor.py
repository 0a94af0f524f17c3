"""Injective operators: data movement with static shape parameters."""

from __future__ import annotations

import numpy as np

from compiler_core.graph.ir import OpKind, TensorType
from compiler_core.graph.ops.base import (
    OpDef,
    ShapeError,
    broadcast_shapes,
    normalize_axis,
    opdef,
)


def _reshape_rule(node, types):
    shape = tuple(node.attr("shape"))
    if int(np.prod(shape, dtype=np.int64)) != types[0].size:
        raise ShapeError(f"cannot reshape {types[0]} to {list(shape)}")
    return [TensorType(shape, types[0].dtype)]


def _reshape(node, inputs):
    return [inputs[0].reshape(node.attr("shape"))]


def _transpose_rule(node, types):
    perm = node.attr("perm")
    if sorted(perm) != list(range(types[0].rank)):
        raise ShapeError(f"perm {list(perm)} is not a permutation of rank {types[0].rank}")
    return [TensorType(tuple(types[0].shape[p] for p in perm), types[0].dtype)]


def _transpose(node, inputs):
    return [np.ascontiguousarray(np.transpose(inputs[0], node.attr("perm")))]


def _concat_rule(node, types):
    first = types[0]
    axis = normalize_axis(node.attr("axis"), first.rank, node)
    total = 0
    for t in types:
        if t.rank != first.rank or any(
            a != b for i, (a, b) in enumerate(zip(t.shape, first.shape, strict=True)) if i != axis
        ):
            raise ShapeError(f"cannot concatenate {first} and {t} on axis {axis}")
        total += t.shape[axis]
    shape = list(first.shape)
    shape[axis] = total
    return [TensorType(tuple(shape), first.dtype)]


def _concat(node, inputs):
    return [np.concatenate(inputs, axis=node.attr("axis"))]


def _split_rule(node, types):
    t = types[0]
    axis = normalize_axis(node.attr("axis"), t.rank, node)
    sizes = node.attr("sizes")
    if sum(sizes) != t.shape[axis]:
        raise ShapeError(f"split sizes {list(sizes)} do not add up to {t.shape[axis]}")
    out = []
    for size in sizes:
        shape = list(t.shape)
        shape[axis] = size
        out.append(TensorType(tuple(shape), t.dtype))
    return out


def _split(node, inputs):
    x = inputs[0]
    axis = node.attr("axis")
    bounds = np.cumsum(node.attr("sizes"))[:-1]
    return [np.ascontiguousarray(part) for part in np.split(x, bounds, axis=axis)]


def slice_objects(node, shape):
    """Python slices for a Slice node's static starts/ends/axes/steps (ONNX clamping rules)."""
    index = [slice(None)] * len(shape)
    starts, ends = node.attr("starts"), node.attr("ends")
    axes = node.attr("axes", tuple(range(len(starts))))
    steps = node.attr("steps", (1,) * len(starts))
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        axis = normalize_axis(axis, len(shape), node)
        dim = shape[axis]
        if step == 0:
            raise ShapeError("slice step must not be zero")
        start = start + dim if start < 0 else start
        end = end + dim if end < 0 else end
        if step > 0:
            start, end = min(max(start, 0), dim), min(max(end, 0), dim)
        else:
            start, end = min(max(start, -1), dim - 1), min(max(end, -1), dim - 1)
        index[axis] = slice(start, None if end < 0 else end, step)
    return tuple(index)


def _slice_rule(node, types):
    t = types[0]
    index = slice_objects(node, t.shape)
    shape = tuple(len(range(*s.indices(d))) for s, d in zip(index, t.shape, strict=True))
    return [TensorType(shape, t.dtype)]


def _slice(node, inputs):
    return [np.ascontiguousarray(inputs[0][slice_objects(node, inputs[0].shape)])]


def _gather_rule(node, types):
    data, indices = types
    axis = normalize_axis(node.attr("axis", 0), data.rank, node)
    shape = data.shape[:axis] + indices.shape + data.shape[axis + 1 :]
    return [TensorType(shape, data.dtype)]


def _gather(node, inputs):
    data, indices = inputs
    axis = normalize_axis(node.attr("axis", 0), data.ndim, node)
    dim = data.shape[axis]
    idx = np.where(indices < 0, indices + dim, indices).astype(np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= dim):
        raise IndexError(f"Gather index out of range for dimension {dim}")
    return [np.take(data, idx, axis=axis)]


def _expand_rule(node, types):
    shape = broadcast_shapes(types[0].shape, node.attr("shape"))
    return [TensorType(shape, types[0].dtype)]


def _expand(node, inputs):
    x = inputs[0]
    shape = broadcast_shapes(x.shape, node.attr("shape"))
    return [np.array(np.broadcast_to(x, shape))]


def _tile_rule(node, types):
    reps = node.attr("repeats")
    if len(reps) != types[0].rank:
        raise ShapeError(f"Tile repeats {list(reps)} do not match rank {types[0].rank}")
    shape = tuple(d * r for d, r in zip(types[0].shape, reps, strict=True))
    return [TensorType(shape, types[0].dtype)]


def _tile(node, inputs):
    return [np.tile(inputs[0], node.attr("repeats"))]


def _pad_rule(node, types):
    t = types[0]
    pads = node.attr("pads")
    rank = t.rank
    shape = tuple(t.shape[i] + pads[i] + pads[i + rank] for i in range(rank))
    if any(d < 0 for d in shape):
        raise ShapeError(f"pads {list(pads)} make a negative dimension")
    if node.attr("mode", "constant") != "constant" and any(
        p > 0 and d == 0 for p, d in zip(pads, t.shape * 2, strict=True)
    ):
        raise ShapeError("cannot reflect or extend an empty axis")
    return [TensorType(shape, t.dtype)]


def _pad(node, inputs):
    x = inputs[0]
    rank = x.ndim
    pads = node.attr("pads")
    # Negative pads crop: apply the positive part with np.pad, then slice.
    widths = [(max(pads[i], 0), max(pads[i + rank], 0)) for i in range(rank)]
    mode = node.attr("mode", "constant")
    if mode == "constant":
        out = np.pad(x, widths, mode="constant", constant_values=node.attr("value", 0))
    elif mode == "reflect":
        out = np.pad(x, widths, mode="reflect")
    elif mode == "edge":
        out = np.pad(x, widths, mode="edge")
    elif mode == "wrap":
        out = np.pad(x, widths, mode="wrap")
    else:
        raise ValueError(f"unknown pad mode {mode!r}")
    crop = tuple(
        slice(-min(pads[i], 0), out.shape[i] + min(pads[i + rank], 0)) for i in range(rank)
    )
    return [np.ascontiguousarray(out[crop]).astype(x.dtype, copy=False)]


def _shape_bounds(node, rank):
    start = node.attr("start", 0)
    end = node.attr("end", rank)
    start = min(max(start + rank if start < 0 else start, 0), rank)
    end = min(max(end + rank if end < 0 else end, 0), rank)
    return start, end


def _shape_values(node, types):
    start, end = _shape_bounds(node, types[0].rank)
    return [np.array(types[0].shape[start:end], dtype=np.int64)]


def _shape_rule(node, types):
    start, end = _shape_bounds(node, types[0].rank)
    return [TensorType((max(end - start, 0),), "int64")]


def _size_values(node, types):
    return [np.array(types[0].size, dtype=np.int64)]


# Ops whose output holds their first input's bytes in the same order, only shaped anew: a
# kernel of one of them alone copies nothing (`build.view_aliases`).
BYTE_VIEWS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})

OPS: dict[str, OpDef] = {
    "Reshape": opdef("Reshape", OpKind.INJECTIVE, _reshape_rule, _reshape),
    "Transpose": opdef("Transpose", OpKind.INJECTIVE, _transpose_rule, _transpose),
    "Concat": opdef("Concat", OpKind.INJECTIVE, _concat_rule, _concat),
    "Split": opdef("Split", OpKind.INJECTIVE, _split_rule, _split),
    "Slice": opdef("Slice", OpKind.INJECTIVE, _slice_rule, _slice),
    "Gather": opdef("Gather", OpKind.INJECTIVE, _gather_rule, _gather),
    "Expand": opdef("Expand", OpKind.BROADCAST, _expand_rule, _expand),
    "Tile": opdef("Tile", OpKind.INJECTIVE, _tile_rule, _tile),
    "Pad": opdef("Pad", OpKind.INJECTIVE, _pad_rule, _pad),
    "Shape": opdef(
        "Shape",
        OpKind.OPAQUE,
        _shape_rule,
        lambda node, inputs: _shape_values(node, [TensorType.of(inputs[0])]),
        from_types=_shape_values,
    ),
    "Size": opdef(
        "Size",
        OpKind.OPAQUE,
        lambda node, types: [TensorType((), "int64")],
        lambda node, inputs: _size_values(node, [TensorType.of(inputs[0])]),
        from_types=_size_values,
    ),
}
