"""Reductions, the softmax family and normalizations, as multi-stage tensor expressions."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable

import numpy as np

from compiler_core.graph.ir import Node
from compiler_core.graph.ops.reduce import reduce_axes
from compiler_core.kernels.base import Builder, KernelContext, KernelError
from compiler_core.loop.ir import (
    INDEX,
    Binary,
    Cast,
    Const,
    Expr,
    Select,
    Unary,
    logical_and,
    maximum,
    minimum,
)
from compiler_core.te import (
    Tensor,
    compute,
    reduce_axis,
    reduce_max,
    reduce_min,
    reduce_prod,
    reduce_sum,
)


def _reduction(ctx: KernelContext, node: Node, x_value: str, combiner, transform=None):
    """Reduce `x` over the node's axes: returns (tensor, count of reduced elements)."""
    x = ctx.tensor(x_value)
    axes = reduce_axes(node, len(x.shape))
    count = math.prod(x.shape[a] for a in axes)
    rows = _trailing_rows(ctx, x_value, x, axes)
    kind = COMBINER_KINDS.get(combiner)
    if rows is not None and kind is not None:
        out = ctx.type(node.outputs[0])
        rank = len(rows.shape)

        def term(r, k):
            return transform(rows.at(r, k)) if transform else rows.at(r, k)

        def row_of(i):  # the output index's row part (keepdims leaves ones after it)
            return i[:rank]

        return row_reduce(ctx, node, out.shape, row_of, rows, kind, term), count
    return _reduction_of(ctx, node, x, combiner, transform), count


# --- row reductions: vector partial results over a contiguous trailing extent ----------------


@dataclasses.dataclass(frozen=True)
class Rows:
    """`x` read as rows of `n` contiguous elements: `at(r, k)` is element k of row r."""

    shape: tuple[int, ...]  # the row dimensions
    n: int
    at: Callable[[tuple, Expr], Expr]


def _trailing_rows(ctx: KernelContext, value: str, x, axes, short: bool = False) -> Rows | None:
    """`x` as rows when `axes` are its trailing axes, the element type has vector lanes, and
    a row's elements are contiguous in the indices the kernel reads them at: one trailing
    axis, or several of a kernel input (read through a view as one flat axis). Rows shorter
    than a vector only with `short` (see `_short_row_reduce`)."""
    rank = len(x.shape)
    first = rank - len(axes)
    if list(axes) != list(range(first, rank)) or x.dtype != "float32":
        return None
    if ctx.target.is_gpu:  # lane partials are a CPU vector-register decision
        return None
    rows, n = tuple(x.shape[:first]), math.prod(x.shape[first:])
    if n < ctx.target.vector_lanes and not short:
        return None
    if len(axes) == 1:
        return Rows(rows, n, lambda r, k: x[(*r, k)])
    if not x.is_placeholder:  # computed in this kernel: a flat index would not stay affine
        return None
    flat = ctx.reshaped(value, (*rows, n))
    return Rows(rows, n, lambda r, k: flat[(*r, k)])


@dataclasses.dataclass(frozen=True)
class CombinerKind:
    reduce: Callable
    pair: Callable[[Expr, Expr], Expr]
    idempotent: bool  # an element counted twice changes nothing (max, min)


COMBINER_KINDS = {
    reduce_sum: CombinerKind(reduce_sum, lambda a, b: a + b, False),
    reduce_max: CombinerKind(reduce_max, maximum, True),
    reduce_min: CombinerKind(reduce_min, minimum, True),
}


def row_reduce(ctx, node, shape, row_of, rows: Rows, kind: CombinerKind, term) -> Tensor:
    """`kind` over each row of term(r, k), k < rows.n, as a tensor of `shape` (row_of maps its
    index to the row). Two stages: a partial result per vector lane over the row's whole
    vectors (its schedule keeps the lanes in one register: `row_partial`), then the lanes
    folded together with the remainder, read as the row's last vector (ending at n) with the
    lanes the whole vectors already covered masked out (for sum; max and min take them
    twice)."""
    lanes = ctx.target.vector_lanes
    whole, rest = divmod(rows.n, lanes)
    if not whole:
        return _short_row_reduce(ctx, node, shape, row_of, rows, kind, term)
    ko = reduce_axis(whole, "rv")
    partial = compute(
        (*rows.shape, lanes),
        lambda *i: kind.reduce(term(i[:-1], ko * Const(lanes, INDEX) + i[-1]), ko),
        ctx.stage_name(node, "vec"),
    )
    ctx.note(partial.name, row_partial=True)
    lane = reduce_axis(lanes, "rl")

    def fold(*i):
        r = tuple(row_of(i))
        value = partial[(*r, lane)]
        if rest:
            last = term(r, Const(rows.n - lanes, INDEX) + lane)
            if not kind.idempotent:
                last = Select(lane >= Const(lanes - rest, INDEX), last, Const(0, last.dtype))
            value = kind.pair(value, last)
        return kind.reduce(value, lane)

    folded = compute(shape, fold, ctx.stage_name(node))
    ctx.note(folded.name, partial=partial.name, rows=len(rows.shape))
    return folded


