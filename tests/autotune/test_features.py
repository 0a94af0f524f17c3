"""Features of scheduled loop programs: fixed width, finite, deterministic, and telling a
register-tiled schedule from a naive one in the directions the cost model relies on."""

from __future__ import annotations

import functools
import random
import time

import numpy as np
import pytest
from onnx import helper

from compiler_core.autotune.features import (
    FEATURE_COUNT,
    FEATURE_NAMES,
    MAX_ACCESSES,
    extract,
    extract_many,
)
from compiler_core.build import build_group
from compiler_core.frontend.onnx import import_model
from compiler_core.loop.ir import (
    Binary,
    Buffer,
    Const,
    For,
    ForKind,
    PrimFunc,
    Store,
    Var,
    seq,
)
from compiler_core.passes.pipeline import optimize
from compiler_core.schedule.primitives import (
    Parallel,
    Reorder,
    ScheduleError,
    Split,
    Unroll,
    Vectorize,
)
from compiler_core.target import host_target
from tests.conftest import FLOAT, make_model

RNG = np.random.default_rng(0)
INDEX = {name: k for k, name in enumerate(FEATURE_NAMES)}


def feature(vector: np.ndarray, name: str) -> float:
    return float(vector[INDEX[name]])


def access_values(vector: np.ndarray, field: str) -> list[float]:
    return [feature(vector, f"acc{k}_{field}") for k in range(MAX_ACCESSES)]


def anchor_group(model):
    graph = optimize(import_model(model))
    index = next(k for k, g in enumerate(graph.groups) if g.anchor)
    return graph, graph.groups[index], index


@functools.cache
def matmul(m: int = 64, k: int = 128, n: int = 96):
    weight = RNG.standard_normal((k, n)).astype(np.float32)
    model = make_model(
        [helper.make_node("MatMul", ["a", "w"], ["y"])],
        [("a", FLOAT, (m, k))],
        [("y", FLOAT, (m, n))],
        {"w": weight},
    )
    return anchor_group(model)


@functools.cache
def conv(channels: int = 16, size: int = 14, out: int = 32):
    weight = RNG.standard_normal((out, channels, 3, 3)).astype(np.float32)
    node = helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])
    model = make_model(
        [node],
        [("x", FLOAT, (1, channels, size, size))],
        [("y", FLOAT, (1, out, size, size))],
        {"w": weight},
    )
    return anchor_group(model)


def build(workload, schedule=None):
    graph, group, index = workload
    return build_group(graph, group, index, host_target(), schedule=schedule).func


def random_schedules(count: int, seed: int = 0):
    """Random valid schedules of the naive 64x96x128 matmul: splits (dividing or not, which
    leaves guards), a reorder, and annotations; the illegal ones are skipped."""
    rng = random.Random(seed)
    i, j, k = "matmul1_i0", "matmul1_i1", "matmul1_rk"
    found = []
    while len(found) < count:
        fi, fj, fk = (rng.choice((1, 2, 3, 4, 5, 8, 16, 32)) for _ in range(3))
        records = [Split(i, fi), Split(j, fj), Split(k, fk)]
        order = [f"{i}_o", f"{j}_o", f"{k}_o", f"{k}_i", f"{i}_i", f"{j}_i"]
        if rng.random() < 0.5:
            order[3:] = rng.sample(order[3:], 3)
        records.append(Reorder(tuple(order)))
        for annotate in (Vectorize(order[-1]), Unroll(order[-2]), Parallel(f"{i}_o")):
            if rng.random() < 0.6:
                records.append(annotate)
        try:
            found.append(build(matmul(), records))
        except ScheduleError:
            continue
    return found


# --- the layout --------------------------------------------------------------------------------


def test_names_are_unique_and_match_the_width():
    assert len(FEATURE_NAMES) == FEATURE_COUNT == len(set(FEATURE_NAMES))
    assert all(name.isidentifier() for name in FEATURE_NAMES)


def test_every_schedule_gives_a_finite_vector_of_fixed_width():
    funcs = [build(matmul()), build(matmul(), []), *random_schedules(12)]
    funcs += [build(conv()), build(conv(), [])]
    vectors = extract_many(funcs)
    assert vectors.shape == (len(funcs), FEATURE_COUNT)
    assert vectors.dtype == np.float32
    assert np.isfinite(vectors).all()
    # Different schedules of one workload are told apart.
    assert len({v.tobytes() for v in vectors}) == len(funcs)


def test_extract_many_matches_extract_and_handles_nothing():
    funcs = [build(matmul()), build(conv())]
    np.testing.assert_array_equal(extract_many(funcs), np.stack([extract(f) for f in funcs]))
    assert extract_many([]).shape == (0, FEATURE_COUNT)


def test_same_function_same_vector():
    first = extract(build(matmul()))
    np.testing.assert_array_equal(first, extract(build(matmul())))  # rebuilt: new objects
    func = build(conv())
    np.testing.assert_array_equal(extract(func), extract(func))


