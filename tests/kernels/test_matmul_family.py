"""MatMul and Gemm at any size, native code against ONNX Runtime: ragged rows and columns
(partial register tiles), both operands activations (B packed at run time, a transpose
folded into the packing), broadcast batch dimensions, Gemm's transposes and constant or
activation B, epilogues folded into a cropped tile; and every value of every knob of the
dense template on a ragged batched product."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import compiler_core
from compiler_core.autotune.tasks import extract_tasks
from compiler_core.frontend.onnx import import_model
from compiler_core.kernels.schedules import gemm_row_tile
from compiler_core.passes.pipeline import optimize
from compiler_core.runtime import load
from compiler_core.schedule.primitives import SplitOverlap
from compiler_core.target import parse_target
from tests.conftest import (
    FLOAT,
    assert_close_to_scale,
    make_model,
    measurement_errors,
    one_knob_off_default,
)

INT32 = TensorProto.INT32

RNG = np.random.default_rng(11)


def w(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def check(model, feeds):
    """Native output (2 threads) against ONNX Runtime, for every output."""
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = session.run(None, feeds)
    module = load(compiler_core.compile(model), num_threads=2)
    actual = module.run(feeds)
    for info, want in zip(model.graph.output, expected, strict=True):
        assert_close_to_scale(actual[info.name], want, label=info.name)


def matmul_model(a_shape, b_shape, b_constant=False, epilogue=False):
    out = list(np.matmul(np.zeros(a_shape), np.zeros(b_shape)).shape)
    nodes = [helper.make_node("MatMul", ["a", "b"], ["y"])]
    inputs = [("a", FLOAT, list(a_shape))]
    weights = {"b": w(*b_shape)} if b_constant else {}
    if not b_constant:
        inputs.append(("b", FLOAT, list(b_shape)))
    result = "y"
    if epilogue:  # bias + relu, fused into the product's group
        weights["bias"] = w(b_shape[-1])
        nodes += [
            helper.make_node("Add", ["y", "bias"], ["s"]),
            helper.make_node("Relu", ["s"], ["z"]),
        ]
        result = "z"
    model = make_model(nodes, inputs, [(result, FLOAT, out)], weights)
    feeds = {"a": w(*a_shape)}
    if not b_constant:
        feeds["b"] = w(*b_shape)
    return model, feeds


# Rows 1, 7, 13, 49, 197 (one tile, partial tiles, a prime); K 1, 5, 64; N 3, 17, 197 (fewer
# columns than a panel, one panel of all, padded panels).
BATCHED = [
    (1, 1, 3),
    (7, 5, 17),
    (13, 64, 3),
    (49, 5, 197),
    (197, 64, 17),
    (13, 1, 197),
    (1, 64, 197),
    (49, 64, 40),
]


@pytest.mark.parametrize(("m", "k", "n"), BATCHED, ids=[f"{m}x{k}x{n}" for m, k, n in BATCHED])
def test_batched_matmul_of_two_activations(m, k, n):
    check(*matmul_model([3, m, k], [3, k, n]))


@pytest.mark.parametrize(
    ("a_shape", "b_shape"),
    [
        ([2, 1, 7, 5], [3, 5, 17]),  # both batch dims broadcast
        ([7, 5], [3, 5, 37]),  # a 2-D A against every batch of B
        ([2, 13, 64], [64, 19]),  # a 2-D activation B shared by the batches
        ([4, 1, 9], [4, 9, 33]),  # one row per batch
    ],
)
def test_broadcast_batch_dimensions(a_shape, b_shape):
    check(*matmul_model(a_shape, b_shape))


@pytest.mark.parametrize("m", [7, 49, 197])
@pytest.mark.parametrize("n", [17, 40, 197])
def test_ragged_rows_and_columns_with_a_constant_weight_and_an_epilogue(m, n):
    check(*matmul_model([m, 24], [24, n], b_constant=True, epilogue=True))


@pytest.mark.parametrize("b_constant", [True, False], ids=["constant_b", "activation_b"])
@pytest.mark.parametrize("trans_a", [0, 1])
@pytest.mark.parametrize("trans_b", [0, 1])
def test_gemm_transposes(trans_a, trans_b, b_constant):
    m, k, n = 13, 9, 37
    a_shape = [k, m] if trans_a else [m, k]
    b_shape = [n, k] if trans_b else [k, n]
    attrs = {"transA": trans_a, "transB": trans_b, "alpha": 0.5, "beta": 2.0}
    node = helper.make_node("Gemm", ["a", "b", "c"], ["y"], **attrs)
    inputs = [("a", FLOAT, a_shape)] + ([] if b_constant else [("b", FLOAT, b_shape)])
    weights = {"c": w(n)} | ({"b": w(*b_shape)} if b_constant else {})
    model = make_model([node], inputs, [("y", FLOAT, [m, n])], weights)
    feeds = {"a": w(*a_shape)} | ({} if b_constant else {"b": w(*b_shape)})
    check(model, feeds)


@pytest.mark.parametrize("perm", [[0, 2, 1], [0, 1, 3, 2]], ids=["3d", "4d"])
def test_attention_scores_with_a_transposed_key(perm):
    """Q.K^T as attention writes it: the Transpose feeding the MatMul is folded into the
    packing of B."""
    shape = [3, 13, 8] if len(perm) == 3 else [2, 3, 13, 8]
    out = [*shape[:-1], shape[-2]]
    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], perm=perm),
        helper.make_node("MatMul", ["q", "kt"], ["y"]),
    ]
    model = make_model(nodes, [("q", FLOAT, shape), ("k", FLOAT, shape)], [("y", FLOAT, out)])
    check(model, {"q": w(*shape), "k": w(*shape)})


@pytest.mark.parametrize("n", [37, 77], ids=["one_panel", "tail_tiles"])
def test_every_knob_value_of_the_dense_template_on_a_ragged_batch(n):
    """The default config and every other value of each knob, one at a time (the whole space
    is the tuner tests' business), against the reference answer. 77 columns leave a tail
    tile after whole tiles of every width (13 after 64, 5 after 72, 1 after 76)."""
    model, _ = matmul_model([2, 13, 5], [2, 5, n])
    (task,) = extract_tasks(optimize(import_model(model)))
    knobs = task.tunable.knobs
    assert {k.name for k in knobs} >= {"mr", "nr", "order", "parallel", "pack"}
    errors = measurement_errors(task, one_knob_off_default(task.tunable))
    assert not errors, errors[:3]


@pytest.mark.parametrize(
    "c_shape", [[13, 1], [1], [], [13, 37]], ids=["column", "one", "scalar", "full"]
)
def test_gemm_bias_broadcasts_into_the_cropped_store(c_shape):
    m, k, n = 13, 9, 37
    node = helper.make_node("Gemm", ["a", "b", "c"], ["y"], beta=0.5)
    model = make_model(
        [node],
        [("a", FLOAT, [m, k]), ("c", FLOAT, c_shape)],
        [("y", FLOAT, [m, n])],
        {"b": w(k, n)},
    )
    check(model, {"a": w(m, k), "c": w(*c_shape)})


def test_a_residual_read_in_the_epilogue_of_a_ragged_tile():
    """The last column tile's store is masked, and so is its read of the residual."""
    nodes = [
        helper.make_node("MatMul", ["a", "b"], ["y"]),
        helper.make_node("Add", ["y", "r"], ["z"]),
    ]
    inputs = [("a", FLOAT, [2, 49, 24]), ("r", FLOAT, [2, 49, 37])]
    model = make_model(nodes, inputs, [("z", FLOAT, [2, 49, 37])], {"b": w(24, 37)})
    check(model, {"a": w(2, 49, 24), "r": w(2, 49, 37)})


def test_integer_matmul_with_ragged_tiles():
    node = helper.make_node("MatMul", ["a", "b"], ["y"])
    model = make_model(
        [node],
        [("a", INT32, [2, 13, 5]), ("b", INT32, [2, 5, 37])],
        [("y", INT32, [2, 13, 37])],
    )
    rng = np.random.default_rng(3)
    feeds = {
        "a": rng.integers(-9, 9, (2, 13, 5)).astype(np.int32),
        "b": rng.integers(-9, 9, (2, 5, 37)).astype(np.int32),
    }
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (expected,) = session.run(None, feeds)
    actual = load(compiler_core.compile(model), num_threads=2).run(feeds)["y"]
    np.testing.assert_array_equal(actual, expected)


@pytest.mark.parametrize(
    ("a_shape", "b_shape", "b_constant"),
    [
        ([24], [24, 37], True),  # a dense layer at batch 1, ragged columns
        ([24], [24, 48], True),
        ([9], [3, 9, 17], False),  # against every batch of an activation B
        ([13, 24], [24], True),  # matrix times vector
        ([2, 13, 24], [24], False),
    ],
)
def test_products_with_a_vector_operand(a_shape, b_shape, b_constant):
    check(*matmul_model(a_shape, b_shape, b_constant=b_constant))


@pytest.mark.parametrize("a_shape", [(37, 1, 24), (3, 5, 2, 24)])
def test_batched_a_times_a_constant_b_is_one_gemm_over_all_rows(a_shape):
    """PyTorch attention's QKV projection, [197, 1, 768] @ [768, 2304], in small: the import
    flattens A's rows into one GEMM (not 37 one-row products) and reshapes the result back."""
    node = helper.make_node("MatMul", ["a", "b"], ["y"])
    out = [*a_shape[:-1], 40]
    model = make_model([node], [("a", FLOAT, list(a_shape))], [("y", FLOAT, out)], {"b": w(24, 40)})
    graph = import_model(model)
    (matmul,) = [n for n in graph.nodes if n.op == "MatMul"]
    assert graph.types[matmul.outputs[0]].shape == (int(np.prod(a_shape[:-1])), 40)
    check(model, {"a": w(*a_shape)})


def test_a_batched_b_stays_a_batched_matmul():
    node = helper.make_node("MatMul", ["a", "b"], ["y"])
    model = make_model(
        [node], [("a", FLOAT, [4, 3, 8])], [("y", FLOAT, [4, 3, 5])], {"b": w(4, 8, 5)}
    )
    (matmul,) = [n for n in import_model(model).nodes if n.op == "MatMul"]
    assert len(matmul.inputs) == 2 and matmul.outputs == ("y",)
    check(model, {"a": w(4, 3, 8)})


@pytest.mark.parametrize(
    ("a_shape", "b_shape"),
    [([3, 13, 64], [3, 64, 40]), ([2, 7, 5], [1, 5, 197]), ([2, 2, 9, 24], [2, 1, 24, 33])],
    ids=["per_batch", "broadcast_b", "4d_broadcast"],
)
def test_a_constant_batched_b_is_packed_into_panels_at_build_time(a_shape, b_shape):
    """Each matrix of a constant [..., K, N] B becomes panels once, when the module is built:
    the kernel has no packing stage (it used to pack B on every run)."""
    model, feeds = matmul_model(a_shape, b_shape, b_constant=True, epilogue=True)
    graph = optimize(import_model(model))
    (task,) = extract_tasks(graph, parse_target("llvm"))
    stages = [s.name for s in task.lowered.stages]
    assert not any(name.startswith("pack") for name in stages), stages
    check(model, feeds)


def test_a_few_columns_are_one_panel_of_whole_vectors():
    """N = 10 on 8 lanes: one panel of 16 zero-padded columns (two whole vectors, cropped by
    the epilogue), not a 10-lane vector; N = 3 one vector; a multiple of two vectors or a wide
    N keeps two-vector panels."""
    from compiler_core.kernels.nn import panel_width

    assert [panel_width(n, 8) for n in (10, 3, 24, 32, 40, 1000)] == [16, 8, 24, 16, 16, 16]
    assert panel_width(10, 16) == 16


def test_row_tiles_of_a_with_rows_4kb_apart_fit_one_l1_set():
    """A's rows 4 KB apart (K = 1024 floats) share an L1 set: a register tile streams at most
    the set's ways less two of them (6 on Zen 4, 10 on Zen 5); rows of 3136 bytes keep the
    register budget's tile. Within the budget, the tile that pads the rows least."""
    # 32 zmm registers, L1 8 ways (named with its features: on another host, a CPU's name
    # alone keeps none of them)
    target = parse_target("llvm -mcpu=znver4 -mattr=+avx512f")
    assert gemm_row_tile(64, target) == 8  # 14 accumulator rows at most: 8 x 8, no padding
    assert gemm_row_tile(65, target) == 13  # 5 x 13
    assert gemm_row_tile(49, target) == 7
    assert gemm_row_tile(64, target, row_bytes=4096) == 4
    assert gemm_row_tile(64, target, row_bytes=8192) == 4
    assert gemm_row_tile(64, target, row_bytes=2048) == 8  # two set offsets: 12 rows at most
    assert gemm_row_tile(65, target, row_bytes=3136) == 13
    zen5 = parse_target("llvm -mcpu=znver5 -mattr=+avx512f")  # L1 12 ways
    assert zen5.l1_ways == 12 and target.l1_ways == 8
    assert gemm_row_tile(1024, zen5, row_bytes=4096) == 8
    assert gemm_row_tile(1024, target, row_bytes=4096) == 4
    model = make_model(
        [helper.make_node("Gemm", ["x", "w"], ["y"])],
        [("x", FLOAT, [64, 1024])],
        [("y", FLOAT, [64, 256])],
        {"w": RNG.standard_normal((1024, 256)).astype(np.float32)},
    )
    (task,) = extract_tasks(optimize(import_model(model), target=target), target)
    assert task.default_config()["mr"] == 4


def test_a_server_core_reported_under_a_client_name_gets_server_rates():
    """KVM may report a Xeon (AMX, 512-bit FMAs at full rate) as model 167, which LLVM names
    rocketlake: AMX, found only on Intel's server cores, tells it apart from a real Rocket
    Lake (one fused 512-bit pipe), whose L1 has 12 ways all the same."""
    server = parse_target("llvm -mcpu=rocketlake -mattr=+avx512f,+amx-tile")
    client = parse_target("llvm -mcpu=rocketlake -mattr=+avx512f")
    assert (server.fma_lanes, server.l1_ways) == (16, 12)
    assert (client.fma_lanes, client.l1_ways) == (8, 12)
    zen4 = parse_target("llvm -mcpu=znver4 -mattr=+avx512f")
    assert (zen4.fma_lanes, zen4.l1_ways) == (8, 8)


@pytest.mark.parametrize(
    ("m", "k", "n", "order"),
    [
        (1024, 1024, 1024, "ji"),  # B (4 MB) re-read per 8-row tile: stream A per panel
        (3136, 576, 64, "ij"),  # an im2col conv: B (144 KB) stays in L2, A streams once
        (128, 64, 1024, "ji"),  # more columns than rows
        (256, 256, 256, "ij"),  # B (256 KB) stays in L2
    ],
)
def test_the_default_tile_order_streams_the_operand_re_read_least(m, k, n, order):
    target = parse_target("llvm -mcpu=znver4 -mattr=+avx512f")
    model, _ = matmul_model([m, k], [k, n], b_constant=True)
    (task,) = extract_tasks(optimize(import_model(model), target=target), target)
    assert task.default_config()["order"] == order


def test_ragged_columns_are_whole_tiles_and_a_narrow_tail_not_padding():
    """ViT's Q.K^T, 197 columns of an activation B: the GEMM reads B where it lies (no
    packing pass, no padded columns) in six tiles of 32 and one of 8 that ends at column 196
    (it overlaps the sixth by 3 columns); a constant B's panels are padded to 200 columns
    instead, and its tail tile starts at 192 (AVX-512: 16-lane vectors, so tiles of 32)."""
    target = parse_target("llvm -mcpu=znver4 -mattr=+avx512f")
    model, _ = matmul_model([12, 29, 64], [12, 64, 197])
    (task,) = extract_tasks(optimize(import_model(model)), target)
    anchor, config = task.tunable.anchor, task.tunable.default_config()
    assert anchor.shape[-1] == 197 and config["pack"] == 0 and config["nr"] == 32
    assert SplitOverlap(anchor.loop(2), 32, 8) in task.tunable.records(config)
    model, _ = matmul_model([29, 64], [64, 197], b_constant=True)
    (task,) = extract_tasks(optimize(import_model(model)), target)
    anchor, config = task.tunable.anchor, task.tunable.default_config()
    assert anchor.shape[-1] == 200
    assert SplitOverlap(anchor.loop(1), 32, 8) in task.tunable.records(config)
