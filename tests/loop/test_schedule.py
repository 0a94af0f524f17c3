"""Schedule primitives: every schedule is checked with the loop-IR interpreter against the
unscheduled function; illegal records are refused with a clear error; random legal schedules
are tried (seeded)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from compiler_core import te
from compiler_core.loop import interpreter
from compiler_core.loop.ir import Const, For, ForKind, maximum
from compiler_core.loop.transform import walk_stmts
from compiler_core.schedule.primitives import (
    CacheWrite,
    ComputeAt,
    ComputeInline,
    Fuse,
    Parallel,
    Reorder,
    ReverseComputeInline,
    ScheduleError,
    Split,
    SplitOverlap,
    Unroll,
    Vectorize,
    apply,
    from_json,
    to_json,
)

M, K, N = 6, 5, 8


def gemm_epilogue():
    a = te.placeholder((M, K), "float32", "a")
    b = te.placeholder((K, N), "float32", "b")
    kk = te.reduce_axis(K, "kk")
    c = te.compute((M, N), lambda i, j: te.reduce_sum(a[i, kk] * b[kk, j], kk), "c")
    e = te.compute((M, N), lambda i, j: c[i, j] * 2.0, "e")
    d = te.compute((M, N), lambda i, j: maximum(e[i, j], Const(0.0, "float32")), "d")
    return te.lower([a, b], [d], "gemm")


def run(func, seed=0):
    rng = np.random.default_rng(seed)
    args = {
        "a": rng.standard_normal((M, K)).astype(np.float32),
        "b": rng.standard_normal((K, N)).astype(np.float32),
        "d": np.zeros((M, N), np.float32),
    }
    interpreter.run(func, args)
    return args["d"]


BASE = gemm_epilogue()
EXPECTED = run(BASE)


def assert_schedule_keeps_meaning(schedule):
    scheduled = apply(BASE, schedule)
    np.testing.assert_allclose(run(scheduled), EXPECTED, rtol=1e-5, atol=1e-5)
    return scheduled


@pytest.mark.parametrize(
    "schedule",
    [
        [Split("c_i0", 4)],  # 6 % 4 != 0: a guarded tail
        [Split("c_i1", 4), Reorder(("c_kk", "c_i1_i")), Vectorize("c_i1_i")],
        [Reorder(("c_kk", "c_i0", "c_i1"))],
        [Fuse("d_i0", "d_i1"), Parallel("d_i0_d_i1_f")],
        [Unroll("c_kk")],
        [Parallel("c_i0")],
        [ComputeInline("e")],
        [ComputeAt("e", "d_i0")],
        [ComputeAt("c", "e_i0")],
        [
            Split("c_i1", 4),
            Reorder(("c_i0", "c_i1_o", "c_kk", "c_i1_i")),
            CacheWrite("c", "c_kk"),
            ComputeInline("e"),
            ReverseComputeInline("d"),
            Vectorize("c_i1_i"),
        ],
        [ComputeInline("e"), ComputeAt("c", "d_i0"), Split("c_i1_at", 4)],
        [
            Split("c_i0", 2),
            Split("c_i1", 4),
            Reorder(("c_i0_o", "c_i1_o", "c_kk", "c_i0_i", "c_i1_i")),
            CacheWrite("c", "c_kk"),
            Vectorize("c_i1_i"),
            Unroll("c_i0_i"),
            ComputeInline("e"),
            Parallel("d_i0"),
        ],
    ],
    ids=str,
)
def test_primitive_preserves_results(schedule):
    assert_schedule_keeps_meaning(schedule)


def test_annotations_land_on_the_named_loops():
    func = assert_schedule_keeps_meaning(
        [
            Split("c_i1", 4),
            Reorder(("c_kk", "c_i1_i")),
            Vectorize("c_i1_i"),
            Parallel("c_i0"),
            Unroll("c_kk"),
        ]
    )
    kinds = {s.var.name: s.kind for s in walk_stmts(func.body) if isinstance(s, For)}
    assert kinds["c_i1_i"] == ForKind.VECTORIZED
    assert kinds["c_i0"] == ForKind.PARALLEL
    assert kinds["c_kk"] == ForKind.UNROLLED


def test_cache_write_accumulates_in_a_local_buffer():
    func = assert_schedule_keeps_meaning(
        [Split("c_i1", 4), Reorder(("c_i0", "c_i1_o", "c_kk", "c_i1_i")), CacheWrite("c", "c_kk")]
    )
    from compiler_core.loop.ir import Allocate

    locals_ = [s.buffer for s in walk_stmts(func.body) if isinstance(s, Allocate)]
    assert any(b.scope == "local" and b.shape == (1, 4) for b in locals_)


# K blocks: the reduction (5) split in blocks of 2 (a ragged last one) outside the cached loop.
K_BLOCKS = [Split("c_i1", 4), Split("c_kk", 2)]


@pytest.mark.parametrize(
    "schedule",
    [
        [*K_BLOCKS, Reorder(("c_i0", "c_kk_o", "c_i1_o", "c_kk_i", "c_i1_i"))],
        [*K_BLOCKS, Reorder(("c_kk_o", "c_i0", "c_i1_o", "c_kk_i", "c_i1_i"))],
        [Split("c_i0", 4), *K_BLOCKS, Reorder(("c_i0_o", "c_kk_o", "c_i1_o", "c_kk_i"))],
    ],
    ids=["blocks_inside_rows", "blocks_outermost", "ragged_rows"],
)
def test_a_cache_accumulates_across_reduction_blocks_outside_its_loop(schedule):
    """Each visit of the cached loop reloads the partial sums the earlier blocks stored
    (the first starts from zero) and stores them back; the result is the whole sum."""
    func = assert_schedule_keeps_meaning(
        [*schedule, CacheWrite("c", "c_kk_i", accumulate=True), Vectorize("c_rl1")]
    )
    reloads = [s for s in walk_stmts(func.body) if isinstance(s, For) and s.var.name == "c_rl1"]
    assert reloads and reloads[0].kind == ForKind.VECTORIZED


def test_a_cache_inside_reduction_blocks_must_say_it_accumulates():
    schedule = [*K_BLOCKS, Reorder(("c_i0", "c_kk_o", "c_i1_o", "c_kk_i", "c_i1_i"))]
    with pytest.raises(ScheduleError, match="c_kk_o run outside 'c_kk_i'.*or accumulate"):
        apply(BASE, [*schedule, CacheWrite("c", "c_kk_i")])


@pytest.mark.parametrize(
    ("record", "message"),
    [
        (Split("nope", 2), "no loop 'nope'"),
        (Split("c_i0", 0), "positive"),
        (Split("c_i0", 7), "exceeds the extent"),
        (Vectorize("c_i0"), "innermost"),
        (Vectorize("c_kk"), "reduction loop"),
        (Parallel("c_kk"), "reduction loop"),
        (Fuse("c_i0", "c_kk"), "directly inside"),
        (Reorder(("c_i0", "d_i0")), "perfect nest"),
        (ComputeInline("c"), "reduction"),
        (ComputeInline("d"), "output"),
        (ComputeAt("d", "c_i0"), "output"),
        (ComputeAt("missing", "d_i0"), "no stage"),
        (ComputeAt("c", "d_i0"), "reads"),
        (ReverseComputeInline("e"), "cache its write"),
        (ReverseComputeInline("c"), "single store"),
    ],
    ids=str,
)
def test_illegal_records_are_refused(record, message):
    with pytest.raises(ScheduleError, match=message):
        apply(BASE, [record])


# A GEMM's columns (8) as whole tiles of 3 and a tail tile of 3 that overlaps the last whole
# one: each nest caches its own accumulators, and the epilogue folds into both stores.
TAIL_TILE = [
    Reorder(("c_i1", "c_i0", "c_kk")),
    SplitOverlap("c_i1", 3, tail=3),
    Reorder(("c_i1_o", "c_i0", "c_kk", "c_i1_i")),
    CacheWrite("c", "c_kk"),
    Reorder(("c_i0_t", "c_kk_t", "c_i1_t")),
    CacheWrite("c", "c_kk_t", suffix="_t"),
    Vectorize("c_i1_t"),
    ComputeInline("e"),
    ReverseComputeInline("d"),
]


def test_a_tail_tile_is_a_nest_of_its_own_with_renamed_loops():
    func = assert_schedule_keeps_meaning(TAIL_TILE)
    loops = {s.var.name: s.extent for s in walk_stmts(func.body) if isinstance(s, For)}
    assert loops["c_i1_o"] == 2 and loops["c_i1_i"] == 3
    assert loops["c_i1_t"] == 3 and loops["c_i0_t"] == M and loops["c_kk_t"] == K
    from compiler_core.loop.ir import Allocate, Store

    caches = {s.buffer.name for s in walk_stmts(func.body) if isinstance(s, Allocate)}
    assert caches == {"c_local", "c_t_local"}
    assert sum(isinstance(s, Store) and s.buffer.name == "d" for s in walk_stmts(func.body)) == 2


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        # The reduction's elements do not belong to one iteration of its own loop.
        ([SplitOverlap("c_kk", 2)], "overlap would repeat it"),
        ([SplitOverlap("c_i1", 3, tail=1)], "must cover the 2 left"),
        (TAIL_TILE[:5] + [CacheWrite("c", "c_kk_t")], "its own suffix"),
    ],
    ids=["reduction_axis", "short_tail", "same_cache"],
)
def test_tail_tiles_refuse_what_would_change_the_result(schedule, message):
    with pytest.raises(ScheduleError, match=message):
        apply(BASE, schedule)


def test_nested_parallel_is_refused():
    with pytest.raises(ScheduleError, match="cannot nest"):
        apply(BASE, [Parallel("c_i0"), Parallel("c_i1")])


def _loops(func) -> set[str]:
    return {s.var.name for s in walk_stmts(func.body) if isinstance(s, For)}


def _made_by(record, before=()) -> set[str]:
    """The loops `record` makes, applied after the records `before`."""
    func = apply(BASE, list(before))
    return _loops(apply(func, [record])) - _loops(func)


def test_records_name_the_loops_their_primitives_make():
    """Templates address the loops a record makes through its handles (`Split.outer`,
    `Fuse.fused`...): they name exactly the loops its primitive makes."""
    split = Split("c_i1", 4)
    assert _made_by(split) == {split.outer, split.inner}
    fuse = Fuse("d_i0", "d_i1")
    assert _made_by(fuse) == {fuse.fused}
    overlap = SplitOverlap("c_i1", 3)
    tail = {overlap.tail_loop, overlap.in_tail("c_kk")}
    assert _made_by(overlap) == {overlap.outer, overlap.inner, *tail}
    at = ComputeAt("e", "d_i0")
    assert _made_by(at) == {at.moved("e_i0"), at.moved("e_i1")}
    cache = CacheWrite("c", "c_kk_i", suffix="_b", accumulate=True)
    blocks = [*K_BLOCKS, Reorder(("c_i0", "c_kk_o", "c_i1_o", "c_kk_i", "c_i1_i"))]
    nests = (cache.init_loop, cache.reload_loop, cache.store_loop)
    assert _made_by(cache, blocks) == {loop(d) for loop in nests for d in range(2)}
    from compiler_core.loop.ir import Allocate

    func = apply(BASE, [*blocks, cache])
    assert cache.local in {s.buffer.name for s in walk_stmts(func.body) if isinstance(s, Allocate)}


def test_records_round_trip_through_json():
    schedule = [Split("c_i0", 2), Reorder(("c_i0_o", "c_i1")), CacheWrite("c", "c_kk")]
    assert from_json(to_json(schedule)) == schedule
    with pytest.raises(ScheduleError, match="unknown schedule primitive"):
        from_json('[{"primitive": "Teleport", "loop": "x"}]')


def _random_schedule(rng: random.Random):
    """A random legal-by-construction schedule for the GEMM stage and its epilogue."""
    schedule = []
    if rng.random() < 0.5:
        schedule.append(ComputeInline("e"))
    fi = rng.choice([1, 2, 3, 6])  # divisors: a tail guard would end the perfect nest
    fj = rng.choice([1, 2, 4, 8])
    schedule += [Split("c_i0", fi), Split("c_i1", fj)]
    inner = ["c_kk", "c_i0_i", "c_i1_i"]
    rng.shuffle(inner)
    schedule.append(Reorder(("c_i0_o", "c_i1_o", *inner)))
    if inner[-1] == "c_i1_i" and rng.random() < 0.7:
        schedule.append(Vectorize("c_i1_i"))
    if rng.random() < 0.5 and inner[0] != "c_kk":
        schedule.append(Parallel("c_i0_o"))
    if rng.random() < 0.5:
        schedule.append(Unroll(rng.choice([n for n in inner if n != "c_i1_i"] or ["c_i0_i"])))
    return schedule


@pytest.mark.parametrize("seed", range(12))
def test_random_legal_schedules(seed):
    rng = random.Random(seed)
    assert_schedule_keeps_meaning(_random_schedule(rng))


def test_compute_at_shrinks_a_stage_read_only_inside_the_loop():
    """e (read only by d) computed per row of d lives in a one-row local buffer; so does c,
    computed in the same loop once e is there."""
    from compiler_core.loop.ir import Allocate

    func = assert_schedule_keeps_meaning([ComputeAt("e", "d_i0"), ComputeAt("c", "d_i0")])
    allocated = {s.buffer.name: s.buffer for s in walk_stmts(func.body) if isinstance(s, Allocate)}
    assert allocated["e"].scope == "local" and allocated["e"].shape == (1, N)
    assert allocated["c"].scope == "local" and allocated["c"].shape == (1, N)


def test_compute_at_computes_the_union_of_fixed_spans_not_a_padded_dimension():
    """A row stage reads its producer's row as whole vectors (columns 0..15) and one last
    vector ending at the row's end (4..19), of a producer padded to 24 columns (a GEMM's
    panel): computed per row, the producer computes columns 0..19 only."""
    from compiler_core.loop.ir import Allocate

    a = te.placeholder((M, K), "float32", "a")
    b = te.placeholder((K, 24), "float32", "b")
    kk, r = te.reduce_axis(K, "kk"), te.reduce_axis(16, "r")
    c = te.compute((M, 24), lambda i, j: te.reduce_sum(a[i, kk] * b[kk, j], kk), "c")
    d = te.compute((M,), lambda i: te.reduce_sum(c[i, r] * c[i, r + 4], r), "d")
    func = te.lower([a, b], [d], "rows")
    scheduled = apply(func, [ComputeAt("c", "d_i0")])
    allocated = {
        s.buffer.name: s.buffer for s in walk_stmts(scheduled.body) if isinstance(s, Allocate)
    }
    assert allocated["c"].shape == (1, 20)
    rng = np.random.default_rng(4)
    args = {"a": rng.standard_normal((M, K)), "b": rng.standard_normal((K, 24))}
    results = []
    for f in (func, scheduled):
        given = {k: v.astype(np.float32) for k, v in args.items()} | {"d": np.zeros(M, np.float32)}
        interpreter.run(f, given)
        results.append(given["d"])
    np.testing.assert_allclose(results[1], results[0], rtol=1e-5)


@pytest.mark.parametrize(
    "schedule",
    [
        TAIL_TILE,
        [*K_BLOCKS, Reorder(("c_kk_o", "c_i0", "c_i1_o", "c_kk_i", "c_i1_i"))]
        + [CacheWrite("c", "c_kk_i", accumulate=True), Vectorize("c_rl1"), Parallel("c_i0")],
        [Split("c_i0", 4), Split("c_i1", 4), Reorder(("c_i0_o", "c_i1_o", "c_kk", "c_i0_i"))]
        + [CacheWrite("c", "c_kk"), Unroll("c_i0_i"), ComputeInline("e"), Fuse("d_i0", "d_i1")],
    ],
    ids=["tail_tile", "k_blocks", "tiles"],
)
def test_the_simplifier_cache_changes_nothing_a_schedule_makes(schedule):
    """`apply` simplifies through a cache of what the last record left simplified: the
    function is the one an uncached replay makes, to the character."""
    from compiler_core.loop.printer import format_func
    from compiler_core.schedule.primitives import _replay

    uncached = _replay(BASE, schedule, verify_each=True)
    assert format_func(apply(BASE, schedule)) == format_func(uncached)


def test_a_record_that_breaks_the_function_is_named_by_the_replay():
    """The fast path verifies once at the end; a failure replays record by record so that
    the error is the one the first bad record causes."""
    with pytest.raises(ScheduleError, match="exceeds the extent"):
        apply(BASE, [Split("c_i1", 4), Split("c_i0", 7), Vectorize("c_i1_i")])


ROWS, COLUMNS, TAPS = 10, 3, 3


def padded_window_sum():
    """c = a @ b (10 rows); d[i, j] = sum over 3 taps of c's rows i-1..i+1, zero past the
    edges, read as a padded conv reads (a select over a clamped index): the pattern of an
    expand conv computed inside the depthwise conv that reads it."""
    from compiler_core.kernels.injective import clamp
    from compiler_core.loop.ir import INDEX, Select, logical_and

    a = te.placeholder((ROWS, K), "float32", "a")
    b = te.placeholder((K, COLUMNS), "float32", "b")
    kk, tap = te.reduce_axis(K, "kk"), te.reduce_axis(TAPS, "t")
    c = te.compute((ROWS, COLUMNS), lambda i, j: te.reduce_sum(a[i, kk] * b[kk, j], kk), "c")

    def window(i, j):
        row = i + tap - Const(1, INDEX)
        inside = logical_and(row >= Const(0, INDEX), row < Const(ROWS, INDEX))
        return te.reduce_sum(Select(inside, c[clamp(row, ROWS), j], Const(0.0, "float32")), tap)

    d = te.compute((ROWS, COLUMNS), window, "d")
    return te.lower([a, b], [d], "window")


def run_window(func):
    rng = np.random.default_rng(3)
    args = {
        "a": rng.standard_normal((ROWS, K)).astype(np.float32),
        "b": rng.standard_normal((K, COLUMNS)).astype(np.float32),
        "d": np.zeros((ROWS, COLUMNS), np.float32),
    }
    interpreter.run(func, args)
    return args["d"]


@pytest.mark.parametrize("rows", [1, 2, 5, 10])
def test_compute_at_a_tile_of_rows_of_a_padded_read_computes_its_halo_under_guards(rows):
    """Per tile of `rows` rows of d, c's rows the tile reads (its halo included) in a local
    buffer: the halo past the edges is not computed (guarded), the clamped reads never touch
    it, and the result is the unscheduled one."""
    from compiler_core.loop.ir import Allocate, IfThenElse

    base = padded_window_sum()
    tiles = Split("d_i0", rows)
    at = ComputeAt("c", tiles.outer)
    func = apply(base, [tiles, at, Split(at.moved("c_i1"), 2)])
    np.testing.assert_allclose(run_window(func), run_window(base), rtol=1e-5, atol=1e-5)
    (local,) = [s.buffer for s in walk_stmts(func.body) if isinstance(s, Allocate)]
    assert local.scope == "local" and local.shape == (rows + TAPS - 1, COLUMNS)
    guarded = [s for s in walk_stmts(func.body) if isinstance(s, IfThenElse)]
    assert guarded  # the halo rows at the edges
