"""Normalization operators beyond the core set: Lp, group and mean-variance normalization."""

from __future__ import annotations

import numpy as np

from compiler_core.graph.ir import OpKind
from compiler_core.graph.ops.base import OpDef, normalize_axis, opdef, same_as


def _lp_normalization(node, inputs):
    x = inputs[0]
    axis = normalize_axis(node.attr("axis", -1), x.ndim, node)
    v = x.astype(np.float64)
    if node.attr("p", 2) == 1:
        norm = np.abs(v).sum(axis=axis, keepdims=True)
    else:
        norm = np.sqrt((v * v).sum(axis=axis, keepdims=True))
    out = np.divide(v, norm, out=np.zeros_like(v), where=norm != 0)
    return [out.astype(x.dtype)]


def _group_normalization(node, inputs):
    x, scale, bias = inputs
    groups = node.attr("num_groups")
    n, c = x.shape[:2]
    v = x.astype(np.float64).reshape(n, groups, -1)
    mean = v.mean(axis=2, keepdims=True)
    var = v.var(axis=2, keepdims=True)
    normalized = ((v - mean) / np.sqrt(var + node.attr("epsilon", 1e-5))).reshape(x.shape)
    per_channel = scale.shape[0] == c  # opset 21; opset 18 gives one value per group
    shape = (1, -1) + (1,) * (x.ndim - 2)
    if not per_channel:
        scale = np.repeat(scale, c // groups)
        bias = np.repeat(bias, c // groups)
    out = normalized * scale.reshape(shape) + bias.reshape(shape)
    return [out.astype(x.dtype)]


def _mean_variance_normalization(node, inputs):
    x = inputs[0]
    axes = tuple(node.attr("axes", (0, 2, 3)))
    v = x.astype(np.float64)
    mean = v.mean(axis=axes, keepdims=True)
    var = ((v - mean) ** 2).mean(axis=axes, keepdims=True)
    return [((v - mean) / np.sqrt(var + 1e-9)).astype(x.dtype)]


OPS: dict[str, OpDef] = {
    "LpNormalization": opdef("LpNormalization", OpKind.OPAQUE, same_as(0), _lp_normalization),
    "GroupNormalization": opdef(
        "GroupNormalization", OpKind.OPAQUE, same_as(0), _group_normalization
    ),
    "MeanVarianceNormalization": opdef(
        "MeanVarianceNormalization", OpKind.OPAQUE, same_as(0), _mean_variance_normalization
    ),
}