def _short_row_reduce(ctx, node, shape, row_of, rows: Rows, kind: CombinerKind, term) -> Tensor:
    """`row_reduce` over rows shorter than a vector: one scalar reduction per row, with no
    lane partials. Its rows still fuse with the kernel's other row stages (one parallel loop
    over rows, each row's statistics computed where the row is read: `row_schedule`), where
    the plain reduction would take a parallel loop of its own for every stage (a softmax over
    64 rows of 10 classes ran three, 6.6 us where the work is a few hundred cycles)."""
    k = reduce_axis(rows.n, "r")
    folded = compute(
        shape, lambda *i: kind.reduce(term(tuple(row_of(i)), k), k), ctx.stage_name(node)
    )
    ctx.note(folded.name, rows=len(rows.shape), short_row=True)
    return folded


def _simple(combiner, transform=None, finish=None) -> Builder:
    def build(ctx: KernelContext, node: Node):
        total, count = _reduction(ctx, node, node.inputs[0], combiner, transform)
        out = total
        if finish is not None:
            out = compute(total.shape, lambda *i: finish(total[i], count), ctx.stage_name(node))
        rows = ctx.notes.get(total.name, {}).get("rows")
        if rows is not None:  # a row reduction: one parallel loop over rows does every stage
            note_row_stages(ctx, out, rows, [total] if out is not total else [])
        return [out]

    return build


def _mean(value: Expr, count: int) -> Expr:
    return value / Const(float(count), value.dtype)


def _log_sum_exp(ctx: KernelContext, node: Node):
    """log(sum(exp(x - max))) + max: stable for large inputs."""
    peak, _ = _reduction(ctx, node, node.inputs[0], reduce_max)
    x = ctx.tensor(node.inputs[0])
    axes = reduce_axes(node, len(x.shape))
    keep = node.attr("keepdims", 1)

    def peak_at(index):
        if keep:
            return peak[tuple(Const(0, "int64") if k in axes else v for k, v in enumerate(index))]
        return peak[tuple(v for k, v in enumerate(index) if k not in axes)]

    shifted = compute(x.shape, lambda *i: Unary("exp", x[i] - peak_at(i)), ctx.stage_name(node))
    total = _reduction_of(ctx, node, shifted, reduce_sum)
    return [compute(total.shape, lambda *i: Unary("log", total[i]) + peak[i], ctx.stage_name(node))]


def _reduction_of(ctx: KernelContext, node: Node, x, combiner, transform=None):
    """Reduce tensor `x` over the node's axes (keepdims as the node says)."""
    axes = reduce_axes(node, len(x.shape))
    keep = node.attr("keepdims", 1)
    out = ctx.type(node.outputs[0])
    raxes = [reduce_axis(x.shape[a], f"r{a}") for a in axes]

    def body(*i):
        index, position = [], 0
        for k in range(len(x.shape)):
            if k in axes:
                index.append(raxes[axes.index(k)])
                position += 1 if keep else 0
            else:
                index.append(i[position])
                position += 1
        value = x[tuple(index)]
        return combiner(transform(value) if transform else value, raxes)

    reduced = compute(out.shape, body, ctx.stage_name(node), out.dtype)
    _note_vector_inner(ctx, reduced, x, axes)
    return reduced


def _note_vector_inner(ctx: KernelContext, stage: Tensor, x: Tensor, axes) -> None:
    """A reduction that keeps x's last (contiguous) axis: its schedule vectorizes along it."""
    if len(x.shape) - 1 not in axes and x.dtype == "float32" and len(stage.shape) > 0:
        ctx.note(stage.name, vector_inner=True)


