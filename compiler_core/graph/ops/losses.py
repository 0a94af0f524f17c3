"""Loss operators (inference-time evaluation of a loss, as ONNX defines them)."""

from __future__ import annotations

import numpy as np

from compiler_core.graph.ir import OpKind
from compiler_core.graph.ops.base import OpDef, evaluated, opdef


def negative_log_likelihood(node, log_prob, target, weight):
    """ONNX NegativeLogLikelihoodLoss over (N, C, d1..dk) with integer targets (N, d1..dk)."""
    ignore = node.attr("ignore_index", None)
    classes = log_prob.shape[1]
    target = target.astype(np.int64)
    keep = np.ones(target.shape, bool) if ignore is None else target != ignore
    safe = np.where(keep, target, 0)
    picked = np.take_along_axis(log_prob, np.expand_dims(safe, 1), axis=1).squeeze(1)
    weights = np.ones(classes, log_prob.dtype) if weight is None else weight
    w = np.where(keep, weights[safe], 0).astype(np.float64)
    loss = -picked.astype(np.float64) * w
    reduction = node.attr("reduction", "mean")
    if reduction == "none":
        return loss.astype(log_prob.dtype)
    if reduction == "sum":
        return np.asarray(loss.sum(), log_prob.dtype)
    total = w.sum()
    return np.asarray(loss.sum() / total if total else 0.0, log_prob.dtype)


def _nll(node, inputs):
    weight = inputs[2] if len(inputs) > 2 else None
    return [negative_log_likelihood(node, inputs[0], inputs[1], weight)]


def _log_softmax_axis1(x: np.ndarray) -> np.ndarray:
    v = x.astype(np.float64)
    shifted = v - v.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def _softmax_cross_entropy(node, inputs):
    scores, labels = inputs[0], inputs[1]
    weight = inputs[2] if len(inputs) > 2 else None
    log_prob = _log_softmax_axis1(scores)
    loss = negative_log_likelihood(node, log_prob, labels, weight)
    return [np.asarray(loss).astype(scores.dtype), log_prob.astype(scores.dtype)]


OPS: dict[str, OpDef] = {
    "NegativeLogLikelihoodLoss": opdef(
        "NegativeLogLikelihoodLoss", OpKind.OPAQUE, evaluated(_nll), _nll
    ),
    "SoftmaxCrossEntropyLoss": opdef(
        "SoftmaxCrossEntropyLoss",
        OpKind.OPAQUE,
        evaluated(_softmax_cross_entropy),
        _softmax_cross_entropy,
    ),
}
