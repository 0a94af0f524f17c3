"""decompose_attention: a float Attention becomes MatMul / Softmax / MatMul and computes what
the Attention operator does (numpy reference executor on both graphs, and the compiled module
against the original graph), every output included; what the spec does not allow is refused
by name. Also the two kernel fixes it needed: a Softmax row with no allowed entry gives zeros
when told so, and the fast exp flushes to zero below FLT_MIN (exp(-inf) = 0, no subnormals)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import compiler_core
from compiler_core.compiler import compile_graph
from compiler_core.frontend.onnx import import_model
from compiler_core.graph.ops.base import ShapeError
from compiler_core.graph.verify import verify
from compiler_core.passes import decompose_attention
from compiler_core.passes.pipeline import optimize
from compiler_core.reference import run_graph
from compiler_core.runtime import load
from compiler_core.target import host_target
from tests.conftest import FLOAT, make_model

RNG = np.random.default_rng(5)
BOOL = TensorProto.BOOL


def attention_model(
    q, k, v, mask=None, mask_type=FLOAT, outputs=("y",), dtype=FLOAT, past=None, lengths=False,
    **attrs,
):  # fmt: skip
    inputs = [("q", dtype, q), ("k", dtype, k), ("v", dtype, v)]
    names = ["q", "k", "v"]
    if mask is not None:
        inputs.append(("mask", mask_type, mask))
        names.append("mask")
    if past is not None:  # [B, kv heads, past length, head size], K's and V's
        names += [""] * (4 - len(names)) + ["past_key", "past_value"]
        inputs += [("past_key", dtype, past[0]), ("past_value", dtype, past[1])]
    if lengths:  # nonpad_kv_seqlen: the valid keys of each batch in an external cache
        names += [""] * (6 - len(names)) + ["lengths"]
        inputs.append(("lengths", TensorProto.INT64, [q[0]]))
    node = helper.make_node("Attention", names, list(outputs), **attrs)
    # opset 25: the windows' attributes
    model = make_model([node], inputs, [(o, dtype, None) for o in outputs if o], opset=25)
    for value in model.graph.output:
        del value.type.tensor_type.shape.dim[:]
    return model


def feeds_for(graph, masked_row=None, lengths=None):
    feeds = {}
    for name in graph.inputs:
        t = graph.types[name]
        if name == "lengths":
            feeds[name] = np.asarray(lengths, np.int64)
        elif t.dtype == "bool":
            keep = RNG.random(t.shape) > 0.3
            if masked_row is not None:
                keep[..., masked_row, :] = False
            feeds[name] = keep
        else:
            feeds[name] = RNG.standard_normal(t.shape).astype(t.dtype)
    return feeds


def assert_decomposed_same(model, masked_row=None, rtol=1e-4, lengths=None, atol=None):
    """Decomposed, the reference executor computes every output as before, and so does the
    compiled module; the expected "y"."""
    atol = rtol / 10 if atol is None else atol
    before = import_model(model)
    after = decompose_attention.run(before)
    verify(after)
    assert not any(n.op == "Attention" for n in after.nodes)
    feeds = feeds_for(before, masked_row, lengths)
    expected = run_graph(before, feeds)
    decomposed = run_graph(after, feeds)
    native = load(compiler_core.compile(model.SerializeToString())).run(feeds)
    for name, value in expected.items():
        value = value.astype(np.float32)
        np.testing.assert_allclose(decomposed[name].astype(np.float32), value, rtol=rtol,
                                   atol=atol)  # fmt: skip
        np.testing.assert_allclose(native[name].astype(np.float32), value, rtol=rtol,
                                   atol=atol)  # fmt: skip
    return after, expected["y"]


def test_4d_with_grouped_heads_and_a_float_mask_is_two_matmuls_around_a_softmax():
    model = attention_model([2, 6, 5, 8], [2, 2, 7, 8], [2, 2, 7, 4], mask=[5, 7], scale=0.3)
    after, _ = assert_decomposed_same(model)
    ops = [n.op for n in after.nodes]
    assert ops.count("MatMul") == 2 and ops.count("Softmax") == 1
    # K and V are not repeated: each K/V head's 3 query heads are the rows of one GEMM (the
    # mask, the same for every head, is tiled for them).
    scores, values = (n for n in after.nodes if n.op == "MatMul")
    assert after.types[scores.inputs[0]].shape == (2, 2, 3 * 5, 8)
    assert values.inputs[1] == "v" and "Expand" not in ops
    assert after.types[next(n for n in after.nodes if n.op == "Tile").outputs[0]].shape == (
        1, 1, 15, 7,
    )  # fmt: skip


@pytest.mark.parametrize(
    "mask, mask_type",
    [([2, 6, 5, 7], BOOL), ([2, 6, 1, 7], FLOAT), ([6, 5, 7], FLOAT), ([1, 1, 5, 7], BOOL)],
)
def test_grouped_heads_fold_masks_of_every_shape_into_the_rows(mask, mask_type):
    """Per head, per head for every query, per head without a batch, shared: each made to
    match the grouped rows; with causal bounds and the qk_matmul output unfolded again."""
    model = attention_model(
        [2, 6, 5, 8], [2, 2, 7, 8], [2, 2, 7, 4], mask=mask, mask_type=mask_type, is_causal=1,
        outputs=("y", "", "", "qk"), qk_matmul_output_mode=2,
    )  # fmt: skip
    assert_decomposed_same(model)


@pytest.mark.parametrize("mode", [0, 2])
def test_a_decode_step_transposes_its_few_queries_and_not_the_keys(mode):
    """Four query rows per K/V head against 12 keys of 16: S^T = K Q^T, then S^T transposed
    (4 x 28 values moved, not 12 x 16); softcap, mask, key lengths and the qk output as ever."""
    model = attention_model(
        [2, 8, 1, 16], [2, 2, 12, 16], [2, 2, 12, 16], mask=[2, 1, 1, 12], lengths=True,
        outputs=("y", "", "", "qk"), qk_matmul_output_mode=mode, softcap=4.0, is_causal=1,
    )  # fmt: skip
    after, _ = assert_decomposed_same(model, lengths=[12, 7])
    scores = next(n for n in after.nodes if n.op == "MatMul")
    assert scores.inputs[0] == "k" and after.types[scores.outputs[0]].shape == (2, 2, 12, 4)


def test_3d_packed_heads_causal_with_fewer_queries_than_keys_and_a_soft_cap():
    model = attention_model(
        [1, 4, 24], [1, 6, 24], [1, 6, 12], q_num_heads=3, kv_num_heads=3, is_causal=1,
        softcap=2.5,
    )  # fmt: skip
    assert_decomposed_same(model)


def test_windows_and_a_boolean_mask_combine_and_a_fully_masked_row_gives_zeros():
    model = attention_model(
        [1, 2, 6, 8], [1, 2, 6, 8], [1, 2, 6, 8], mask=[1, 2, 6, 6], mask_type=BOOL,
        left_window_size=2, right_window_size=1,
    )  # fmt: skip
    after, expected = assert_decomposed_same(model, masked_row=3)
    softmax = next(n for n in after.nodes if n.op == "Softmax")
    assert softmax.attr("zero_empty_rows") == 1
    assert not np.isnan(expected).any() and np.all(expected[:, :, 3] == 0)


def test_float64_is_decomposed_too():
    assert_decomposed_same(attention_model([1, 2, 4, 8], [1, 2, 4, 8], [1, 2, 4, 8],
                                           dtype=TensorProto.DOUBLE))  # fmt: skip


def test_float16_is_computed_in_float32_and_cast_back():
    model = attention_model([1, 2, 4, 8], [1, 2, 6, 8], [1, 2, 6, 8], dtype=TensorProto.FLOAT16)
    # The reference rounds each step to float16 (the probabilities to ~1e-3 of themselves);
    # the decomposition computes in float32 and rounds once: a few float16 steps apart.
    after, _ = assert_decomposed_same(model, rtol=1e-2)
    softmax = next(n for n in after.nodes if n.op == "Softmax")
    assert after.types[softmax.outputs[0]].dtype == "float32"


def test_a_kv_cache_gives_the_present_outputs_and_shifts_the_causal_diagonal():
    model = attention_model(
        [1, 4, 3, 8], [1, 2, 3, 8], [1, 2, 3, 8], past=([1, 2, 5, 8], [1, 2, 5, 8]),
        outputs=("y", "present_key", "present_value"), is_causal=1,
    )  # fmt: skip
    after, _ = assert_decomposed_same(model)
    assert [n.op for n in after.nodes].count("Concat") == 2


@pytest.mark.parametrize("lengths", [[5, 2, 7], [3, 0, 1]])  # the second: rows left empty
@pytest.mark.parametrize("causal", [0, 1])
def test_key_lengths_per_batch_mask_the_padding_and_place_the_queries_at_the_end(lengths, causal):
    """An external cache (nonpad_kv_seqlen): batch b's keys past lengths[b] are padding, and
    its queries sit at positions lengths[b] - q_len + i (a negative offset leaves rows with
    no key: zeros)."""
    model = attention_model(
        [3, 4, 2, 8], [3, 2, 7, 8], [3, 2, 7, 4], lengths=True, is_causal=causal,
        left_window_size=3,
    )  # fmt: skip
    after, expected = assert_decomposed_same(model, lengths=lengths)
    assert not np.isnan(expected).any()
    assert next(n for n in after.nodes if n.op == "Softmax").attr("zero_empty_rows") == 1


def test_key_lengths_with_a_short_boolean_mask_for_one_query_each():
    """A decode step: one query a batch; the mask covers the first keys, the rest padded out."""
    model = attention_model(
        [2, 3, 1, 8], [2, 3, 6, 8], [2, 3, 6, 8], mask=[2, 3, 1, 4], mask_type=BOOL,
        lengths=True, is_causal=1,
    )  # fmt: skip
    after, _ = assert_decomposed_same(model, lengths=[6, 3])
    assert "Pad" in [n.op for n in after.nodes]


def test_a_float_mask_shorter_than_the_keys_disallows_the_keys_past_it():
    model = attention_model([1, 2, 4, 8], [1, 2, 6, 8], [1, 2, 6, 8], mask=[4, 5])
    assert_decomposed_same(model)


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", [FLOAT, TensorProto.FLOAT16])
def test_each_qk_matmul_output_mode_exposes_its_stage(mode, dtype):
    """Raw scores, soft-capped, masked (-inf where disallowed), probabilities: in the
    operator's type."""
    model = attention_model(
        [1, 2, 4, 8], [1, 2, 6, 8], [1, 2, 6, 8], mask=[4, 6], outputs=("y", "", "", "qk"),
        dtype=dtype, softcap=3.0, is_causal=1, qk_matmul_output_mode=mode,
    )  # fmt: skip
    # In float16 the scores and probabilities near 1 move in steps of 1e-3 (an ulp); an output
    # near 0 summed from them moves by a step when one of them rounds the other way.
    half = dtype == TensorProto.FLOAT16
    assert_decomposed_same(model, rtol=5e-3 if half else 1e-4, atol=2e-3 if half else None)


