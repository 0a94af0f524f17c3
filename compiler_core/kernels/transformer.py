"""Attention as tensor expressions: scores, masks (causal, windows, padding, boolean or additive),
a softmax whose fully masked rows are zero, and the weighted sum of values; 3-D inputs, grouped
query heads, and a KV cache (past concatenated with the new keys) included."""

from __future__ import annotations

import math

import numpy as np

from compiler_core.graph.ir import Node
from compiler_core.kernels.base import Builder, KernelContext, KernelError, broadcast_index
from compiler_core.kernels.injective import clamp
from compiler_core.loop.ir import INDEX, Binary, Cast, Const, Select, Unary, logical_and
from compiler_core.te import Tensor, compute, reduce_axis, reduce_max, reduce_sum


def _heads(ctx: KernelContext, node: Node, tensor: Tensor, heads: int | None) -> Tensor:
    """(B, S, H*D) -> (B, H, S, D) as an index mapping; 4-D tensors pass through."""
    if len(tensor.shape) == 4:
        return tensor
    b, s, hd = tensor.shape
    d = hd // heads
    return compute(
        (b, heads, s, d),
        lambda bi, h, si, di: tensor[(bi, si, h * Const(d, INDEX) + di)],
        ctx.stage_name(node),
    )


def _with_past(ctx: KernelContext, node: Node, past: Tensor | None, new: Tensor) -> Tensor:
    if past is None:
        return new
    p = past.shape[2]
    b, h, s, d = new.shape

    def body(bi, hi, si, di):
        old = past[(bi, hi, clamp(si, p), di)]
        fresh = new[(bi, hi, clamp(si - Const(p, INDEX), s), di)]
        return Select(si < Const(p, INDEX), old, fresh)

    return compute((b, h, p + s, d), body, ctx.stage_name(node))


def _optional(ctx: KernelContext, node: Node, index: int) -> Tensor | None:
    if len(node.inputs) > index and node.inputs[index]:
        return ctx.tensor(node.inputs[index])
    return None


HALF_PRECISION = ("float16", "bfloat16")


def _attention(ctx: KernelContext, node: Node):
    q_in, k_in, v_in = (ctx.tensor(v) for v in node.inputs[:3])
    if q_in.dtype not in HALF_PRECISION and np.dtype(q_in.dtype).kind != "f":
        raise KernelError(f"node {node.name!r}: Attention on {q_in.dtype}")
    mask = _optional(ctx, node, 3)
    past_key, past_value = _optional(ctx, node, 4), _optional(ctx, node, 5)
    nonpad = _optional(ctx, node, 6)
    q = _heads(ctx, node, q_in, node.attr("q_num_heads", None))
    k = _with_past(ctx, node, past_key, _heads(ctx, node, k_in, node.attr("kv_num_heads", None)))
    v = _with_past(ctx, node, past_value, _heads(ctx, node, v_in, node.attr("kv_num_heads", None)))
    batch, q_heads, q_len, head_size = q.shape
    kv_heads, k_len, v_size = k.shape[1], k.shape[2], v.shape[3]
    group = q_heads // kv_heads
    out_dtype = q.dtype
    present_key, present_value = k, v
    if out_dtype in HALF_PRECISION:  # accumulate half-precision attention in float32
        q, k, v = (_as(ctx, node, t, "float32") for t in (q, k, v))
    dtype = q.dtype
    scale = node.attr("scale", None)
    scale = 1.0 / math.sqrt(head_size) if scale is None else scale
    past_len = past_key.shape[2] if past_key is not None else None
    shape = (batch, q_heads, q_len, k_len)

    def kv_head(h):
        return Binary("floordiv", h, Const(group, INDEX)) if group > 1 else h

    dk = reduce_axis(head_size, "rd")
    raw = compute(
        shape,
        lambda b, h, i, j: reduce_sum(q[(b, h, i, dk)] * k[(b, kv_head(h), j, dk)], dk),
        ctx.stage_name(node),
    )
    softcap = node.attr("softcap", 0.0)

    def capped(b, h, i, j):
        s = raw[(b, h, i, j)] * Const(scale, dtype)
        if softcap > 0:
            s = Const(softcap, dtype) * Unary("tanh", s / Const(softcap, dtype))
        return s

    scores = compute(shape, capped, ctx.stage_name(node))

    def allowed(b, h, i, j):
        ok = None

        def both(cond):
            nonlocal ok
            ok = cond if ok is None else logical_and(ok, cond)

        if nonpad is not None:
            length = Cast(INDEX, nonpad[(b,)])
            both(j < length)
            offset = length - Const(q_len, INDEX) if past_len is None else Const(past_len, INDEX)
        else:
            offset = Const(past_len or 0, INDEX)
        position = i + offset
        if node.attr("is_causal", 0):
            both(j <= position)
        left, right = node.attr("left_window_size", -1), node.attr("right_window_size", -1)
        if left >= 0:
            both(j >= position - Const(left, INDEX))
        if right >= 0:
            both(j <= position + Const(right, INDEX))
        if mask is not None and mask.dtype == "bool":
            both(_mask_value(mask, shape, (b, h, i, j)))
        return ok

    def biased(b, h, i, j):
        s = scores[(b, h, i, j)]
        if mask is not None and mask.dtype != "bool":
            s = s + Cast(dtype, _mask_value(mask, shape, (b, h, i, j)))
        ok = allowed(b, h, i, j)
        return s if ok is None else Select(ok, s, Const(-np.inf, dtype))

    logits = compute(shape, biased, ctx.stage_name(node))
    rj = reduce_axis(k_len, "rj")
    peak = compute(
        shape[:3], lambda b, h, i: reduce_max(logits[(b, h, i, rj)], rj), ctx.stage_name(node)
    )

    def exponent(b, h, i, j):
        live = logits[(b, h, i, j)] > Const(-np.inf, dtype)
        return Select(live, Unary("exp", logits[(b, h, i, j)] - peak[(b, h, i)]), Const(0.0, dtype))

    weights = compute(shape, exponent, ctx.stage_name(node))
    rj2 = reduce_axis(k_len, "rj")
    total = compute(
        shape[:3], lambda b, h, i: reduce_sum(weights[(b, h, i, rj2)], rj2), ctx.stage_name(node)
    )
    probabilities = compute(
        shape,
        lambda b, h, i, j: Select(
            total[(b, h, i)] > Const(0.0, dtype),
            weights[(b, h, i, j)] / total[(b, h, i)],
            Const(0.0, dtype),
        ),
        ctx.stage_name(node),
    )
    rk = reduce_axis(k_len, "rk")
    y = compute(
        (batch, q_heads, q_len, v_size),
        lambda b, h, i, d: reduce_sum(probabilities[(b, h, i, rk)] * v[(b, kv_head(h), rk, d)], rk),
        ctx.stage_name(node),
    )
    if len(q_in.shape) == 3:
        y4 = y
        y = compute(
            (batch, q_len, q_heads * v_size),
            lambda b, i, c: y4[
                (
                    b,
                    Binary("floordiv", c, Const(v_size, INDEX)),
                    i,
                    Binary("mod", c, Const(v_size, INDEX)),
                )
            ],
            ctx.stage_name(node),
        )
    stages = [raw_scaled(ctx, node, raw, scale, dtype), scores, logits, probabilities]
    debug = stages[node.attr("qk_matmul_output_mode", 0)]
    if out_dtype != dtype:
        y, debug = _as(ctx, node, y, out_dtype), _as(ctx, node, debug, out_dtype)
    results = [y, _copy(ctx, node, present_key), _copy(ctx, node, present_value), debug]
    return [t for t, value in zip(results, node.outputs, strict=False) if value]


