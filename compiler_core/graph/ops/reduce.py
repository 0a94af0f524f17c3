"""Reductions (static axes), arg-reductions, and the softmax family."""

from __future__ import annotations

import numpy as np

from compiler_core.graph.ir import OpKind, TensorType
from compiler_core.graph.ops.base import OpDef, normalize_axis, opdef, same_as


def reduce_axes(node, rank: int) -> tuple[int, ...]:
    """Static axes of a reduce node; an empty tuple means all axes."""
    axes = node.attr("axes", ())
    if not axes:
        return tuple(range(rank))
    return tuple(sorted({normalize_axis(a, rank, node) for a in axes}))


def _reduce_rule(node, types):
    t = types[0]
    axes = reduce_axes(node, t.rank)
    keep = node.attr("keepdims", 1)
    shape = tuple((1 if keep else None) if i in axes else d for i, d in enumerate(t.shape))
    return [TensorType(tuple(d for d in shape if d is not None), t.dtype)]


def _in_float64(fn):
    def wrapped(x, axis, keepdims):
        if x.dtype.kind == "f":
            return fn(x.astype(np.float64), axis, keepdims).astype(x.dtype)
        return fn(x, axis, keepdims).astype(x.dtype)

    return wrapped


def _empty_aware(fn, identity):
    # ONNX defines reductions over empty axes by their identity (e.g. max over nothing = -inf).
    def wrapped(x, axis, keepdims):
        if x.size == 0:
            shape = tuple(
                (1 if keepdims else None) if i in axis else d for i, d in enumerate(x.shape)
            )
            return np.full(tuple(d for d in shape if d is not None), identity(x.dtype), x.dtype)
        return fn(x, axis=axis, keepdims=keepdims)

    return wrapped


def _min_identity(dtype):
    if dtype.kind == "b":
        return True
    return np.inf if dtype.kind == "f" else np.iinfo(dtype).max


def _max_identity(dtype):
    if dtype.kind == "b":
        return False
    return -np.inf if dtype.kind == "f" else np.iinfo(dtype).min


REDUCERS = {
    "ReduceSum": _in_float64(lambda x, a, k: np.sum(x, axis=a, keepdims=k)),
    "ReduceMean": _in_float64(lambda x, a, k: np.mean(x, axis=a, keepdims=k)),
    "ReduceProd": _in_float64(lambda x, a, k: np.prod(x, axis=a, keepdims=k)),
    "ReduceMax": _empty_aware(np.max, _max_identity),
    "ReduceMin": _empty_aware(np.min, _min_identity),
    "ReduceL1": _in_float64(lambda x, a, k: np.sum(np.abs(x), axis=a, keepdims=k)),
    "ReduceL2": _in_float64(lambda x, a, k: np.sqrt(np.sum(x * x, axis=a, keepdims=k))),
    "ReduceSumSquare": _in_float64(lambda x, a, k: np.sum(x * x, axis=a, keepdims=k)),
    "ReduceLogSum": _in_float64(lambda x, a, k: np.log(np.sum(x, axis=a, keepdims=k))),
    "ReduceLogSumExp": _in_float64(
        lambda x, a, k: (
            np.log(np.sum(np.exp(x), axis=a, keepdims=k))
            if x.size
            else np.log(np.sum(x, axis=a, keepdims=k))
        )
    ),
}


def _reducer(name, fn) -> OpDef:
    def compute(node, inputs):
        x = inputs[0]
        axes = reduce_axes(node, x.ndim)
        with np.errstate(all="ignore"):
            return [np.asarray(fn(x, axes, bool(node.attr("keepdims", 1))))]

    return opdef(name, OpKind.REDUCTION, _reduce_rule, compute)


def _arg_rule(node, types):
    t = types[0]
    axis = normalize_axis(node.attr("axis", 0), t.rank, node)
    keep = node.attr("keepdims", 1)
    shape = tuple(
        (1,) if i == axis and keep else () if i == axis else (d,) for i, d in enumerate(t.shape)
    )
    return [TensorType(tuple(d for part in shape for d in part), "int64")]


def _arg(fn):
    def compute(node, inputs):
        x = inputs[0]
        axis = normalize_axis(node.attr("axis", 0), x.ndim, node)
        if node.attr("select_last_index", 0):
            flipped = np.flip(x, axis)
            out = x.shape[axis] - 1 - fn(flipped, axis=axis)
        else:
            out = fn(x, axis=axis)
        if node.attr("keepdims", 1):
            out = np.expand_dims(out, axis)
        return [out.astype(np.int64)]

    return compute


def _softmax(node, inputs):
    """`zero_empty_rows` (Kiln's own attribute, set by decompose_attention): a row of -inf
    alone (no key allowed) gives zeros, as Attention defines it, instead of NaN."""
    x = inputs[0]
    axis = node.attr("axis", -1)
    v = x.astype(np.float64)
    peak = np.max(v, axis=axis, keepdims=True)
    empty = node.attr("zero_empty_rows", 0) and np.isneginf(peak)
    if np.any(empty):
        v, peak = np.where(empty, -np.inf, v), np.where(empty, 0.0, peak)
    e = np.exp(v - peak)
    total = np.sum(e, axis=axis, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(total > 0, e / total, 0.0) if np.any(empty) else e / total
    return [out.astype(x.dtype)]


def _log_softmax(node, inputs):
    x = inputs[0]
    axis = node.attr("axis", -1)
    v = x.astype(np.float64)
    shifted = v - np.max(v, axis=axis, keepdims=True)
    out = shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))
    return [out.astype(x.dtype)]


def _hardmax(node, inputs):
    x = inputs[0]
    axis = normalize_axis(node.attr("axis", -1), x.ndim, node)
    index = np.expand_dims(np.argmax(x, axis=axis), axis)
    out = np.zeros_like(x)
    np.put_along_axis(out, index, 1, axis=axis)
    return [out]


OPS: dict[str, OpDef] = {
    **{name: _reducer(name, fn) for name, fn in REDUCERS.items()},
    "ArgMax": opdef("ArgMax", OpKind.REDUCTION, _arg_rule, _arg(np.argmax)),
    "ArgMin": opdef("ArgMin", OpKind.REDUCTION, _arg_rule, _arg(np.argmin)),
    "Softmax": opdef("Softmax", OpKind.OPAQUE, same_as(0), _softmax),
    "LogSoftmax": opdef("LogSoftmax", OpKind.OPAQUE, same_as(0), _log_softmax),
    "Hardmax": opdef("Hardmax", OpKind.OPAQUE, same_as(0), _hardmax),
}
