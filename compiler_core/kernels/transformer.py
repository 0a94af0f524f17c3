"""Transformer operators with kernels of their own: RotaryEmbedding. (Attention has none:
`passes/decompose_attention.py` spells it out as batched GEMMs around a row softmax.)"""

from __future__ import annotations

from compiler_core.graph.ir import Node
from compiler_core.kernels.base import Builder, KernelContext
from compiler_core.kernels.injective import clamp
from compiler_core.loop.ir import INDEX, Binary, Cast, Const, Select
from compiler_core.te import Tensor, compute


def _optional(ctx: KernelContext, node: Node, index: int) -> Tensor | None:
    if len(node.inputs) > index and node.inputs[index]:
        return ctx.tensor(node.inputs[index])
    return None


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


KERNELS: dict[str, Builder] = {"RotaryEmbedding": _rotary}