def _arg(kind: str) -> Builder:
    """ArgMax/ArgMin: the extreme value first, then the first (or last) index that has it."""

    def build(ctx: KernelContext, node: Node):
        x = ctx.tensor(node.inputs[0])
        rank = len(x.shape)
        axis = node.attr("axis", 0) % rank
        keep = node.attr("keepdims", 1)
        out = ctx.type(node.outputs[0])
        k1 = reduce_axis(x.shape[axis], "r")

        def along(i, k):
            spatial = list(i)
            if not keep:
                spatial.insert(axis, None)
            spatial[axis] = k
            return tuple(spatial)

        combiner = reduce_max if kind == "max" else reduce_min
        extreme = compute(out.shape, lambda *i: combiner(x[along(i, k1)], k1), ctx.stage_name(node))
        k2 = reduce_axis(x.shape[axis], "r")
        last = node.attr("select_last_index", 0)
        missing = Const(-1 if last else x.shape[axis], INDEX)

        def position(*i):
            hit = x[along(i, k2)].equals(extreme[i])
            index = Cast(INDEX, k2)
            pick = reduce_max if last else reduce_min
            return pick(Select(hit, index, missing), k2)

        return [compute(out.shape, position, ctx.stage_name(node), "int64")]

    return build


KERNELS_REDUCE: dict[str, Builder] = {
    "ReduceProd": _simple(reduce_prod),
    "ReduceLogSum": _simple(reduce_sum, finish=lambda v, n: Unary("log", v)),
    "ReduceLogSumExp": _log_sum_exp,
    "ArgMax": _arg("max"),
    "ArgMin": _arg("min"),
    "ReduceSum": _simple(reduce_sum),
    "ReduceMean": _simple(reduce_sum, finish=_mean),
    "ReduceMax": _simple(reduce_max),
    "ReduceMin": _simple(reduce_min),
    "ReduceSumSquare": _simple(reduce_sum, transform=lambda v: v * v),
    "ReduceL1": _simple(reduce_sum, transform=lambda v: Unary("abs", v)),
    "ReduceL2": _simple(
        reduce_sum, transform=lambda v: v * v, finish=lambda v, n: Unary("sqrt", v)
    ),
}


def note_row_stages(ctx: KernelContext, out: Tensor, rows: int, stats: list[Tensor]) -> None:
    """Tell the `row_reduction` schedule that `out`'s first `rows` loops walk rows, and which
    stages (in order) it may compute one row at a time inside them: each row_reduce's partial
    and fold (`row_folds`), and pure row stages (`row_pure`: one row of values read twice).
    `out` may be a row_reduce fold itself."""
    names, partials, pure, folds = [], [], [], []
    for t in [*stats, out]:
        notes = ctx.notes.get(t.name, {})
        partial = notes.get("partial")
        names += [partial] if partial else []
        partials += [partial] if partial else []
        folds += [t.name] if partial else []
        if t is not out:
            names.append(t.name)
            pure += [] if partial or notes.get("short_row") else [t.name]
    ctx.note(
        out.name,
        row_stages=tuple(names),
        row_partials=tuple(partials),
        row_pure=tuple(pure),
        row_folds=tuple(folds),
        rows=rows,
    )


def _softmax_rows(ctx: KernelContext, node: Node, log: bool):
    """Softmax over contiguous rows: the row's max and its sum of exp(x - max) from vector
    partial results, then one vector pass writing the output, row by row."""
    x = ctx.tensor(node.inputs[0])
    rows = _trailing_rows(ctx, node.inputs[0], x, [len(x.shape) - 1], short=True)
    if rows is None:
        return None
    rank = len(rows.shape)
    peak = row_reduce(ctx, node, rows.shape, tuple, rows, COMBINER_KINDS[reduce_max], rows.at)
    empty_rows = not log and node.attr("zero_empty_rows", 0)

    def shift(r):
        # A row of -inf alone shifts by 0 instead: exp(-inf) = 0 everywhere, a zero total.
        return _finite_or_zero(peak[r], x.dtype) if empty_rows else peak[r]

    # exp(x - max) once per element: kept (one row at a time) for the sum and the output
    shifted = compute(
        x.shape, lambda *i: Unary("exp", x[i] - shift(i[:rank])), ctx.stage_name(node)
    )
    ctx.note(shifted.name, materialize=True)

    def exp_shifted(r, k):
        return shifted[(*r, k)]

    total = row_reduce(ctx, node, rows.shape, tuple, rows, COMBINER_KINDS[reduce_sum], exp_shifted)

    def body(*i):
        r = i[:rank]
        if log:
            return x[i] - peak[r] - Unary("log", total[r])
        # times the reciprocal: one division per row, hoisted out of the row's loop
        if empty_rows:  # no allowed key: zero probabilities (Attention's convention)
            zero = Const(0.0, x.dtype)
            inverse = Select(total[r] > zero, Const(1.0, x.dtype) / total[r], zero)
            return shifted[i] * inverse
        return shifted[i] * (Const(1.0, x.dtype) / total[r])

    out = compute(x.shape, body, ctx.stage_name(node))
    note_row_stages(ctx, out, rank, [peak, shifted, total])
    return [out]


