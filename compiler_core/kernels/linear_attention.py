"""Native kernel for LinearAttention (reference: compiler_core/graph/ops/transformer.py).

One `te.recurrence` over the sequence (the kernel's size does not depend on its length): per
step, the state S [B, H, Dk, Dv] is decayed (gated rules), corrected by the delta rule
(v' = beta (v - S^T k)), updated with the outer product k v'^T, and read by the step's queries
(o = scale q S). Everything runs in float64 like the reference and is cast once at the end.
"""

from __future__ import annotations

import math

from compiler_core.graph.ir import Node
from compiler_core.kernels.base import Builder, KernelContext
from compiler_core.kernels.transformer import _optional
from compiler_core.loop.ir import INDEX, Binary, Cast, Const, Expr, Unary
from compiler_core.te import Tensor, compute, recurrence, reduce_axis, reduce_sum

F64 = "float64"


def _index(value: int) -> Expr:
    return Const(value, INDEX)


class _LinearAttention:
    def __init__(self, ctx: KernelContext, node: Node):
        self.ctx, self.node = ctx, node
        self.query, self.key, self.value = (ctx.tensor(v) for v in node.inputs[:3])
        self.past, self.decay, self.beta = (_optional(ctx, node, k) for k in (3, 4, 5))
        self.q_heads, self.kv_heads = node.attr("q_num_heads"), node.attr("kv_num_heads")
        rule = node.attr("update_rule", "gated_delta")
        self.gated, self.delta = rule in ("gated", "gated_delta"), rule in ("delta", "gated_delta")
        self.batch, self.steps = self.query.shape[:2]
        self.d_k = self.query.shape[2] // self.q_heads
        self.d_v = self.value.shape[2] // self.kv_heads
        self.group = self.q_heads // self.kv_heads
        self.scale = node.attr("scale", 0.0) or 1.0 / math.sqrt(self.d_k)
        self.state_shape = (self.batch, self.kv_heads, self.d_k, self.d_v)

    def stage(self, shape, body) -> Tensor:
        return compute(shape, body, self.ctx.stage_name(self.node), F64)

    @staticmethod
    def packed(t: Tensor, b, step, head, width: int, i) -> Expr:
        """Element i of `head` in a (B, T, H*width) tensor, as float64."""
        return Cast(F64, t[(b, step, head * _index(width) + i)])

    def gate(self, t: Tensor, b, h, step, i) -> Expr:
        """A (B, T, H*X) or (B, T, X) gate at head h, entry i (X = 1 broadcasts)."""
        packed = t.shape[2]
        heads = self.kv_heads if packed % self.kv_heads == 0 else 1
        width = packed // heads
        head = h if heads > 1 else _index(0)
        return self.packed(t, b, step, head, width, i if width > 1 else _index(0))

    def initial_state(self) -> Tensor:
        past = self.past
        return self.stage(
            self.state_shape,
            lambda *i: Cast(F64, past[i]) if past is not None else Const(0.0, F64),
        )

    def key_at(self, b, h, step: Expr, i) -> Expr:
        return self.packed(self.key, b, step, h, self.d_k, i)

    def step(self, t: Expr, state) -> list:
        """The bodies of the state after step t and of the step's unscaled output
        [B, Hq, Dv]; `state` reads the state before it."""
        if self.gated:  # a per-key (or per-head) factor on the rows of every state matrix
            previous = state
            state = self.stage(
                self.state_shape,
                lambda b, h, i, j: (
                    previous[(b, h, i, j)] * Unary("exp", self.gate(self.decay, b, h, t, i))
                ),
            )
        decayed = state
        corrected = self.delta_corrected(t, decayed) if self.delta else None

        def update(b, h, i, j):
            if corrected is None:
                written = self.packed(self.value, b, t, h, self.d_v, j)
            else:
                written = corrected[(b, h, j)]
            return decayed[(b, h, i, j)] + self.key_at(b, h, t, i) * written

        updated = self.stage(self.state_shape, update)
        # Kept in memory: the step's output reads it Dv times over.
        self.ctx.note(updated.name, materialize=True)

        def output_body(b, hq, j):
            i = reduce_axis(self.d_k, "rq")
            kv_head = Binary("floordiv", hq, _index(self.group))
            q = self.packed(self.query, b, t, hq, self.d_k, i)
            return reduce_sum(q * updated[(b, kv_head, i, j)], i)

        return [lambda *i: updated[i], output_body]

    def delta_corrected(self, t: Expr, decayed) -> Tensor:
        """beta (v - S^T k): write only what the decayed state does not already predict."""

        def predicted_body(b, h, j):
            i = reduce_axis(self.d_k, "rk")
            return reduce_sum(decayed[(b, h, i, j)] * self.key_at(b, h, t, i), i)

        predicted = self.stage((self.batch, self.kv_heads, self.d_v), predicted_body)

        def corrected_body(b, h, j):
            value = self.packed(self.value, b, t, h, self.d_v, j)
            return self.gate(self.beta, b, h, t, j) * (value - predicted[(b, h, j)])

        return self.stage((self.batch, self.kv_heads, self.d_v), corrected_body)


def _linear_attention(ctx: KernelContext, node: Node):
    la = _LinearAttention(ctx, node)
    outputs_shape = (la.batch, la.q_heads, la.d_v)
    no_output = compute(outputs_shape, lambda *i: Const(0.0, F64), ctx.stage_name(node), F64)
    states, outputs = recurrence(
        la.steps,
        [la.initial_state(), no_output],
        lambda t, prev: la.step(t, prev[0]),
        ctx.stage_name(node),
    )
    y_type = ctx.type(node.outputs[0]) if node.outputs[0] else None

    def y_body(b, t, packed):
        hq = Binary("floordiv", packed, _index(la.d_v))
        j = Binary("mod", packed, _index(la.d_v))
        return Cast(y_type.dtype, outputs[(t, b, hq, j)] * Const(la.scale, F64))

    results = []
    if node.outputs[0]:
        results.append(compute(y_type.shape, y_body, ctx.stage_name(node), y_type.dtype))
    if len(node.outputs) > 1 and node.outputs[1]:
        dtype = ctx.type(node.outputs[1]).dtype
        last = _index(la.steps - 1)
        results.append(
            compute(
                la.state_shape,
                lambda *i: Cast(dtype, states[(last, *i)]),
                ctx.stage_name(node),
                dtype,
            )
        )
    return results


KERNELS: dict[str, Builder] = {"LinearAttention": _linear_attention}
