"""Text featurization: TfIdfVectorizer over integer token ids (string pools are out of scope:
Kiln has no string tensors).

Kiln's node carries the pool already split into its n-grams: `grams` (a tuple of token
tuples, unigrams first, as ONNX orders the pool), `indexes` (each n-gram's output column),
`weights` (each n-gram's IDF weight), `mode` ("TF", "IDF" or "TFIDF"), `min_gram_length`,
`max_gram_length`, `max_skip_count` and `size` (the output's columns). An n-gram of n tokens
occurs at position s with skip k when tokens s, s + (k + 1), ..., s + (n - 1)(k + 1) are its
tokens, for every k up to max_skip_count (a unigram: once per position). Only n-grams whose
length lies in [min_gram_length, max_gram_length] are counted.
"""

from __future__ import annotations

import numpy as np

from compiler_core.graph.ir import OpKind, TensorType
from compiler_core.graph.ops.base import OpDef, ShapeError, opdef

TOKEN_TYPES = ("int32", "int64")


def counted_grams(node) -> list[tuple[tuple[int, ...], int, float]]:
    """(tokens, output column, weight) of every n-gram whose length is counted."""
    low, high = node.attr("min_gram_length"), node.attr("max_gram_length")
    entries = zip(node.attr("grams"), node.attr("indexes"), node.attr("weights"), strict=True)
    return [(gram, index, weight) for gram, index, weight in entries if low <= len(gram) <= high]


def skips(length: int, max_skip_count: int) -> range:
    """The skips an n-gram of `length` tokens is counted at (a unigram has none)."""
    return range(max_skip_count + 1) if length > 1 else range(1)


def _tfidf_rule(node, types):
    (x,) = types
    if x.rank not in (1, 2) or x.dtype not in TOKEN_TYPES:
        raise ShapeError(f"input {x} must be [tokens] or [rows, tokens] of int32 or int64")
    size = node.attr("size")
    return [TensorType((size,) if x.rank == 1 else (x.shape[0], size), "float32")]


def tfidf_values(count: int, weight: float, mode: str) -> float:
    if mode == "TF":
        return float(count)
    if mode == "IDF":
        return weight if count else 0.0
    return count * weight


def _tfidf(node, inputs):
    """Counts by the definition: every position and skip of every counted n-gram."""
    x = inputs[0]
    rows = x.reshape(1, -1) if x.ndim == 1 else x
    out = np.zeros((rows.shape[0], node.attr("size")), np.float32)
    length = rows.shape[1]
    for gram, index, weight in counted_grams(node):
        n = len(gram)
        for b, row in enumerate(rows):
            count = 0
            for k in skips(n, node.attr("max_skip_count")):
                last = length - (n - 1) * (k + 1)
                for s in range(max(last, 0)):
                    count += all(row[s + t * (k + 1)] == gram[t] for t in range(n))
            out[b, index] += tfidf_values(count, weight, node.attr("mode"))
    return [out.reshape(-1) if x.ndim == 1 else out]


OPS: dict[str, OpDef] = {
    "TfIdfVectorizer": opdef("TfIdfVectorizer", OpKind.OPAQUE, _tfidf_rule, _tfidf),
}
