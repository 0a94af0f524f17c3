"""TfIdfVectorizer (graph/ops/text.py): each counted n-gram's occurrences in a row, over every
position and skip, as one reduction per (row, n-gram); the n-grams' tokens, lengths and
weights are build-time tables, and each output column reads the n-gram that maps to it."""

from __future__ import annotations

import numpy as np

from compiler_core.graph.ir import Node
from compiler_core.graph.ops.text import counted_grams
from compiler_core.kernels.base import Builder, KernelContext, KernelError
from compiler_core.kernels.injective import clamp
from compiler_core.loop.ir import INDEX, Cast, Const, Select, logical_and, logical_or
from compiler_core.te import compute, reduce_axis, reduce_sum


def _tables(ctx: KernelContext, node: Node, grams):
    """(tokens [P, longest], lengths [P], weights [P], n-gram of each output column or -1)."""
    longest = max(len(gram) for gram, _, _ in grams)
    tokens = np.zeros((len(grams), longest), np.int64)
    for p, (gram, _, _) in enumerate(grams):
        tokens[p, : len(gram)] = gram
    lengths = np.array([len(gram) for gram, _, _ in grams], np.int64)
    weights = np.array([weight for _, _, weight in grams], np.float32)
    column_gram = np.full(node.attr("size"), -1, np.int64)
    for p, (_, index, _) in enumerate(grams):
        if column_gram[index] >= 0:
            raise KernelError(f"node {node.name!r}: two counted n-grams share column {index}")
        column_gram[index] = p
    source = node.outputs[0]
    return (
        ctx.packed(source, "tfidf_tokens", tokens),
        ctx.packed(source, "tfidf_lengths", lengths),
        ctx.packed(source, "tfidf_weights", weights),
        ctx.packed(source, "tfidf_columns", column_gram),
    )


def _tfidf(ctx: KernelContext, node: Node):
    x = ctx.tensor(node.inputs[0])
    out = ctx.type(node.outputs[0])
    grams = counted_grams(node)
    if not grams:
        return [compute(out.shape, lambda *i: Const(0.0, out.dtype), ctx.stage_name(node))]
    tokens, lengths, weights, columns = _tables(ctx, node, grams)
    rows, length = (1, x.shape[0]) if len(x.shape) == 1 else x.shape
    longest = tokens.shape[1]
    k = reduce_axis(node.attr("max_skip_count") + 1, "rskip")
    s = reduce_axis(length, "rpos")

    def token(b, position):
        index = (clamp(position, length),) if len(x.shape) == 1 else (b, clamp(position, length))
        return Cast("int64", x[index])

    def count(b, p):
        n, step = lengths[(p,)], k + Const(1, INDEX)
        fits = (s + (n - Const(1, INDEX)) * step) < Const(length, INDEX)
        valid = logical_and(logical_or(k.equals(Const(0, INDEX)), n > Const(1, INDEX)), fits)
        for t in range(longest):
            same = token(b, s + Const(t, INDEX) * step).equals(tokens[(p, Const(t, INDEX))])
            valid = logical_and(valid, logical_or(Const(t, INDEX) >= n, same))
        return reduce_sum(Select(valid, Const(1.0, "float32"), Const(0.0, "float32")), [k, s])

    counts = compute((rows, len(grams)), count, ctx.stage_name(node, "counts"), "float32")
    mode = node.attr("mode")

    def value(*index):
        b = index[0] if len(index) == 2 else Const(0, INDEX)
        p = columns[(index[-1],)]
        c = counts[(b, clamp(p, len(grams)))]
        w = weights[(clamp(p, len(grams)),)]
        if mode == "TF":
            v = c
        elif mode == "IDF":
            v = Select(c > Const(0.0, "float32"), w, Const(0.0, "float32"))
        else:
            v = c * w
        return Select(p >= Const(0, INDEX), v, Const(0.0, "float32"))

    return [compute(out.shape, value, ctx.stage_name(node), out.dtype)]


KERNELS: dict[str, Builder] = {"TfIdfVectorizer": _tfidf}
