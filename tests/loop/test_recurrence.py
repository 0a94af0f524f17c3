"""Loop-carried state in tensor expressions (`te.recurrence`): it lowers to one serial loop
over the steps around the step's loop nests, computes what a numpy loop computes (through the
loop-IR interpreter, before and after a schedule), does not grow with the number of steps,
and the schedule cannot inline a state update away."""

from __future__ import annotations

import numpy as np
import pytest

from compiler_core import te
from compiler_core.loop import interpreter
from compiler_core.loop.ir import For, Store
from compiler_core.loop.transform import walk_stmts
from compiler_core.schedule.primitives import (
    ComputeInline,
    Parallel,
    ScheduleError,
    Split,
    Vectorize,
    apply,
)

N, M = 4, 6  # state length, inputs per step


def leaky_sum(steps: int):
    """h_t = 0.5 h_{t-1} + sum_k x[t, j, k] (a reduction inside the step), and a second
    state, the step's row sum, that does not read its previous value."""
    x = te.placeholder((steps, N, M), "float32", "x")
    h0 = te.placeholder((N,), "float32", "h0")
    zeros = te.compute((N,), lambda j: h0[j] * 0.0, "zero")

    def step(t, previous):
        h, _ = previous
        k = te.reduce_axis(M, "k")
        row_sum = te.compute((N,), lambda j: te.reduce_sum(x[t, j, k], k), "row_sum")
        return [lambda j: h[j] * 0.5 + row_sum[j], lambda j: row_sum[j]]

    h, count = te.recurrence(steps, [h0, zeros], step, "leaky")
    return x, h0, h, count


def expected(x: np.ndarray, h0: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    h, rows, counts = h0.copy(), [], []
    for t in range(x.shape[0]):
        h = h * 0.5 + x[t].sum(axis=1)
        rows.append(h.copy())
        counts.append(x[t].sum(axis=1))
    return np.stack(rows), np.stack(counts)


def run(func, x, h0):
    h = np.zeros((x.shape[0], N), np.float32)
    count = np.zeros_like(h)
    interpreter.run(func, {"x": x, "h0": h0, "leaky_s0": h, "leaky_s1": count})
    return h, count


@pytest.mark.parametrize("steps", [1, 5])
def test_recurrence_matches_a_numpy_loop_before_and_after_a_schedule(steps):
    x_t, h0_t, h, count = leaky_sum(steps)
    func = te.lower([x_t, h0_t], [h, count], "leaky")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((steps, N, M)).astype(np.float32)
    h0 = rng.standard_normal(N).astype(np.float32)
    want_h, want_count = expected(x, h0)
    got_h, got_count = run(func, x, h0)
    np.testing.assert_allclose(got_h, want_h, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_count, want_count, rtol=1e-5, atol=1e-6)
    # A stage of the step is scheduled like any stage: found inside the loop over the steps.
    scheduled = apply(
        func,
        [ComputeInline("zero"), Split("leaky_s0_i0", 2), Vectorize("leaky_s0_i0_i"),
         Parallel("row_sum_i0")],
    )  # fmt: skip
    got_h, got_count = run(scheduled, x, h0)
    np.testing.assert_allclose(got_h, want_h, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_count, want_count, rtol=1e-5, atol=1e-6)


def test_a_long_recurrence_lowers_to_the_same_loop_as_a_short_one():
    sizes = []
    for steps in (4, 512):
        x, h0, h, count = leaky_sum(steps)
        func = te.lower([x, h0], [h, count], "leaky")
        loops = [s for s in walk_stmts(func.body) if isinstance(s, For)]
        assert any(loop.var.name == "leaky_t" and loop.extent == steps for loop in loops)
        sizes.append(sum(isinstance(s, Store) for s in walk_stmts(func.body)))
    assert sizes[0] == sizes[1]


def test_a_state_update_cannot_be_inlined():
    x, h0, h, count = leaky_sum(3)
    func = te.lower([x, h0], [h], "leaky")  # the row sums are computed, not returned
    assert any(isinstance(s, Store) and s.buffer.name == "leaky_s1" for s in walk_stmts(func.body))
    with pytest.raises(ScheduleError, match="stores at indices its own loops do not cover"):
        apply(func, [ComputeInline("leaky_s1")])


def test_a_step_that_returns_the_wrong_number_of_updates_is_refused():
    h0 = te.placeholder((N,), "float32", "h0")
    with pytest.raises(ValueError, match="1 updates for 2 states"):
        te.recurrence(3, [h0, h0], lambda t, previous: [lambda j: previous[0][j]], "bad")
    with pytest.raises(ValueError, match="0 steps"):
        te.recurrence(0, [h0], lambda t, previous: [lambda j: previous[0][j]], "bad")