@pytest.mark.parametrize("precision", [TensorProto.DOUBLE, TensorProto.FLOAT16])
def test_a_softmax_precision_computes_the_softmax_in_that_type(precision):
    model = attention_model([1, 2, 4, 8], [1, 2, 6, 8], [1, 2, 6, 8], softmax_precision=precision)
    # The reference rounds every step of a float16 softmax (exp, sum, quotient); the kernel
    # rounds its input and output: a few float16 epsilons (1e-3) apart.
    after, _ = assert_decomposed_same(model, rtol=1e-4 if precision == TensorProto.DOUBLE else 1e-2)
    softmax = next(n for n in after.nodes if n.op == "Softmax")
    wanted = "float64" if precision == TensorProto.DOUBLE else "float16"
    assert after.types[softmax.outputs[0]].dtype == wanted


def test_bfloat16_is_computed_in_float32_and_cast_back():
    model = attention_model(
        [1, 4, 4, 8], [1, 2, 6, 8], [1, 2, 6, 8], dtype=TensorProto.BFLOAT16, is_causal=1
    )
    # The reference rounds each step to bfloat16 (8 bits of mantissa): a step or two apart,
    # and an output near 0 summed from values near 1 one such step (7.8e-3) off.
    after, _ = assert_decomposed_same(model, rtol=3e-2, atol=1e-2)
    softmax = next(n for n in after.nodes if n.op == "Softmax")
    assert after.types[softmax.outputs[0]].dtype == "float32"