def test_workloads_of_other_shapes_have_the_same_width():
    small, large = extract(build(matmul(16, 32, 48))), extract(build(matmul(128, 256, 512)))
    assert small.shape == large.shape == (FEATURE_COUNT,)
    assert feature(large, "func_log_flops") > feature(small, "func_log_flops")
    assert feature(large, "func_log_global_bytes") > feature(small, "func_log_global_bytes")


# --- directions --------------------------------------------------------------------------------


@pytest.mark.parametrize("workload", [matmul, conv])
def test_tiled_schedule_differs_from_naive_in_the_expected_direction(workload):
    tiled, naive = extract(build(workload())), extract(build(workload(), []))
    # Same work either way.
    assert feature(tiled, "func_log_flops") == pytest.approx(feature(naive, "func_log_flops"))
    # Vector lanes, a parallel loop and unrolling only in the tiled one.
    assert feature(tiled, "func_vec_width") >= 8 and feature(naive, "func_vec_width") == 0
    assert feature(tiled, "loop0_vectorized") == 1 and feature(naive, "loop0_vectorized") == 0
    assert feature(tiled, "func_par_exec_share") > 0.9 >= feature(naive, "func_par_exec_share")
    assert feature(tiled, "func_unroll_log_product") > feature(naive, "func_unroll_log_product")
    # A register (local) accumulator, read-modify-written along unit stride.
    assert feature(tiled, "func_local_buffers") >= 1 and feature(naive, "func_local_buffers") == 0
    local = access_values(tiled, "local").index(1.0)
    assert feature(tiled, f"acc{local}_write") == feature(tiled, f"acc{local}_read") == 1
    assert feature(tiled, f"acc{local}_stride_inner") == 1.0  # log2(1 + 1): unit stride
    # The naive nest ends in the reduction loop: no vector loop at all.
    assert feature(naive, "loop0_reduction") == 1 and feature(tiled, "loop0_reduction") == 0
    assert set(access_values(naive, "stride_vec")) <= {-1.0, 0.0}
    # Tiling keeps the accumulator small: far more reuse of what it touches.
    assert feature(tiled, f"acc{local}_log_reuse") > max(access_values(naive, "log_reuse"))


def test_matmul_access_strides():
    tiled = extract(build(matmul()))
    strides = sorted(access_values(tiled, "stride_vec")[:3])
    # Along the vector lanes: the left operand is broadcast, weights and accumulator are unit.
    assert strides == [0.0, 1.0, 1.0]
    naive = extract(build(matmul(), []))
    # The innermost (reduction) loop walks the weight's rows: a panel-wide stride in its
    # packed [n/P, k, P] layout (P two vectors: 32 with AVX-512, 16 with AVX2).
    panel = 2 * host_target().vector_lanes
    assert max(access_values(naive, "stride_inner")) == pytest.approx(np.log2(panel + 1))


# --- hand-built programs -----------------------------------------------------------------------


def _nest(loops, body):
    for name, extent, kind in reversed(loops):
        body = For(Var(name), extent, body, kind)
    return body


def test_strides_of_a_hand_built_transpose_with_a_fused_loop():
    a = Buffer("a", (64, 32), "float32")
    b = Buffer("b", (32, 64), "float32")
    f = Var("f")
    row, col = Binary("floordiv", f, Const(32, "int64")), Binary("mod", f, Const(32, "int64"))
    body = Store(b, (col, row), a[row, col])
    func = PrimFunc("transpose", (a, b), _nest([("f", 2048, ForKind.PARALLEL)], body))
    vector = extract(func)
    # The read walks `a` at unit stride; the write walks `b` down a column (stride 64).
    strides = {
        feature(vector, f"acc{k}_write"): feature(vector, f"acc{k}_stride_inner") for k in (0, 1)
    }
    assert strides == {0.0: 1.0, 1.0: pytest.approx(np.log2(65))}
    assert feature(vector, "func_par_log_extent") == pytest.approx(np.log2(2049))
    assert feature(vector, "count_int_divmod") > 0
    assert all(feature(vector, f"func_par_div{t}") == 1 for t in (2, 4, 8, 16, 32))


def test_gather_index_and_empty_function_stay_finite():
    table = Buffer("table", (100,), "float32")
    ids = Buffer("ids", (8,), "int64")
    out = Buffer("out", (8,), "float32")
    body = Store(out, (Var("i"),), table[ids[Var("i")]])
    vector = extract(PrimFunc("gather", (table, ids, out), _nest([("i", 8, ForKind.SERIAL)], body)))
    assert np.isfinite(vector).all()
    empty = extract(PrimFunc("empty", (out,), seq()))
    assert empty.shape == (FEATURE_COUNT,) and not empty.any()


# --- speed -------------------------------------------------------------------------------------


def _seconds_per_extract(func, repeats: int = 10) -> float:
    extract(func)
    started = time.perf_counter()
    for _ in range(repeats):
        extract(func)
    return (time.perf_counter() - started) / repeats


def test_extraction_is_fast_on_a_resnet_sized_conv():
    # ResNet-18's layer1 3x3 conv; the budget is 20 ms, asserted loosely (shared CI machines).
    seconds = _seconds_per_extract(build(conv(64, 56, 64)))
    assert seconds < 0.2, f"{seconds * 1e3:.1f} ms per extraction"