def raw_scaled(ctx, node, raw, scale, dtype):
    return compute(raw.shape, lambda *i: raw[i] * Const(scale, dtype), ctx.stage_name(node))


def _as(ctx: KernelContext, node: Node, t: Tensor, dtype: str) -> Tensor:
    return compute(t.shape, lambda *i: Cast(dtype, t[i]), ctx.stage_name(node), dtype)


def _copy(ctx: KernelContext, node: Node, t: Tensor) -> Tensor:
    return compute(t.shape, lambda *i: t[i], ctx.stage_name(node))


def _mask_value(mask: Tensor, shape, index):
    """The mask at (b, h, i, j), broadcast; keys beyond a short mask are masked out."""
    mask_len = mask.shape[-1]
    j = index[-1]
    clamped = tuple(index[:-1]) + (clamp(j, mask_len),)
    value = mask[broadcast_index(mask.shape, shape, clamped)]
    if mask_len >= shape[-1]:
        return value
    beyond = Const(False, "bool") if mask.dtype == "bool" else Const(-np.inf, mask.dtype)
    return Select(j < Const(mask_len, INDEX), value, beyond)


KERNELS: dict[str, Builder] = {"Attention": _attention}


def _rotary(ctx: KernelContext, node: Node):
    x = ctx.tensor(node.inputs[0])
    cos_cache, sin_cache = ctx.tensor(node.inputs[1]), ctx.tensor(node.inputs[2])
    positions = _optional(ctx, node, 3)
    out = ctx.type(node.outputs[0])
    three_d = len(x.shape) == 3
    head_size = x.shape[2] // node.attr("num_heads") if three_d else x.shape[3]
    rotary = node.attr("rotary_embedding_dim", 0) or head_size
    half = rotary // 2
    interleaved = node.attr("interleaved", 0)

    def body(*i):
        if three_d:
            b, s, col = i
            base = col - Binary("mod", col, Const(head_size, INDEX))
            d = Binary("mod", col, Const(head_size, INDEX))

            def at(k):
                return x[(b, s, base + k)]
        else:
            b, h, s, d = i

            def at(k):
                return x[(b, h, s, k)]

        def trig(cache, j):
            j = clamp(j, half)
            if positions is not None:
                return cache[(Cast(INDEX, positions[(b, s)]), j)]
            return cache[(b, s, j)]

        if interleaved:
            j = Binary("floordiv", d, Const(2, INDEX))
            even = Binary("mod", d, Const(2, INDEX)).equals(Const(0, INDEX))
            first = at(clamp(j * Const(2, INDEX), head_size))
            second = at(clamp(j * Const(2, INDEX) + Const(1, INDEX), head_size))
            rotated = Select(
                even,
                first * trig(cos_cache, j) - second * trig(sin_cache, j),
                second * trig(cos_cache, j) + first * trig(sin_cache, j),
            )
        else:
            low = d < Const(half, INDEX)
            j = Select(low, d, d - Const(half, INDEX))
            first = at(clamp(j, head_size))
            second = at(clamp(j + Const(half, INDEX), head_size))
            rotated = Select(
                low,
                first * trig(cos_cache, j) - second * trig(sin_cache, j),
                second * trig(cos_cache, j) + first * trig(sin_cache, j),
            )
        return Select(d < Const(rotary, INDEX), rotated, at(clamp(d, head_size)))

    return [compute(out.shape, body, ctx.stage_name(node))]


KERNELS["RotaryEmbedding"] = _rotary