@pytest.mark.parametrize(
    "why", ["half a cache", "key lengths and a past cache", "long mask", "integer softmax"]
)
def test_what_the_spec_does_not_allow_is_refused_by_name(why):
    shapes = ([1, 2, 4, 8], [1, 2, 6, 8], [1, 2, 6, 8])
    extra = {"past": ([1, 2, 5, 8], [1, 2, 5, 8]), "lengths": why == "key lengths and a past cache"}
    if why == "long mask":  # 5 past and 6 new keys
        extra["mask"] = [4, 12]
    if why == "integer softmax":
        extra["softmax_precision"] = TensorProto.INT32
    model = attention_model(*shapes, **extra)
    if why == "half a cache":  # the past value left out
        model.graph.node[0].input[5] = ""
        model.graph.input.remove(model.graph.input[-1])
    wanted = {
        "half a cache": "come together",
        "key lengths and a past cache": "cannot be combined",
        "long mask": "covers more keys than the 11",
        "integer softmax": "computes in a float type",
    }[why]
    with pytest.raises(ShapeError, match=f"node 'Attention'.*{wanted}"):
        import_model(model)


def softmax_module(shape, axis, zero_empty_rows):
    node = helper.make_node("Softmax", ["x"], ["y"], axis=axis)
    graph = import_model(make_model([node], [("x", FLOAT, shape)], [("y", FLOAT, shape)]))
    (softmax,) = graph.nodes
    patched = softmax.replace(attrs=(*softmax.attrs, ("zero_empty_rows", zero_empty_rows)))
    graph = graph.replace(nodes=(patched,))
    return graph, load(compile_graph(optimize(graph), host_target()))


