"""TfIdfVectorizer over integer token ids: the native kernel against the numpy reference
executor and against counts worked out by hand, every mode, skips, n-grams of three tokens,
lengths outside the counted range; bad pools get clear import errors."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import compiler_core
from compiler_core.frontend.common import KilnImportError, UnsupportedError
from compiler_core.frontend.onnx import import_model
from compiler_core.reference import run_graph
from compiler_core.runtime import load
from tests.conftest import make_model

INT64 = TensorProto.INT64


def tfidf_model(shape, dtype=INT64, **attrs):
    columns = max(attrs["ngram_indexes"]) + 1
    out_shape = [columns] if len(shape) == 1 else [shape[0], columns]
    node = helper.make_node("TfIdfVectorizer", ["x"], ["y"], name="tfidf", **attrs)
    return make_model([node], [("x", dtype, list(shape))], [("y", TensorProto.FLOAT, out_shape)])


# Unigrams 2, 3; bigrams (3, 4), (4, 2); a trigram (2, 3, 4).
POOL = {"ngram_counts": [0, 2, 6], "pool_int64s": [2, 3, 3, 4, 4, 2, 2, 3, 4]}
X = np.array([[2, 3, 4, 2, 3, 4, 9, 3], [4, 9, 2, 9, 9, 3, 9, 4]], np.int64)


def run_native(model, x):
    return load(compiler_core.compile(model)).run({"x": x})["y"]


@pytest.mark.parametrize("mode", ["TF", "IDF", "TFIDF"])
def test_every_mode_against_counts_worked_by_hand(mode):
    weights = [0.5, 1.5, 2.0, 3.0, 4.0]
    model = tfidf_model(
        X.shape,
        mode=mode,
        min_gram_length=1,
        max_gram_length=3,
        max_skip_count=1,
        ngram_indexes=[4, 3, 2, 1, 0],
        weights=weights,
        **POOL,
    )
    # Row 0, [2 3 4 2 3 4 9 3]: 2 at 0 and 3; 3 at 1, 4 and 7; (3, 4) at 1-2 and 4-5 (skip 0);
    # (4, 2) at 2-3; (2, 3, 4) at 0-1-2 and 3-4-5. Nothing more at skip 1.
    # Row 1, [4 9 2 9 9 3 9 4]: 2 at 2; 3 at 5; (3, 4) at 5-7 and (4, 2) at 0-2, both at
    # skip 1; no trigram.
    counts = np.array([[2, 3, 2, 1, 2], [1, 1, 1, 1, 0]], np.float32)
    w = np.array(weights, np.float32)
    per_gram = {"TF": counts, "IDF": (counts > 0) * w, "TFIDF": counts * w}[mode]
    expected = per_gram[:, ::-1]  # n-gram p goes to column 4 - p
    np.testing.assert_allclose(run_native(model, X), expected, rtol=1e-6)
    (reference,) = run_graph(import_model(model), {"x": X}).values()
    np.testing.assert_allclose(reference, expected, rtol=1e-6)


def test_lengths_outside_the_range_count_nothing_and_one_row_is_one_vector():
    """Only bigrams counted (unigram and trigram columns stay 0), a 1-D int32 input, wider
    skips than the row."""
    model = tfidf_model(
        (8,),
        dtype=TensorProto.INT32,
        mode="TF",
        min_gram_length=2,
        max_gram_length=2,
        max_skip_count=9,
        ngram_indexes=[0, 1, 2, 3, 4],
        **POOL,
    )
    x = X[0].astype(np.int32)
    out = run_native(model, x)
    (reference,) = run_graph(import_model(model), {"x": x}).values()
    np.testing.assert_array_equal(out, reference)
    # (3, 4): pairs (1,2) (1,5) (4,5); (4, 2): (2,3).
    np.testing.assert_array_equal(out, [0, 0, 3, 1, 0])


def test_a_string_pool_is_not_supported():
    node = helper.make_node(
        "TfIdfVectorizer",
        ["x"],
        ["y"],
        mode="TF",
        min_gram_length=1,
        max_gram_length=1,
        max_skip_count=0,
        ngram_counts=[0],
        ngram_indexes=[0],
        pool_strings=["a"],
    )
    model = make_model([node], [("x", INT64, [4])], [("y", TensorProto.FLOAT, [1])])
    with pytest.raises(UnsupportedError, match="TfIdfVectorizer over strings"):
        import_model(model)


@pytest.mark.parametrize(
    ("counts", "indexes", "message"),
    [
        # 3 unigrams, then 5 tokens: not whole bigrams.
        ([0, 3], [0, 1, 2, 3], "the 2-grams span 5 tokens of the pool, not whole n-grams"),
        # 1 unigram and 4 bigrams, but 2 columns for them.
        ([0, 1], [0, 1], "5 n-grams in the pool, 2 ngram_indexes"),
    ],
)
def test_a_pool_that_does_not_split_into_its_ngrams_is_refused(counts, indexes, message):
    attrs = {"ngram_counts": counts, "pool_int64s": [1, 2, 3, 4, 5, 6, 7, 8, 9]}
    if counts == [0, 3]:
        attrs["pool_int64s"] = attrs["pool_int64s"][:8]
    model = tfidf_model(
        (4,),
        mode="TF",
        min_gram_length=1,
        max_gram_length=2,
        max_skip_count=0,
        ngram_indexes=indexes,
        **attrs,
    )
    with pytest.raises(KilnImportError, match=message):
        import_model(model)
