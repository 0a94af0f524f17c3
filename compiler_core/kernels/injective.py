"""Data-movement operators as index mappings."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from compiler_core.graph.ir import Node
from compiler_core.graph.ops.image import axis_weights
from compiler_core.graph.ops.layout import plain_shape, transform_blocks
from compiler_core.graph.ops.tensor import slice_objects
from compiler_core.kernels.base import Builder, KernelContext, KernelError, broadcast_index
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
from compiler_core.te import compute, reduce_axis, reduce_max, reduce_min, reduce_prod, reduce_sum


def clamp(index: Expr, size: int) -> Expr:
    """Keep an index in bounds: both sides of a select are evaluated (and loaded)."""
    return Binary("max", Binary("min", index, Const(size - 1, INDEX)), Const(0, INDEX))


def padded_row(i: Expr, rows: int, padded_rows: int) -> Expr:
    """Row `i` of a matrix of `rows` rows read by a loop over `padded_rows` (a partial last
    register tile): the rows past the real ones read the last one, so every read stays in
    bounds; what they compute is cropped."""
    return Binary("min", i, Const(rows - 1, INDEX)) if padded_rows != rows else i


def _strides(shape: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return list(reversed(strides))


def unflatten(flat: Expr, shape: Sequence[int]) -> tuple[Expr, ...]:
    """The row-major index over `shape` of the flat position `flat`."""
    index = []
    for dim, stride in zip(shape, _strides(shape), strict=True):
        q = Binary("floordiv", flat, Const(stride, INDEX)) if stride != 1 else flat
        index.append(Binary("mod", q, Const(dim, INDEX)) if dim != 1 else Const(0, INDEX))
    return tuple(index)


def flatten(index: Sequence[Expr], shape: Sequence[int]) -> Expr:
    flat: Expr = Const(0, INDEX)
    for i, stride in zip(index, _strides(shape), strict=True):
        flat = flat + i * Const(stride, INDEX)
    return flat


def reshape_index(index: Sequence[Expr], out_shape, in_shape) -> tuple[Expr, ...]:
    """The input index of a reshape's output `index`. Leading and trailing dimensions the two
    shapes share map straight through; only the part between them goes through a flat index.
    A channel shuffle's [1, 116, 28, 28] -> [1, 2, 58, 28, 28] then reads its rows at (n, c1 *
    58 + c2, h, w), not through a division and a modulo by 784 per element, and the row stays
    a unit-stride loop the vectorizer takes."""
    out_shape, in_shape = tuple(out_shape), tuple(in_shape)
    lead = 0
    while lead < min(len(out_shape), len(in_shape)) and out_shape[lead] == in_shape[lead]:
        lead += 1
    tail = 0
    while (
        tail < min(len(out_shape), len(in_shape)) - lead
        and out_shape[len(out_shape) - 1 - tail] == in_shape[len(in_shape) - 1 - tail]
    ):
        tail += 1
    out_mid = out_shape[lead : len(out_shape) - tail]
    in_mid = in_shape[lead : len(in_shape) - tail]
    middle = tuple(index[lead : len(index) - tail])
    if len(in_mid) == 1:  # the flat index is in bounds: no modulo
        mapped: tuple[Expr, ...] = (flatten(middle, out_mid),)
    elif len(out_mid) == 1:
        mapped = unflatten(middle[0], in_mid)
    else:
        mapped = unflatten(flatten(middle, out_mid), in_mid)
    return (*index[:lead], *mapped, *index[len(index) - tail :])


def _reshape(ctx: KernelContext, node: Node):
    out = ctx.type(node.outputs[0])
    x = ctx.tensor(node.inputs[0])
    return [
        compute(
            out.shape,
            lambda *i: x[reshape_index(i, out.shape, x.shape)],
            ctx.stage_name(node),
        )
    ]


def _transpose(ctx: KernelContext, node: Node):
    out = ctx.type(node.outputs[0])
    x = ctx.tensor(node.inputs[0])
    perm = node.attr("perm")

    def body(*i):
        source = [None] * len(perm)
        for out_axis, in_axis in enumerate(perm):
            source[in_axis] = i[out_axis]
        return x[tuple(source)]

    return [compute(out.shape, body, ctx.stage_name(node))]


def _concat(ctx: KernelContext, node: Node):
    out = ctx.type(node.outputs[0])
    axis = node.attr("axis") % out.rank
    parts = [(ctx.tensor(v), ctx.type(v).shape[axis]) for v in node.inputs]

    def body(*i):
        offsets, start = [], 0
        for _, size in parts:
            offsets.append(start)
            start += size
        # The last part is the default; earlier parts are selected by range, back to front.
        result = None
        for (tensor, _size), offset in reversed(list(zip(parts, offsets, strict=True))):
            index = list(i)
            index[axis] = clamp(i[axis] - Const(offset, INDEX), _size)
            value = tensor[tuple(index)]
            if result is None:
                result = value
            else:
                limit = Const(offset + _size, INDEX)
                result = Select(i[axis] < limit, value, result)
        return result

    return [compute(out.shape, body, ctx.stage_name(node))]


def _split(ctx: KernelContext, node: Node):
    x = ctx.tensor(node.inputs[0])
    axis = node.attr("axis") % len(x.shape)
    outputs, start = [], 0
    for value, size in zip(node.outputs, node.attr("sizes"), strict=True):
        shape = ctx.type(value).shape if value else None
        offset = start
        start += size
        if not value:
            continue

        def body(*i, offset=offset):
            index = list(i)
            index[axis] = i[axis] + Const(offset, INDEX)
            return x[tuple(index)]

        outputs.append(compute(shape, body, ctx.stage_name(node)))
    return outputs


def _slice(ctx: KernelContext, node: Node):
    out = ctx.type(node.outputs[0])
    x = ctx.tensor(node.inputs[0])
    slices = slice_objects(node, x.shape)

    def body(*i):
        index = []
        for k, s in enumerate(slices):
            start, _, step = s.indices(x.shape[k])
            index.append(i[k] * Const(step, INDEX) + Const(start, INDEX))
        return x[tuple(index)]

    return [compute(out.shape, body, ctx.stage_name(node))]


def _gather(ctx: KernelContext, node: Node):
    out = ctx.type(node.outputs[0])
    data = ctx.tensor(node.inputs[0])
    axis = node.attr("axis", 0) % len(data.shape)
    index_type = ctx.type(node.inputs[1])
    rank = index_type.rank
    if ctx.is_constant(node.inputs[1]) and index_type.size == 1:
        # A constant scalar index (the attention q/k/v select): no index buffer at all.
        value = int(ctx.constant(node.inputs[1]).reshape(-1)[0]) % data.shape[axis]

        def body(*i):
            index = i[:axis] + (Const(value, INDEX),) + i[axis + rank :]
            return data[index]

        return [compute(out.shape, body, ctx.stage_name(node))]
    indices = ctx.tensor(node.inputs[1])

    def gathered(*i):
        raw = Cast(INDEX, indices[i[axis : axis + rank]])
        wrapped = Select(raw < Const(0, INDEX), raw + Const(data.shape[axis], INDEX), raw)
        position = clamp(wrapped, data.shape[axis])
        return data[i[:axis] + (position,) + i[axis + rank :]]

    return [compute(out.shape, gathered, ctx.stage_name(node))]


def _expand(ctx: KernelContext, node: Node):
    out = ctx.type(node.outputs[0])
    x = ctx.tensor(node.inputs[0])
    return [
        compute(
            out.shape, lambda *i: x[broadcast_index(x.shape, out.shape, i)], ctx.stage_name(node)
        )
    ]


def _tile(ctx: KernelContext, node: Node):
    out = ctx.type(node.outputs[0])
    x = ctx.tensor(node.inputs[0])
    return [
        compute(
            out.shape,
            lambda *i: x[
                tuple(Binary("mod", v, Const(d, INDEX)) for v, d in zip(i, x.shape, strict=True))
            ],
            ctx.stage_name(node),
        )
    ]


def _pad_indexed(ctx, node, x, out, mode):
    """edge / reflect / wrap padding: every output position reads some input position."""
    pads = node.attr("pads")

    def source(v, k):
        size = x.shape[k]
        s = v - Const(pads[k], INDEX)
        if mode == "edge":
            return clamp(s, size)
        if mode == "wrap":
            return Binary("mod", s, Const(size, INDEX))
        # reflect: mirror without repeating the edge, period 2 * (size - 1)
        if size == 1:
            return Const(0, INDEX)
        period = Const(2 * (size - 1), INDEX)
        m = Binary("mod", s, period)
        return Select(m < Const(size, INDEX), m, period - m)

    return compute(
        out.shape, lambda *i: x[tuple(source(v, k) for k, v in enumerate(i))], ctx.stage_name(node)
    )


def _gather_elements(ctx: KernelContext, node: Node):
    data, indices = ctx.tensor(node.inputs[0]), ctx.tensor(node.inputs[1])
    out = ctx.type(node.outputs[0])
    axis = node.attr("axis", 0) % len(data.shape)

    def body(*i):
        raw = Cast(INDEX, indices[i])
        size = data.shape[axis]
        wrapped = Select(raw < Const(0, INDEX), raw + Const(size, INDEX), raw)
        return data[tuple(clamp(wrapped, size) if d == axis else v for d, v in enumerate(i))]

    return [compute(out.shape, body, ctx.stage_name(node))]


def _reverse_sequence(ctx: KernelContext, node: Node):
    x, lengths = ctx.tensor(node.inputs[0]), ctx.tensor(node.inputs[1])
    batch_axis, time_axis = node.attr("batch_axis", 1), node.attr("time_axis", 0)

    def body(*i):
        length = Cast(INDEX, lengths[(i[batch_axis],)])
        t = i[time_axis]
        flipped = Select(t < length, length - Const(1, INDEX) - t, t)
        return x[
            tuple(
                clamp(flipped, x.shape[time_axis]) if d == time_axis else v for d, v in enumerate(i)
            )
        ]

    return [compute(x.shape, body, ctx.stage_name(node))]


def _pad(ctx: KernelContext, node: Node):
    out = ctx.type(node.outputs[0])
    x = ctx.tensor(node.inputs[0])
    mode = node.attr("mode", "constant")
    if mode != "constant":
        return [_pad_indexed(ctx, node, x, out, mode)]
    pads = node.attr("pads")
    rank = len(x.shape)
    fill = Const(node.attr("value", 0), x.dtype)

    def body(*i):
        source, inside = [], None
        for k in range(rank):
            s = i[k] - Const(pads[k], INDEX)
            source.append(s)
            if pads[k] > 0 or pads[k + rank] > 0:
                ok = logical_and(s >= Const(0, INDEX), s < Const(x.shape[k], INDEX))
                inside = ok if inside is None else logical_and(inside, ok)
        clamped = tuple(clamp(s, x.shape[k]) for k, s in enumerate(source))
        value = x[clamped]
        return value if inside is None else Select(inside, value, fill)

    return [compute(out.shape, body, ctx.stage_name(node))]


def _trilu(ctx: KernelContext, node: Node):
    out = ctx.type(node.outputs[0])
    x = ctx.tensor(node.inputs[0])
    k = Const(node.attr("k", 0), INDEX)

    def body(*i):
        offset = i[-1] - i[-2]
        keep = offset >= k if node.attr("upper", 1) else offset <= k
        return Select(keep, x[i], Const(0, x.dtype))

    return [compute(out.shape, body, ctx.stage_name(node))]


def _one_hot(ctx: KernelContext, node: Node):
    out = ctx.type(node.outputs[0])
    indices, values = ctx.tensor(node.inputs[0]), ctx.tensor(node.inputs[1])
    depth = node.attr("depth")
    axis = node.attr("axis", -1) % out.rank

    def body(*i):
        raw = Cast(INDEX, indices[i[:axis] + i[axis + 1 :]])
        wrapped = Select(raw < Const(0, INDEX), raw + Const(depth, INDEX), raw)
        hot = wrapped.equals(i[axis])
        return Select(hot, values[(Const(1, INDEX),)], values[(Const(0, INDEX),)])

    return [compute(out.shape, body, ctx.stage_name(node))]


KERNELS: dict[str, Builder] = {
    "Trilu": _trilu,
    "OneHot": _one_hot,
    "Reshape": _reshape,
    "Transpose": _transpose,
    "Concat": _concat,
    "Split": _split,
    "Slice": _slice,
    "Gather": _gather,
    "Expand": _expand,
    "Tile": _tile,
    "Pad": _pad,
}


def _resize(ctx: KernelContext, node: Node):
    """Separable resampling with build-time tap tables: for every resized axis, each output
    position reads a few input positions with fixed weights (the reference's weight matrix,
    kept sparse)."""
    x = ctx.tensor(node.inputs[0])
    out = ctx.type(node.outputs[0])
    scales = node.attr("scales")
    tables, any_outside = {}, False
    for axis, (in_len, out_len) in enumerate(zip(x.shape, out.shape, strict=True)):
        if in_len == out_len and scales[axis] == 1.0 and node.attr("roi", None) is None:
            continue
        matrix, outside = axis_weights(node, axis, in_len, out_len, scales[axis])
        taps = max(1, int((matrix != 0).sum(axis=1).max()))
        index = np.zeros((out_len, taps), np.int64)
        weight = np.zeros((out_len, taps), np.float32)
        for row in range(out_len):
            columns = np.nonzero(matrix[row])[0]
            index[row, : len(columns)] = columns
            weight[row, : len(columns)] = matrix[row, columns]
        label = f"resize_axis{axis}"
        tables[axis] = (
            ctx.packed(node.outputs[0], f"{label}_index", index),
            ctx.packed(node.outputs[0], f"{label}_weight", weight),
            ctx.packed(node.outputs[0], f"{label}_outside", outside.astype(np.int64)),
            reduce_axis(taps, f"tap{axis}"),
        )
        any_outside |= bool(outside.any())

    def body(*i):
        source, weight, outside = list(i), None, None
        for axis, (index, weights, out_mask, tap) in tables.items():
            source[axis] = index[(i[axis], tap)]
            w = weights[(i[axis], tap)]
            weight = w if weight is None else weight * w
            flag = out_mask[(i[axis],)]
            outside = flag if outside is None else Binary("max", outside, flag)
        value = Cast("float32", x[tuple(source)]) * weight if weight is not None else x[i]
        return reduce_sum(value, [t[3] for t in tables.values()]) if tables else value

    total = compute(out.shape, body, ctx.stage_name(node), "float32" if tables else out.dtype)
    fill = Const(node.attr("extrapolation_value", 0.0), "float32")

    def finish(*i):
        value = total[i]
        if any_outside:
            flags = [t[2][(i[a],)] for a, t in tables.items()]
            hit = flags[0]
            for flag in flags[1:]:
                hit = Binary("max", hit, flag)
            value = Select(hit > Const(0, INDEX), fill, value)
        if out.dtype != "float32":
            value = Cast(out.dtype, Unary("round", value))
        return value

    if not any_outside and out.dtype == "float32":
        return [total]
    return [compute(out.shape, finish, ctx.stage_name(node), out.dtype)]


KERNELS["Resize"] = _resize


def _grid_sample(ctx: KernelContext, node: Node):
    """Sampling at grid positions: coordinates are computed from the grid values in the
    kernel, taps outside the input read 0 (border and reflection act on the coordinate)."""
    x = ctx.tensor(node.inputs[0])
    grid = ctx.tensor(node.inputs[1])
    out = ctx.type(node.outputs[0])
    if np.dtype(x.dtype).kind != "f":
        raise KernelError(f"node {node.name!r}: GridSample on {x.dtype}")
    nsp = len(x.shape) - 2
    sizes = x.shape[2:]
    mode = {"bilinear": "linear", "bicubic": "cubic"}.get(
        node.attr("mode", "linear"), node.attr("mode", "linear")
    )
    padding = node.attr("padding_mode", "zeros")
    align = bool(node.attr("align_corners", 0))
    f = "float32"

    def c(v):
        return Const(float(v), f)

    def unnormalize(g, size):
        if align:
            return (g + c(1)) / c(2) * c(size - 1)
        return ((g + c(1)) * c(size) - c(1)) / c(2)

    def reflect(v, low2, high2):
        if low2 == high2:
            return c(0)
        low, span = low2 / 2, (high2 - low2) / 2
        d = Unary("abs", v - c(low))
        extra = Binary("fmod", d, c(span))
        flips = Unary("floor", d / c(span))
        even = Binary("fmod", flips, c(2)).equals(c(0))
        return Select(even, extra + c(low), c(span) - extra + c(low))

    def pad_coordinate(v, size):
        if padding == "border":
            return Binary("min", Binary("max", v, c(0)), c(size - 1))
        if padding == "reflection":
            bounds = (0, 2 * (size - 1)) if align else (-1, 2 * size - 1)
            r = reflect(v, *bounds)
            return Binary("min", Binary("max", r, c(0)), c(size - 1))
        return v

    def tap_value(n, ch, taps):
        ok, index = None, []
        for t, size in zip(taps, sizes, strict=True):
            inside = logical_and(t >= Const(0, INDEX), t < Const(size, INDEX))
            ok = inside if ok is None else logical_and(ok, inside)
            index.append(clamp(t, size))
        return Select(ok, Cast(f, x[(n, ch, *index)]), c(0))

    def cubic_weight(distance):
        a = -0.75
        d = Unary("abs", distance)
        near = ((c(a + 2) * d - c(a + 3)) * d * d) + c(1)
        far = ((c(a) * d - c(5 * a)) * d + c(8 * a)) * d - c(4 * a)
        return Select(d <= c(1), near, far)

    def body(n, ch, *o):
        coords = [
            unnormalize(Cast(f, grid[(n, *o, Const(nsp - 1 - d, INDEX))]), sizes[d])
            for d in range(nsp)
        ]
        if mode == "nearest":
            taps = [
                Cast(INDEX, Unary("round", pad_coordinate(v, s)))
                for v, s in zip(coords, sizes, strict=True)
            ]
            return Cast(x.dtype, tap_value(n, ch, taps))
        if mode == "linear":
            coords = [pad_coordinate(v, s) for v, s in zip(coords, sizes, strict=True)]
            offsets, count = (0, 1), 2
        else:
            offsets, count = (-1, 0, 1, 2), 4
        total = None
        for corner in np.ndindex(*(count,) * nsp):
            weight, taps = None, []
            for d, k in enumerate(corner):
                low = Unary("floor", coords[d])
                frac = coords[d] - low
                shift = offsets[k]
                if mode == "linear":
                    w = frac if shift else c(1) - frac
                else:
                    w = cubic_weight(frac - c(shift))
                weight = w if weight is None else weight * w
                position = low + c(shift)
                if mode == "cubic" and padding != "zeros":
                    position = Unary("round", pad_coordinate(position, sizes[d]))
                taps.append(Cast(INDEX, position))
            term = weight * tap_value(n, ch, taps)
            total = term if total is None else total + term
        return Cast(x.dtype, total)

    return [compute(out.shape, body, ctx.stage_name(node), out.dtype)]


KERNELS["GridSample"] = _grid_sample


def _center_crop_pad(ctx: KernelContext, node: Node):
    x = ctx.tensor(node.inputs[0])
    out = ctx.type(node.outputs[0])
    shifts, padded = {}, set()
    for axis, size in zip(node.attr("axes"), node.attr("shape"), strict=True):
        current = x.shape[axis]
        # Cropping starts (current - size) // 2 in; padding puts (size - current) // 2 before.
        shifts[axis] = (current - size) // 2 if size < current else -((size - current) // 2)
        if size > current:
            padded.add(axis)

    def body(*i):
        source, ok = [], None
        for d, v in enumerate(i):
            s = v + Const(shifts.get(d, 0), INDEX)
            if d in padded:
                inside = logical_and(s >= Const(0, INDEX), s < Const(x.shape[d], INDEX))
                ok = inside if ok is None else logical_and(ok, inside)
            source.append(clamp(s, x.shape[d]))
        value = x[tuple(source)]
        return value if ok is None else Select(ok, value, Const(0, x.dtype))

    return [compute(out.shape, body, ctx.stage_name(node))]


_SCATTER_COMBINE = {
    "add": (reduce_sum, 0, lambda a, b: a + b),
    "mul": (reduce_prod, 1, lambda a, b: a * b),
    "max": (reduce_max, None, lambda a, b: Binary("max", a, b)),
    "min": (reduce_min, None, lambda a, b: Binary("min", a, b)),
}


def _scatter_elements(ctx: KernelContext, node: Node):
    """Each output element gathers the updates aimed at it: the last one (reduction none) or
    all of them, combined."""
    data, indices, updates = (ctx.tensor(v) for v in node.inputs)
    out = ctx.type(node.outputs[0])
    rank = len(data.shape)
    axis = node.attr("axis", 0) % rank
    r = reduce_axis(indices.shape[axis], "rs")
    reduction = node.attr("reduction", "none")

    def where(i):
        position = tuple(r if d == axis else clamp(i[d], indices.shape[d]) for d in range(rank))
        target = Cast(INDEX, indices[position])
        target = Select(target < Const(0, INDEX), target + Const(data.shape[axis], INDEX), target)
        ok = target.equals(i[axis])
        for d in range(rank):
            if d != axis and indices.shape[d] < data.shape[d]:
                ok = logical_and(ok, i[d] < Const(indices.shape[d], INDEX))
        return position, ok

    if reduction == "none":

        def last(*i):
            _, ok = where(i)
            return reduce_max(Select(ok, Cast(INDEX, r), Const(-1, INDEX)), r)

        found = compute(out.shape, last, ctx.stage_name(node), "int64")

        def body(*i):
            hit = found[i]
            position = tuple(
                clamp(hit, indices.shape[axis]) if d == axis else clamp(i[d], indices.shape[d])
                for d in range(rank)
            )
            return Select(hit >= Const(0, INDEX), updates[position], data[i])

        return [compute(out.shape, body, ctx.stage_name(node))]
    combiner, identity, merge = _SCATTER_COMBINE[reduction]
    info = np.finfo(data.dtype) if np.dtype(data.dtype).kind == "f" else np.iinfo(data.dtype)
    if identity is None:
        identity = info.min if reduction == "max" else info.max

    def gathered(*i):
        position, ok = where(i)
        return combiner(Select(ok, updates[position], Const(identity, data.dtype)), r)

    combined = compute(out.shape, gathered, ctx.stage_name(node))

    def count(*i):
        _, ok = where(i)
        return reduce_sum(Select(ok, Const(1, INDEX), Const(0, INDEX)), r)

    hits = compute(out.shape, count, ctx.stage_name(node), "int64")
    return [
        compute(
            out.shape,
            lambda *i: Select(hits[i] > Const(0, INDEX), merge(data[i], combined[i]), data[i]),
            ctx.stage_name(node),
        )
    ]


KERNELS.update(
    {
        "CenterCropPad": _center_crop_pad,
        "ScatterElements": _scatter_elements,
        "GatherElements": _gather_elements,
        "ReverseSequence": _reverse_sequence,
    }
)


def _scatter_nd(ctx: KernelContext, node: Node):
    """Each output element takes the last update aimed at it (reduction none), or combines
    every update aimed at it."""
    data, indices, updates = (ctx.tensor(v) for v in node.inputs)
    out = ctx.type(node.outputs[0])
    depth = indices.shape[-1]
    lead = indices.shape[:-1]
    qs = [reduce_axis(d, f"rq{k}") for k, d in enumerate(lead)]
    reduction = node.attr("reduction", "none")

    def matches(i):
        ok = None
        for d in range(depth):
            raw = Cast(INDEX, indices[(*qs, Const(d, INDEX))])
            wrapped = Select(raw < Const(0, INDEX), raw + Const(data.shape[d], INDEX), raw)
            cond = wrapped.equals(i[d])
            ok = cond if ok is None else logical_and(ok, cond)
        return ok

    def flat_q():
        flat = Const(0, INDEX)
        for q, size in zip(qs, lead, strict=True):
            flat = flat * Const(size, INDEX) + q
        return flat

    def update_at(q_flat, i):
        coords, rest = [], q_flat
        for size in reversed(lead):
            coords.insert(0, clamp(Binary("mod", rest, Const(size, INDEX)), size))
            rest = Binary("floordiv", rest, Const(size, INDEX))
        return updates[(*coords, *i[depth:])]

    if reduction == "none":
        found = compute(
            out.shape,
            lambda *i: reduce_max(Select(matches(i), flat_q(), Const(-1, INDEX)), qs),
            ctx.stage_name(node),
            "int64",
        )
        return [
            compute(
                out.shape,
                lambda *i: Select(found[i] >= Const(0, INDEX), update_at(found[i], i), data[i]),
                ctx.stage_name(node),
            )
        ]
    combiner, identity, merge = _SCATTER_COMBINE[reduction]
    if identity is None:
        info = np.finfo(data.dtype) if np.dtype(data.dtype).kind == "f" else np.iinfo(data.dtype)
        identity = info.min if reduction == "max" else info.max

    def gathered(*i):
        value = updates[(*qs, *i[depth:])]
        return combiner(Select(matches(i), value, Const(identity, data.dtype)), qs)

    combined = compute(out.shape, gathered, ctx.stage_name(node))
    hits = compute(
        out.shape,
        lambda *i: reduce_sum(Select(matches(i), Const(1, INDEX), Const(0, INDEX)), qs),
        ctx.stage_name(node),
        "int64",
    )
    return [
        compute(
            out.shape,
            lambda *i: Select(hits[i] > Const(0, INDEX), merge(data[i], combined[i]), data[i]),
            ctx.stage_name(node),
        )
    ]


KERNELS["ScatterND"] = _scatter_nd


def _gather_nd(ctx: KernelContext, node: Node):
    data, indices = ctx.tensor(node.inputs[0]), ctx.tensor(node.inputs[1])
    out = ctx.type(node.outputs[0])
    batch = node.attr("batch_dims", 0)
    depth = indices.shape[-1]
    lead = len(indices.shape) - 1

    def body(*i):
        prefix = i[:lead]
        coords = []
        for d in range(depth):
            size = data.shape[batch + d]
            raw = Cast(INDEX, indices[(*prefix, Const(d, INDEX))])
            wrapped = Select(raw < Const(0, INDEX), raw + Const(size, INDEX), raw)
            coords.append(clamp(wrapped, size))
        return data[(*i[:batch], *coords, *i[lead:])]

    return [compute(out.shape, body, ctx.stage_name(node))]


KERNELS["GatherND"] = _gather_nd


def _layout_transform(ctx: KernelContext, node: Node):
    """NCHW <-> NCHW[b]c (or between two block sizes) as one index mapping; the padding lanes
    of a blocked result whose channels do not fill its last block are zero."""
    x = ctx.tensor(node.inputs[0])
    out = ctx.type(node.outputs[0])
    source, target, channels = transform_blocks(node)
    plain_channels = plain_shape(x.shape, source, channels)[1]

    def read(n, channel, spatial):
        if not source:
            return x[(n, channel, *spatial)]
        outer = Binary("floordiv", channel, Const(source, INDEX))
        inner = Binary("mod", channel, Const(source, INDEX))
        return x[(n, outer, *spatial, inner)]

    def body(*i):
        n, spatial = i[0], i[2 : len(i) - (1 if target else 0)]
        if not target:
            return read(n, i[1], spatial)
        channel = i[1] * Const(target, INDEX) + i[-1]
        if out.shape[1] * target == plain_channels:
            return read(n, channel, spatial)
        last = Const(plain_channels - 1, INDEX)
        value = read(n, Binary("min", channel, last), spatial)
        inside = Binary("lt", channel, Const(plain_channels, INDEX))
        return Select(inside, value, Const(0.0, out.dtype))

    result = compute(out.shape, body, ctx.stage_name(node))
    if source and not target:
        ctx.note(result.name, unblock=source)  # its schedule reads whole channel blocks
    elif target and not source:
        ctx.note(result.name, block=target)  # ... and writes them, tiles of pixels x channels
    return [result]


KERNELS["LayoutTransform"] = _layout_transform


def _bit_cast(ctx: KernelContext, node: Node):
    """BitCast: copy the input's bytes through a view of them as the target type."""
    out = ctx.type(node.outputs[0])
    source = ctx.view(node.inputs[0], out.dtype, out.shape)
    return [compute(out.shape, lambda *i: source[i], ctx.stage_name(node))]