@pytest.mark.parametrize("axis", [-1, 1])  # the row kernel, and the general one
def test_softmax_told_so_gives_zeros_for_a_row_of_minus_infinity(axis):
    x = RNG.standard_normal((3, 20, 20)).astype(np.float32)
    x[1, :, 4] = x[1, 4, :] = -np.inf  # a whole row along either axis
    x[2, 0:10, 7] = x[2, 7, 0:10] = -np.inf  # part of one: an ordinary softmax
    graph, module = softmax_module([3, 20, 20], axis, 1)
    expected = run_graph(graph, {"x": x})["y"]
    assert not np.isnan(expected).any()
    np.testing.assert_allclose(module.run({"x": x})["y"], expected, rtol=1e-5, atol=1e-7)
    _, plain = softmax_module([3, 20, 20], axis, 0)
    assert np.isnan(plain.run({"x": x})["y"]).any()  # without it: NaN, as ONNX Softmax gives


def fast_exp(x):
    node = helper.make_node("Exp", ["x"], ["y"])
    model = make_model([node], [("x", FLOAT, list(x.shape))], [("y", FLOAT, list(x.shape))])
    return load(compiler_core.compile(model.SerializeToString())).run({"x": x})["y"]


def test_fast_exp_flushes_below_flt_min_and_keeps_nan():
    # Down to -86.99 every form keeps e^x (the AVX-512 one down to ln(FLT_MIN), -87.34).
    x = np.array([-np.inf, -100.0, -87.34, -86.9, 0.0, 10.0, np.nan, 1.0] * 2, np.float32)
    y = fast_exp(x)
    assert np.all(y[:3] == 0) and np.isnan(y[6])
    tiny = np.finfo(np.float32).tiny
    assert not np.any((y != 0) & (np.abs(y) < tiny))  # no subnormal result
    np.testing.assert_allclose(y[[3, 4, 5, 7]], np.exp(x[[3, 4, 5, 7]]), rtol=1e-5)