def _finite_or_zero(value, dtype: str):
    """`value`, or 0 where it is -inf (the max of a row with no allowed entry)."""
    return Select(value > Const(-np.inf, dtype), value, Const(0.0, dtype))


def _softmax(log: bool) -> Builder:
    def build(ctx: KernelContext, node: Node):
        x = ctx.tensor(node.inputs[0])
        rank = len(x.shape)
        axis = node.attr("axis", -1) % rank
        if axis == rank - 1:
            fast = _softmax_rows(ctx, node, log)
            if fast is not None:
                return fast
        k = reduce_axis(x.shape[axis], "r")

        def along(i, j):
            return tuple(j if d == axis else i[d] for d in range(rank))

        def keep(i):
            return tuple(Const(0, "int64") if d == axis else i[d] for d in range(rank))

        reduced_shape = tuple(1 if d == axis else s for d, s in enumerate(x.shape))
        peak = compute(
            reduced_shape, lambda *i: reduce_max(x[along(i, k)], k), ctx.stage_name(node)
        )
        k2 = reduce_axis(x.shape[axis], "r")
        total = compute(
            reduced_shape,
            lambda *i: reduce_sum(Unary("exp", x[along(i, k2)] - peak[i]), k2),
            ctx.stage_name(node),
        )
        _note_vector_inner(ctx, peak, x, [axis])
        _note_vector_inner(ctx, total, x, [axis])

        def body(*i):
            if log:
                return x[i] - peak[keep(i)] - Unary("log", total[keep(i)])
            if node.attr("zero_empty_rows", 0):  # see _softmax_rows
                shifted = Unary("exp", x[i] - _finite_or_zero(peak[keep(i)], x.dtype))
                zero = Const(0.0, x.dtype)
                return Select(total[keep(i)] > zero, shifted / total[keep(i)], zero)
            return Unary("exp", x[i] - peak[keep(i)]) / total[keep(i)]

        return [compute(x.shape, body, ctx.stage_name(node))]

    return build


