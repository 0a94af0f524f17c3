"""`PrefetchNext`: the next iteration's slice of a weight buffer prefetched during this one.
A prefetch changes no value (interpreter and native code against the unscheduled function);
what it asks for is exactly the next slice, never past the buffer; what it cannot do is
refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from compiler_core.codegen.llvm import build_module
from compiler_core.codegen.native import emit_assembly
from compiler_core.loop.interpreter import _compile_expr
from compiler_core.loop.ir import For, Prefetch
from compiler_core.loop.printer import format_func
from compiler_core.loop.transform import walk_stmts
from compiler_core.schedule.primitives import (
    CacheWrite,
    PrefetchNext,
    Reorder,
    ScheduleError,
    Split,
    apply,
    from_json,
    to_json,
)
from compiler_core.target import host_target
from tests.codegen.test_llvm import assert_native_matches_interpreter
from tests.loop.test_schedule import BASE, EXPECTED, K, M, N, run

# Row i of the GEMM reads row i of `a` (K floats): the next row is prefetched during row i,
# a line at the top of every step of the reduction.
PREFETCHED = [CacheWrite("c", "c_kk"), PrefetchNext("a", "c_i0", "c_kk")]


def prefetched_elements(func, loops: dict[str, int]) -> dict[tuple[int, ...], set[int]]:
    """Per iteration of `loops` (name -> extent, outermost first): the elements prefetched."""
    prefetches = [s for s in walk_stmts(func.body) if isinstance(s, Prefetch)]
    offsets = [_compile_expr(p.offset) for p in prefetches]
    seen: dict[tuple[int, ...], set[int]] = {}
    for point in np.ndindex(*loops.values()):
        env = dict(zip(loops, (int(v) for v in point), strict=True))
        seen.setdefault(point[:1], set()).update(f(env) for f in offsets)
    return seen


def test_a_prefetch_changes_no_value():
    func = apply(BASE, PREFETCHED)
    assert "prefetch a.flat[" in format_func(func)
    np.testing.assert_allclose(run(func), EXPECTED, rtol=1e-5)


def test_each_row_prefetches_the_next_rows_line_and_never_past_the_buffer():
    func = apply(BASE, [Reorder(("c_i0", "c_i1", "c_kk")), PrefetchNext("a", "c_i0", "c_kk")])
    seen = prefetched_elements(func, {"c_i0": M, "c_i1": N, "c_kk": K})
    for (i,), elements in seen.items():
        first = min((i + 1) * K, M * K - 1)
        assert min(elements) == first  # the next row's first element: its line comes first
        assert max(elements) < M * K  # the last row's prefetches stay inside `a`


def test_a_slice_of_many_lines_is_spread_over_the_steps():
    """16 rows of 64 floats (4 lines a row) over 4 reduction steps: a line a step."""
    from compiler_core import te

    a = te.placeholder((16, 64), "float32", "a")
    s = te.placeholder((16,), "float32", "s")
    k = te.reduce_axis(4, "k")
    out = te.compute((16,), lambda i: te.reduce_sum(a[i, k * 16] * s[i], k), "o")
    func = apply(te.lower([a, s], [out], "rows"), [PrefetchNext("a", "o_i0", "o_k")])
    seen = prefetched_elements(func, {"o_i0": 16, "o_k": 4})
    assert seen[(0,)] == {64, 80, 96, 112}  # row 1, one element per 64-byte line
    assert seen[(15,)] == {16 * 64 - 1}  # past the last row: clamped to the buffer's end


def test_native_code_prefetches_and_matches_the_interpreter(tmp_path):
    func = apply(BASE, PREFETCHED)
    assert_native_matches_interpreter([func], tmp_path)
    target = host_target()
    if target.triple.startswith("x86_64"):
        assert "prefetcht1" in emit_assembly(build_module([func], target), target)


def test_the_record_round_trips_through_json():
    assert from_json(to_json(PREFETCHED)) == PREFETCHED


@pytest.mark.parametrize(
    ("record", "message"),
    [
        (PrefetchNext("nope", "c_i0", "c_kk"), "not a parameter"),
        (PrefetchNext("a", "c_i0", "d_i0"), "not inside"),
        (PrefetchNext("b", "c_i0", "c_kk"), "does not move"),  # b is the same for every row
        (PrefetchNext("a", "c_i1", "c_kk"), "does not move"),  # a row is read for every column
    ],
    ids=str,
)
def test_what_cannot_be_prefetched_is_refused(record, message):
    with pytest.raises(ScheduleError, match=message):
        apply(BASE, [record])


def test_a_split_loop_prefetches_through_its_new_names():
    func = apply(BASE, [Split("c_i0", 2), PrefetchNext("a", "c_i0_o", "c_kk")])
    assert any(isinstance(s, For) and s.var.name == "c_i0_o" for s in walk_stmts(func.body))
    np.testing.assert_allclose(run(func), EXPECTED, rtol=1e-5)