def test_fast_exp_is_finite_up_to_ln_flt_max_and_inf_past_it():
    # Between 127.5 ln2 (88.38) and ln(FLT_MAX) (88.72) 2^n alone would overflow.
    finite = np.array([88.0, 88.38, 88.4, 88.5, 88.6, 88.7, 88.72, 50.0] * 2, np.float32)
    y = fast_exp(finite)
    assert np.all(np.isfinite(y))
    np.testing.assert_allclose(y, np.exp(finite.astype(np.float64)), rtol=3e-5)
    overflow = np.array([88.73, 88.75, 89.0, 100.0, 1e30, np.inf, 88.8, 1000.0] * 2, np.float32)
    assert np.all(fast_exp(overflow) == np.inf)


def random_attention(rng):
    """One Attention drawn at random: grouped heads, 3-D or 4-D, causal, windows, softcap,
    a float or boolean mask of any broadcast shape (possibly short), key lengths or a past
    cache, a qk output of any mode; and its key lengths per batch (None without)."""

    def pick(options):
        return options[int(rng.integers(len(options)))]

    kv_heads, group = pick([1, 2, 3]), pick([1, 2, 4])
    batch, heads, queries = pick([1, 2]), kv_heads * group, pick([1, 2, 5])
    keys, size = pick([3, 6, 9]), pick([4, 8])
    attrs = {"is_causal": pick([0, 1])}
    if rng.random() < 0.3:
        attrs["left_window_size"] = pick([0, 1, 3])
    if rng.random() < 0.3:
        attrs["right_window_size"] = pick([0, 2])
    if rng.random() < 0.3:
        attrs["softcap"] = 2.0
    three_d, lengths = rng.random() < 0.3, rng.random() < 0.4
    past = None
    if not (three_d or lengths) and rng.random() < 0.4:
        cached = pick([2, 4])
        past = ([batch, kv_heads, cached, size], [batch, kv_heads, cached, size])
    total = keys + (past[0][2] if past else 0)
    extra = {}
    if rng.random() < 0.6:
        last = total - 1 if rng.random() < 0.2 else total
        shapes = [[queries, last], [batch, 1, queries, last], [batch, heads, queries, last],
                  [heads, queries, last], [1, heads, 1, last]]  # fmt: skip
        extra = {"mask": pick(shapes), "mask_type": pick([FLOAT, BOOL])}
    if rng.random() < 0.4:
        extra["outputs"] = ("y", "", "", "qk")
        attrs["qk_matmul_output_mode"] = pick([0, 1, 2, 3])
    if three_d:
        attrs.update(q_num_heads=heads, kv_num_heads=kv_heads)
        shapes = [batch, queries, heads * size], [batch, keys, kv_heads * size]
        q, k, v = shapes[0], shapes[1], shapes[1]
    else:
        q, k, v = [batch, heads, queries, size], [batch, kv_heads, keys, size], None
        v = k
    model = attention_model(q, k, v, past=past, lengths=lengths, **extra, **attrs)
    return model, ([pick(range(keys + 1)) for _ in range(batch)] if lengths else None)


@pytest.mark.parametrize("seed", range(40))
def test_random_attentions_decompose_to_what_the_operator_computes(seed):
    """The decomposed graph against the operator's reference, every output (the reference
    executor on both graphs: no compile)."""
    model, lengths = random_attention(np.random.default_rng(seed))
    before = import_model(model)
    after = decompose_attention.run(before)
    assert not any(n.op == "Attention" for n in after.nodes)
    feeds = feeds_for(before, lengths=lengths)
    expected, actual = run_graph(before, feeds), run_graph(after, feeds)
    for name, value in expected.items():
        np.testing.assert_allclose(actual[name], value, rtol=1e-4, atol=1e-5, err_msg=name)


def _score_matmuls(graph):
    """The key count of each score MatMul (Q K^T: its B operand's last axis)."""
    return [
        graph.types[n.inputs[1]].shape[-1]
        for n in graph.nodes
        if n.op == "MatMul" and n.name.startswith("Attention_scores")
    ]


