"""Converters for text featurization: TfIdfVectorizer over integer token ids."""

from __future__ import annotations

from compiler_core.frontend.common import KilnImportError, UnsupportedError
from compiler_core.frontend.convert_utils import Converter

MODES = ("TF", "IDF", "TFIDF")


def pool_grams(counts, pool) -> list[tuple[int, ...]]:
    """The pool split into its n-grams: `counts[n - 1]` is where the n-grams start, each
    n tokens long, up to where the next length starts (or the pool ends)."""
    starts = [*counts, len(pool)]
    grams = []
    for n, (begin, end) in enumerate(zip(starts, starts[1:], strict=False), start=1):
        if begin > end or (end - begin) % n:
            raise KilnImportError(
                f"ngram_counts {list(counts)}: the {n}-grams span {end - begin} tokens of the "
                "pool, not whole n-grams"
            )
        grams += [tuple(pool[i : i + n]) for i in range(begin, end, n)]
    return grams


def convert_tfidf_vectorizer(ctx, node, attrs):
    if attrs.has("pool_strings"):
        raise UnsupportedError(f"node {node.name!r}: TfIdfVectorizer over strings")
    mode = attrs.get("mode")
    if mode not in MODES:
        raise KilnImportError(f"node {node.name!r}: mode {mode!r} is not one of {MODES}")
    grams = pool_grams(list(attrs.get("ngram_counts")), list(attrs.get("pool_int64s")))
    indexes = tuple(int(i) for i in attrs.get("ngram_indexes"))
    weights = tuple(float(w) for w in (attrs.get("weights") or [1.0] * len(grams)))
    if len(indexes) != len(grams) or len(weights) != len(grams):
        raise KilnImportError(
            f"node {node.name!r}: {len(grams)} n-grams in the pool, {len(indexes)} "
            f"ngram_indexes and {len(weights)} weights"
        )
    if min(indexes, default=0) < 0:
        raise KilnImportError(f"node {node.name!r}: negative ngram_indexes {list(indexes)}")
    low, high = attrs.get("min_gram_length"), attrs.get("max_gram_length")
    if not 1 <= low <= high:
        raise KilnImportError(f"node {node.name!r}: gram lengths {low}..{high}")
    ctx.emit(
        "TfIdfVectorizer",
        [node.input[0]],
        [node.output[0]],
        grams=tuple(grams),
        indexes=indexes,
        weights=weights,
        mode=mode,
        min_gram_length=low,
        max_gram_length=high,
        max_skip_count=attrs.get("max_skip_count"),
        size=max(indexes, default=-1) + 1,
    )


CONVERTERS: dict[str, dict[int, Converter]] = {
    "TfIdfVectorizer": {9: convert_tfidf_vectorizer},
}