KERNELS["BitCast"] = _bit_cast


def _tensor_scatter(ctx: KernelContext, node: Node):
    """out = past, except positions write_index[b] .. + len along the sequence axis, which
    read `update` (modulo the cache length in circular mode)."""
    past, update = ctx.tensor(node.inputs[0]), ctx.tensor(node.inputs[1])
    rank = len(past.shape)
    axis = node.attr("axis", -2) % rank
    capacity, length = past.shape[axis], update.shape[axis]
    has_starts = len(node.inputs) > 2 and node.inputs[2]
    starts = ctx.tensor(node.inputs[2]) if has_starts else None
    circular = node.attr("mode", "linear") == "circular"

    def body(*i):
        start = Cast(INDEX, starts[(i[0],)]) if starts is not None else Const(0, INDEX)
        offset = i[axis] - start
        if circular:  # positions wrap: the update's k-th row lands at (start + k) mod capacity
            offset = Binary("mod", offset + Const(capacity, INDEX), Const(capacity, INDEX))
        inside = logical_and(offset >= Const(0, INDEX), offset < Const(length, INDEX))
        source = list(i)
        source[axis] = clamp(offset, length)
        return Select(inside, update[tuple(source)], past[i])

    return [compute(past.shape, body, ctx.stage_name(node))]