@pytest.mark.parametrize(
    ("shapes", "attrs", "keys_read"),
    [
        # 256 queries of 256 keys: four blocks of 64, each up to its last query's key
        (([1, 2, 256, 8], [1, 2, 256, 8], [1, 2, 256, 4]), {}, [64, 128, 192, 256]),
        # grouped heads, packed 3-D: 130 queries in two blocks (65 rows: a block's rows need
        # not fill register tiles evenly)
        (
            ([1, 130, 32], [1, 130, 16], [1, 130, 16]),
            {"q_num_heads": 4, "kv_num_heads": 2},
            [65, 130],
        ),  # fmt: skip
        # a window (and a soft cap): the second block starts 16 keys before its first query
        (
            ([1, 1, 128, 8], [1, 1, 128, 8], [1, 1, 128, 8]),
            {"left_window_size": 16, "softcap": 3.0},
            [64, 80],
        ),
        # a window both ways, not causal: each block reads its rows' keys and 24 more around
        (
            ([1, 2, 256, 8], [1, 2, 256, 8], [1, 2, 256, 8]),
            {"is_causal": 0, "left_window_size": 16, "right_window_size": 8},
            [72, 88, 88, 80],
        ),  # fmt: skip
    ],
)
def test_causal_and_windowed_attention_reads_only_the_keys_each_query_block_may_attend(
    shapes, attrs, keys_read
):
    model = attention_model(*shapes, **{"is_causal": 1, **attrs})
    after, _ = assert_decomposed_same(model)
    assert _score_matmuls(after) == keys_read
    assert [n.op for n in after.nodes].count("Softmax") == len(keys_read)


def test_causal_blocks_after_a_kv_cache_start_past_the_cached_keys():
    """192 new queries after 64 cached keys: the first block sees the cache and its own 64."""
    model = attention_model(
        [1, 2, 192, 8], [1, 2, 192, 8], [1, 2, 192, 8], past=([1, 2, 64, 8], [1, 2, 64, 8]),
        outputs=("y", "present_key", "present_value"), is_causal=1,
    )  # fmt: skip
    after, _ = assert_decomposed_same(model)
    assert _score_matmuls(after) == [128, 192, 256]


@pytest.mark.parametrize(
    "case",
    ["boolean mask", "key lengths", "qk output", "few queries", "not causal"],
)
def test_attention_stays_whole_where_a_block_would_not_pay_or_needs_every_score(case):
    shape = [1, 2, 256, 8]
    extra = {"is_causal": 1}
    if case == "boolean mask":
        extra.update(mask=[256, 256], mask_type=BOOL)
    elif case == "key lengths":
        extra["lengths"] = True
    elif case == "qk output":
        extra.update(outputs=("y", "", "", "qk"), qk_matmul_output_mode=0)
    elif case == "few queries":  # one block of 64 rows or more only
        shape = [1, 2, 127, 8]
    else:
        extra["is_causal"] = 0
    after = decompose_attention.run(import_model(attention_model(shape, shape, shape, **extra)))
    assert _score_matmuls(after) == [shape[2]]


def constant_mask_model(mask: np.ndarray, shape=(1, 2, 256, 8)):
    """An Attention whose mask is an initializer (a mask built from constants is one after
    fold_constants), not causal by attribute."""
    node = helper.make_node("Attention", ["q", "k", "v", "mask"], ["y"])
    inputs = [(name, FLOAT, list(shape)) for name in ("q", "k", "v")]
    return make_model([node], inputs, [("y", FLOAT, list(shape))], {"mask": mask}, opset=25)


CAUSAL_256 = np.tril(np.ones((256, 256), bool))


@pytest.mark.parametrize(
    ("mask", "keys_read"),
    [
        (CAUSAL_256, [64, 128, 192, 256]),  # boolean
        (np.where(CAUSAL_256, 0.0, -np.inf).astype(np.float32)[None, None], [64, 128, 192, 256]),
        (CAUSAL_256[:, :200], [64, 128, 192, 200]),  # short: the keys past it disallowed
        # a float mask with other values is a bias, and one per head is no pattern to skip by
        (np.where(CAUSAL_256, 0.5, -np.inf).astype(np.float32), [256]),
        (np.stack([CAUSAL_256, CAUSAL_256.T])[None], [256]),
    ],
)
def test_a_constant_mask_the_same_for_every_head_skips_keys_as_is_causal_does(mask, keys_read):
    after, _ = assert_decomposed_same(constant_mask_model(mask))
    assert _score_matmuls(after) == keys_read
