"""Loss operators as tensor expressions: NegativeLogLikelihoodLoss and
SoftmaxCrossEntropyLoss (a log-softmax over the class axis, then the same NLL)."""

from __future__ import annotations

from compiler_core.graph.ir import Node
from compiler_core.kernels.base import Builder, KernelContext
from compiler_core.kernels.injective import clamp
from compiler_core.loop.ir import INDEX, Binary, Cast, Const, Select, Unary
from compiler_core.te import Tensor, compute, reduce_axis, reduce_max, reduce_sum


def _log_softmax_classes(ctx: KernelContext, node: Node, x: Tensor) -> Tensor:
    reduced = (x.shape[0], 1, *x.shape[2:])
    k = reduce_axis(x.shape[1], "rc")

    def over(i, j):
        return (i[0], j, *i[2:])

    def first(i):
        return (i[0], Const(0, INDEX), *i[2:])

    peak = compute(reduced, lambda *i: reduce_max(x[over(i, k)], k), ctx.stage_name(node))
    k2 = reduce_axis(x.shape[1], "rc")
    total = compute(
        reduced,
        lambda *i: reduce_sum(Unary("exp", x[over(i, k2)] - peak[i]), k2),
        ctx.stage_name(node),
    )
    return compute(
        x.shape,
        lambda *i: x[i] - peak[first(i)] - Unary("log", total[first(i)]),
        ctx.stage_name(node),
    )


def _nll(ctx: KernelContext, node: Node, log_prob: Tensor, target_value: str, weight_value):
    target = ctx.tensor(target_value)
    weight = ctx.tensor(weight_value) if weight_value else None
    classes = log_prob.shape[1]
    ignore = node.attr("ignore_index", None)
    dtype = log_prob.dtype
    element_shape = target.shape

    def klass(i):
        return Cast(INDEX, target[i])

    def kept(i):
        return None if ignore is None else Binary("ne", klass(i), Const(ignore, INDEX))

    def weight_at(i):
        w = weight[(clamp(klass(i), classes),)] if weight is not None else Const(1.0, dtype)
        keep = kept(i)
        return w if keep is None else Select(keep, w, Const(0.0, dtype))

    def loss_at(*i):
        picked = log_prob[(i[0], clamp(klass(i), classes), *i[1:])]
        return Unary("neg", picked) * weight_at(i)

    losses = compute(element_shape, loss_at, ctx.stage_name(node))
    reduction = node.attr("reduction", "mean")
    if reduction == "none":
        return losses
    axes = [reduce_axis(d, f"r{k}") for k, d in enumerate(element_shape)]
    total = compute((), lambda: reduce_sum(losses[tuple(axes)], axes), ctx.stage_name(node))
    if reduction == "sum":
        return total
    axes2 = [reduce_axis(d, f"r{k}") for k, d in enumerate(element_shape)]
    weights = compute((), lambda: reduce_sum(weight_at(tuple(axes2)), axes2), ctx.stage_name(node))
    return compute(
        (),
        lambda: Select(weights[()] > Const(0.0, dtype), total[()] / weights[()], Const(0.0, dtype)),
        ctx.stage_name(node),
    )


def _nll_builder(ctx: KernelContext, node: Node):
    weight = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2] else None
    return [_nll(ctx, node, ctx.tensor(node.inputs[0]), node.inputs[1], weight)]


def _softmax_cross_entropy(ctx: KernelContext, node: Node):
    log_prob = _log_softmax_classes(ctx, node, ctx.tensor(node.inputs[0]))
    weight = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2] else None
    loss = _nll(ctx, node, log_prob, node.inputs[1], weight)
    return [t for t, value in zip((loss, log_prob), node.outputs, strict=False) if value]


KERNELS: dict[str, Builder] = {
    "NegativeLogLikelihoodLoss": _nll_builder,
    "SoftmaxCrossEntropyLoss": _softmax_cross_entropy,
}