KERNELS["TensorScatter"] = _tensor_scatter


def _roi_align(ctx: KernelContext, node: Node):
    """Bilinear samples on a fixed `sampling_ratio` grid per bin, averaged (or the max of
    weighted corners, onnxruntime's max mode); coordinates in float64 like the reference."""
    ratio = node.attr("sampling_ratio", 0)
    if ratio <= 0:
        raise KernelError(
            f"node {node.name!r}: RoiAlign with an adaptive sampling_ratio (0) has a "
            "data-dependent sample count and no native kernel"
        )
    x, rois, batch_indices = (ctx.tensor(v) for v in node.inputs[:3])
    out = ctx.type(node.outputs[0])
    f64 = "float64"
    scale = node.attr("spatial_scale", 1.0)
    half_pixel = node.attr("coordinate_transformation_mode", "half_pixel") == "half_pixel"
    sy, sx = reduce_axis(ratio, "rsy"), reduce_axis(ratio, "rsx")

    def roi(r, k):
        value = Cast(f64, rois[(r, Const(k, INDEX))]) * Const(scale, f64)
        return value - Const(0.5, f64) if half_pixel else value

    def taps(r, axis, bin_, sample):
        """(low index, high index, low weight, high weight) along y (axis 0) or x (1)."""
        start, end = roi(r, 1 - axis), roi(r, 3 - axis)
        length = end - start if half_pixel else maximum(end - start, Const(1.0, f64))
        bins, size = out.shape[2 + axis], x.shape[2 + axis]
        step = length / Const(float(bins), f64)
        position = (
            start
            + Cast(f64, bin_) * step
            + (Cast(f64, sample) + Const(0.5, f64)) * step / Const(float(ratio), f64)
        )
        valid = logical_and(position >= Const(-1.0, f64), position <= Const(float(size), f64))
        position = maximum(position, Const(0.0, f64))
        last = Const(size - 1, INDEX)
        low = minimum(Cast(INDEX, Unary("floor", position)), last)
        high = minimum(low + Const(1, INDEX), last)
        position = Select(low >= last, Cast(f64, low), position)
        frac = position - Cast(f64, low)
        zero = Const(0.0, f64)
        return low, high, Select(valid, Const(1.0, f64) - frac, zero), Select(valid, frac, zero)

    def corners(r, c, py, px):
        y_low, y_high, wy_low, wy_high = taps(r, 0, py, sy)
        x_low, x_high, wx_low, wx_high = taps(r, 1, px, sx)
        batch = Cast(INDEX, batch_indices[(r,)])
        return [
            Cast(f64, x[(batch, c, yi, xi)]) * wy * wx
            for yi, wy in ((y_low, wy_low), (y_high, wy_high))
            for xi, wx in ((x_low, wx_low), (x_high, wx_high))
        ]

    if node.attr("mode", "avg") == "max":

        def pooled(r, c, py, px):
            values = corners(r, c, py, px)
            best = values[0]
            for value in values[1:]:
                best = maximum(best, value)
            return reduce_max(best, [sy, sx])

        result = compute(out.shape, pooled, ctx.stage_name(node), f64)
        return [compute(out.shape, lambda *i: Cast(out.dtype, result[i]), ctx.stage_name(node))]

    def summed(r, c, py, px):
        a, b, c_, d = corners(r, c, py, px)
        return reduce_sum(a + b + c_ + d, [sy, sx])

    total = compute(out.shape, summed, ctx.stage_name(node), f64)
    count = Const(float(ratio * ratio), f64)
    return [compute(out.shape, lambda *i: Cast(out.dtype, total[i] / count), ctx.stage_name(node))]


KERNELS["RoiAlign"] = _roi_align


def _interleave_phases(ctx: KernelContext, node: Node):
    """out[n, m, o..] = x[n, m * S + phase, (o + start) // s]: each output element reads its
    phase channel directly (no flattened index to take apart), so with s a power of two the
    divisions are shifts and masks of the vectorized axis."""
    x = ctx.tensor(node.inputs[0])
    out = ctx.type(node.outputs[0])
    strides, starts = node.attr("strides"), node.attr("starts")
    phases = int(np.prod(strides))

    def body(n, m, *o):
        phase: Expr = Const(0, INDEX)
        rows = []
        for index, stride, start in zip(o, strides, starts, strict=True):
            position = index + Const(start, INDEX) if start else index
            if stride == 1:
                rows.append(position)
                continue
            phase = phase * Const(stride, INDEX) + Binary("mod", position, Const(stride, INDEX))
            rows.append(Binary("floordiv", position, Const(stride, INDEX)))
        return x[(n, m * Const(phases, INDEX) + phase, *rows)]

    return [compute(out.shape, body, ctx.stage_name(node))]


KERNELS["InterleavePhases"] = _interleave_phases