def _layer_norm_rows(ctx: KernelContext, node: Node):
    """Layer norm over contiguous rows: the row's mean, then its centered sum of squares (two
    vector passes over a row still in L1), then one vector pass normalizing it."""
    x = ctx.tensor(node.inputs[0])
    rank = len(x.shape)
    axis = node.attr("axis", -1) % rank
    # Rows of half a vector stay plain passes, which LLVM vectorizes two rows a vector (4096
    # x 8 on Zen 5: 0.70-0.77x the short rows' time); other short rows run as rows (4096 x 12
    # 0.35x the plain passes' time, 16384 x 10 0.28x, 256 x 12 0.59x).
    short = 2 * math.prod(x.shape[axis:]) != ctx.target.vector_lanes
    rows = _trailing_rows(ctx, node.inputs[0], x, list(range(axis, rank)), short=short)
    if rows is None or axis == 0 or len(node.outputs) > 1 and any(node.outputs[1:]):
        return None
    inverse_count = Const(1.0 / rows.n, x.dtype)
    eps = Const(node.attr("epsilon", 1e-5), x.dtype)
    total = row_reduce(ctx, node, rows.shape, tuple, rows, COMBINER_KINDS[reduce_sum], rows.at)

    def centered_square(r, k):
        d = rows.at(r, k) - total[r] * inverse_count
        return d * d

    squares = row_reduce(
        ctx, node, rows.shape, tuple, rows, COMBINER_KINDS[reduce_sum], centered_square
    )
    scale = ctx.tensor(node.inputs[1])
    bias = ctx.tensor(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None

    def body(*i):
        outer, rest = i[:axis], i[axis:]
        mean = total[outer] * inverse_count
        # times 1/std: one division and root per row, hoisted out of the row's loop
        inverse_std = Const(1.0, x.dtype) / Unary("sqrt", squares[outer] * inverse_count + eps)
        scaled = (x[i] - mean) * inverse_std * scale[_param_index(scale, rest)]
        return scaled + bias[_param_index(bias, rest)] if bias is not None else scaled

    out = compute(x.shape, body, ctx.stage_name(node))
    note_row_stages(ctx, out, axis, [total, squares])
    return [out]


def _layer_norm(ctx: KernelContext, node: Node):
    fast = _layer_norm_rows(ctx, node)
    if fast is not None:
        return fast
    x = ctx.tensor(node.inputs[0])
    rank = len(x.shape)
    axis = node.attr("axis", -1) % rank
    inner = x.shape[axis:]
    count = math.prod(inner)
    eps = node.attr("epsilon", 1e-5)
    stat_shape = x.shape[:axis]

    def over(i, ks):
        return tuple(i) + tuple(ks)

    inverse_count = Const(1.0 / count, x.dtype)
    ks = [reduce_axis(d, f"r{j}") for j, d in enumerate(inner)]
    total = compute(stat_shape, lambda *i: reduce_sum(x[over(i, ks)], ks), ctx.stage_name(node))
    ks2 = [reduce_axis(d, f"r{j}") for j, d in enumerate(inner)]

    def centered_square(i):
        d = x[over(i, ks2)] - total[tuple(i)] * inverse_count
        return d * d

    squares = compute(
        stat_shape, lambda *i: reduce_sum(centered_square(i), ks2), ctx.stage_name(node)
    )
    scale = ctx.tensor(node.inputs[1])
    bias = ctx.tensor(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None

    def body(*i):
        outer, rest = i[:axis], i[axis:]
        mean, variance = total[outer] * inverse_count, squares[outer] * inverse_count
        normalized = (x[i] - mean) / Unary("sqrt", variance + Const(eps, x.dtype))
        scaled = normalized * scale[_param_index(scale, rest)]
        return scaled + bias[_param_index(bias, rest)] if bias is not None else scaled

    outputs = [compute(x.shape, body, ctx.stage_name(node))]
    stat_type = ctx.type(node.outputs[1]) if len(node.outputs) > 1 and node.outputs[1] else None
    if stat_type is not None or (len(node.outputs) > 2 and node.outputs[2]):
        # Saved statistics (for training graphs): the mean and 1/sqrt(var + eps), keepdims.
        shape = x.shape[:axis] + (1,) * (rank - axis)
        outputs.append(
            compute(shape, lambda *i: total[i[:axis]] * inverse_count, ctx.stage_name(node))
        )
        outputs.append(
            compute(
                shape,
                lambda *i: (
                    Const(1.0, x.dtype)
                    / Unary("sqrt", squares[i[:axis]] * inverse_count + Const(eps, x.dtype))
                ),
                ctx.stage_name(node),
            )
        )
    return [t for t, value in zip(outputs, node.outputs, strict=False) if value]


def _rms_norm(ctx: KernelContext, node: Node):
    x = ctx.tensor(node.inputs[0])
    scale = ctx.tensor(node.inputs[1])
    rank = len(x.shape)
    axis = node.attr("axis", -1) % rank
    inner = x.shape[axis:]
    inverse_count = Const(1.0 / math.prod(inner), x.dtype)
    ks = [reduce_axis(d, f"r{j}") for j, d in enumerate(inner)]

    def square(i):
        v = x[tuple(i) + tuple(ks)]
        return v * v

    squares = compute(x.shape[:axis], lambda *i: reduce_sum(square(i), ks), ctx.stage_name(node))

    def body(*i):
        rms = Unary(
            "sqrt", squares[i[:axis]] * inverse_count + Const(node.attr("epsilon", 1e-5), x.dtype)
        )
        return x[i] / rms * scale[_param_index(scale, i[axis:])]

    return [compute(x.shape, body, ctx.stage_name(node))]


def _hardmax(ctx: KernelContext, node: Node):
    """1 at the first maximum along the axis, 0 elsewhere."""
    x = ctx.tensor(node.inputs[0])
    rank = len(x.shape)
    axis = node.attr("axis", -1) % rank
    reduced = tuple(1 if d == axis else s for d, s in enumerate(x.shape))
    k = reduce_axis(x.shape[axis], "r")

    def along(i, j):
        return tuple(j if d == axis else i[d] for d in range(rank))

    peak = compute(reduced, lambda *i: reduce_max(x[along(i, k)], k), ctx.stage_name(node))
    k2 = reduce_axis(x.shape[axis], "r")

    def first(*i):
        hit = x[along(i, k2)].equals(peak[i])
        return reduce_min(Select(hit, Cast(INDEX, k2), Const(x.shape[axis], INDEX)), k2)

    position = compute(reduced, first, ctx.stage_name(node), "int64")

    def body(*i):
        keep = tuple(Const(0, INDEX) if d == axis else i[d] for d in range(rank))
        return Select(position[keep].equals(i[axis]), Const(1, x.dtype), Const(0, x.dtype))

    return [compute(x.shape, body, ctx.stage_name(node))]


def _param_index(param, rest):
    """Scale and bias broadcast against the normalized axes (their rank may be smaller)."""
    offset = len(rest) - len(param.shape)
    return tuple(
        Const(0, "int64") if dim == 1 else rest[offset + k] for k, dim in enumerate(param.shape)
    )


KERNELS: dict[str, Builder] = {
    **KERNELS_REDUCE,
    "Softmax": _softmax(log=False),
    "LogSoftmax": _softmax(log=True),
    "LayerNormalization": _layer_norm,
    "RMSNormalization": _rms_norm,
    "Hardmax": _hardmax,
}


def _scan(kind: str) -> Builder:
    """CumSum/CumProd: each output sums (multiplies) the inputs up to its position; written as
    a masked reduction along the axis."""

    def build(ctx: KernelContext, node: Node):
        x = ctx.tensor(node.inputs[0])
        axis = node.attr("axis") % len(x.shape)
        exclusive, reverse = node.attr("exclusive", 0), node.attr("reverse", 0)
        k = reduce_axis(x.shape[axis], "rs")
        identity = Const(0 if kind == "sum" else 1, x.dtype)
        combiner = reduce_sum if kind == "sum" else reduce_prod

        def body(*i):
            position = i[axis]
            if reverse:
                take = k > position if exclusive else k >= position
            else:
                take = k < position if exclusive else k <= position
            source = tuple(k if d == axis else v for d, v in enumerate(i))
            return combiner(Select(take, x[source], identity), k)

        return [compute(x.shape, body, ctx.stage_name(node))]

    return build


def _lp_normalization(ctx: KernelContext, node: Node):
    x = ctx.tensor(node.inputs[0])
    axis = node.attr("axis", -1) % len(x.shape)
    k = reduce_axis(x.shape[axis], "rn")
    reduced = tuple(1 if d == axis else s for d, s in enumerate(x.shape))

    def term(i):
        v = x[tuple(k if d == axis else i[d] for d in range(len(x.shape)))]
        return Unary("abs", v) if node.attr("p", 2) == 1 else v * v

    total = compute(reduced, lambda *i: reduce_sum(term(i), k), ctx.stage_name(node))

    def body(*i):
        at = tuple(Const(0, INDEX) if d == axis else v for d, v in enumerate(i))
        norm = total[at] if node.attr("p", 2) == 1 else Unary("sqrt", total[at])
        zero = Const(0.0, x.dtype)
        return Select(norm > zero, x[i] / norm, zero)

    return [compute(x.shape, body, ctx.stage_name(node))]


KERNELS.update(
    {
        "CumSum": _scan("sum"),
        "CumProd": _scan("prod"),
        "LpNormalization": _lp_normalization,
    }
)


def _top_k(ctx: KernelContext, node: Node):
    """Rank every element along the axis (how many come before it in the sorted order, ties
    to the lower index), then pick the element of each rank."""
    x = ctx.tensor(node.inputs[0])
    rank_axes = len(x.shape)
    axis = node.attr("axis", -1) % rank_axes
    length = x.shape[axis]
    k_out = node.attr("k")
    largest = node.attr("largest", 1)
    other = reduce_axis(length, "ro")

    def along(i, j):
        return tuple(j if d == axis else i[d] for d in range(rank_axes))

    def rank_of(*i):
        mine, theirs = x[i], x[along(i, other)]
        better = theirs > mine if largest else theirs < mine
        tie = logical_and(theirs.equals(mine), other < i[axis])
        before = Binary("or", better, tie)
        return reduce_sum(Select(before, Const(1, INDEX), Const(0, INDEX)), other)

    ranks = compute(x.shape, rank_of, ctx.stage_name(node), "int64")
    out_shape = tuple(k_out if d == axis else s for d, s in enumerate(x.shape))

    def pick(value_of, dtype):
        r = reduce_axis(length, "rp")

        def body(*i):
            hit = ranks[along(i, r)].equals(i[axis])
            return reduce_sum(Select(hit, value_of(i, r), Const(0, dtype)), r)

        return compute(out_shape, body, ctx.stage_name(node), dtype)

    values = pick(lambda i, r: x[along(i, r)], x.dtype)
    indices = pick(lambda i, r: Cast(INDEX, r), "int64")
    return [t for t, value in zip((values, indices), node.outputs, strict=False) if value]


KERNELS["TopK"] = _top_k


def _instance_norm(ctx: KernelContext, node: Node):
    """Per (batch, channel): normalize over the spatial axes, then scale and shift. Each
    channel's spatial elements are a contiguous row: its sum and centered sum of squares are
    vector row reductions (`row_reduce`), as a layer norm's are; as scalar loops they ran
    wav2vec2's first extractor norm (512 rows of 3199) at 2.3 ms against ONNX Runtime's 1.7."""
    x, scale, bias = (ctx.tensor(v) for v in node.inputs)
    spatial = x.shape[2:]
    inverse_count = Const(1.0 / math.prod(spatial), x.dtype)
    eps = Const(node.attr("epsilon", 1e-5), x.dtype)
    rows = _trailing_rows(ctx, node.inputs[0], x, list(range(2, len(x.shape))))
    if rows is None:
        total, squares = _instance_norm_scalar_stats(ctx, node, x, inverse_count)
    else:
        sums = COMBINER_KINDS[reduce_sum]
        total = row_reduce(ctx, node, rows.shape, tuple, rows, sums, rows.at)

        def centered_square(r, k):
            d = rows.at(r, k) - total[r] * inverse_count
            return d * d

        squares = row_reduce(ctx, node, rows.shape, tuple, rows, sums, centered_square)

    def body(n, c, *s):
        mean = total[(n, c)] * inverse_count
        # times 1/std: one division and root per row, hoisted out of the row's loop
        inverse_std = Const(1.0, x.dtype) / Unary("sqrt", squares[(n, c)] * inverse_count + eps)
        return (x[(n, c, *s)] - mean) * inverse_std * scale[(c,)] + bias[(c,)]

    out = compute(x.shape, body, ctx.stage_name(node))
    if rows is not None:
        note_row_stages(ctx, out, 2, [total, squares])
    return [out]


def _instance_norm_scalar_stats(ctx: KernelContext, node: Node, x, inverse_count):
    """Each (batch, channel)'s sum and centered sum of squares as scalar reductions (rows
    the vector form cannot take: half precision, fewer elements than a vector, a GPU)."""
    spatial = x.shape[2:]
    ks = [reduce_axis(d, f"r{j}") for j, d in enumerate(spatial)]
    total = compute(x.shape[:2], lambda n, c: reduce_sum(x[(n, c, *ks)], ks), ctx.stage_name(node))
    ks2 = [reduce_axis(d, f"r{j}") for j, d in enumerate(spatial)]

    def centered_square(n, c):
        d = x[(n, c, *ks2)] - total[(n, c)] * inverse_count
        return reduce_sum(d * d, ks2)

    return total, compute(x.shape[:2], centered_square, ctx.stage_name(node))


KERNELS["InstanceNormalization"] = _instance_norm


def _group_norm(ctx: KernelContext, node: Node):
    x, scale, bias = (ctx.tensor(v) for v in node.inputs)
    groups = node.attr("num_groups")
    n, channels = x.shape[:2]
    spatial = x.shape[2:]
    per_group = channels // groups
    inverse_count = Const(1.0 / (per_group * math.prod(spatial)), x.dtype)
    eps = Const(node.attr("epsilon", 1e-5), x.dtype)

    def member(g, rc, rs):
        return x[(g[0], g[1] * Const(per_group, INDEX) + rc, *rs)]

    stats = _group_norm_stats(ctx, node, x, groups, inverse_count)
    if stats is not None:
        total, spread = stats
    else:
        total, spread = _group_norm_scalar_stats(ctx, node, x, groups, member, inverse_count)
    by_group = scale.shape[0] != channels  # opset 18: one scale and bias per group

    def body(b, c, *s):
        g = Binary("floordiv", c, Const(per_group, INDEX))
        mean = total[(b, g)] * inverse_count
        inverse_std = Const(1.0, x.dtype) / Unary("sqrt", spread[(b, g)] * inverse_count + eps)
        k = (g,) if by_group else (c,)
        return (x[(b, c, *s)] - mean) * inverse_std * scale[k] + bias[k]

    out = compute(x.shape, body, ctx.stage_name(node))
    if stats is not None and spatial:
        # rows are (batch, group): out's channel loop walks them in blocks of per_group
        note_row_stages(ctx, out, 2, [total, spread])
        ctx.note(out.name, row_split=(1, per_group))
    return [out]


def _group_norm_stats(ctx: KernelContext, node: Node, x, groups: int, inverse_count):
    """Each group's sum and centered sum of squares as row reductions over the group's
    contiguous channels x spatial elements (x read as [n, groups, elements])."""
    n = x.shape[0]
    length = math.prod(x.shape[1:]) // groups
    if x.dtype != "float32" or length < ctx.target.vector_lanes:
        return None
    flat = ctx.reshaped(node.inputs[0], (n, groups, length))
    rows = Rows((n, groups), length, lambda r, k: flat[(*r, k)])
    total = row_reduce(ctx, node, rows.shape, tuple, rows, COMBINER_KINDS[reduce_sum], rows.at)

    def centered_square(r, k):
        d = rows.at(r, k) - total[r] * inverse_count
        return d * d

    kind = COMBINER_KINDS[reduce_sum]
    return total, row_reduce(ctx, node, rows.shape, tuple, rows, kind, centered_square)


def _group_norm_scalar_stats(ctx, node, x, groups, member, inverse_count):
    n = x.shape[0]
    per_group = x.shape[1] // groups
    spatial = x.shape[2:]
    rc = reduce_axis(per_group, "rc")
    rs = [reduce_axis(d, f"r{j}") for j, d in enumerate(spatial)]
    total = compute(
        (n, groups),
        lambda b, g: reduce_sum(member((b, g), rc, rs), [rc, *rs]),
        ctx.stage_name(node),
    )
    rc2 = reduce_axis(per_group, "rc")
    rs2 = [reduce_axis(d, f"r{j}") for j, d in enumerate(spatial)]

    def squares(b, g):
        d = member((b, g), rc2, rs2) - total[(b, g)] * inverse_count
        return reduce_sum(d * d, [rc2, *rs2])

    return total, compute((n, groups), squares, ctx.stage_name(node))


KERNELS["GroupNormalization"] = _group_norm


def _mean_variance_normalization(ctx: KernelContext, node: Node):
    """(x - mean) / sqrt(var + 1e-9) over `axes` (default N, H, W), in float64 like the
    reference, cast back at the end."""
    x = ctx.tensor(node.inputs[0])
    rank = len(x.shape)
    axes = sorted(a % rank for a in node.attr("axes", (0, 2, 3)))
    kept = [k for k in range(rank) if k not in axes]
    kept_shape = tuple(x.shape[k] for k in kept)
    inverse_count = Const(1.0 / math.prod(x.shape[a] for a in axes), "float64")

    def value(kept_index, reduced):
        parts = dict(zip(kept, kept_index, strict=True)) | dict(zip(axes, reduced, strict=True))
        return Cast("float64", x[tuple(parts[k] for k in range(rank))])

    def sum_body(*i):
        ks = [reduce_axis(x.shape[a], f"r{a}") for a in axes]
        return reduce_sum(value(i, ks), ks)

    total = compute(kept_shape, sum_body, ctx.stage_name(node))

    def squares_body(*i):
        ks = [reduce_axis(x.shape[a], f"r{a}") for a in axes]
        d = value(i, ks) - total[i] * inverse_count
        return reduce_sum(d * d, ks)

    squares = compute(kept_shape, squares_body, ctx.stage_name(node))

    def body(*i):
        k = tuple(i[a] for a in kept)
        std = Unary("sqrt", squares[k] * inverse_count + Const(1e-9, "float64"))
        return Cast(x.dtype, (Cast("float64", x[i]) - total[k] * inverse_count) / std)

    return [compute(x.shape, body, ctx.stage_name(node), x.dtype)]


KERNELS["MeanVarianceNormalization"] = _mean_variance_normalization


MAX_DET_ORDER = 4  # Leibniz's formula: n! products of n entries


def _det(ctx: KernelContext, node: Node):
    """Determinants of small matrices (n <= 4) by Leibniz's formula, summed in float64."""
    x = ctx.tensor(node.inputs[0])
    n = x.shape[-1]
    if n > MAX_DET_ORDER:
        raise KernelError(f"node {node.name!r}: Det of {n}x{n} matrices has no native kernel")
    out = ctx.type(node.outputs[0])

    def body(*batch):
        total = Const(0.0, "float64")
        for perm in itertools.permutations(range(n)):
            product = Const(float(_permutation_sign(perm)), "float64")
            for row, column in enumerate(perm):
                entry = x[(*batch, Const(row, INDEX), Const(column, INDEX))]
                product = product * Cast("float64", entry)
            total = total + product
        return Cast(out.dtype, total)

    return [compute(out.shape, body, ctx.stage_name(node), out.dtype)]


def _permutation_sign(perm) -> int:
    inversions = sum(a > b for a, b in itertools.combinations(perm, 2))
    return -1 if inversions % 2 else 1


KERNELS["Det"] = _det
