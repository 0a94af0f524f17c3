"""Cross-kernel weight prefetch (`kernels.weight_prefetch`): a kernel asks for exactly the
slice of a later kernel's weights it was handed, spread over its heaviest loop nest and
never past the slice; the plan hands each large weight, first bytes first, to the kernels
just before its reader within their budgets; a prefetch changes no value (native code
against the interpreter, a model bit-identical with and without, and against ONNX
Runtime)."""

from __future__ import annotations

import itertools
import json
import zipfile
from io import BytesIO

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper

import compiler_core
from compiler_core import build, te
from compiler_core.frontend.onnx import import_model
from compiler_core.kernels import weight_prefetch
from compiler_core.loop.interpreter import _compile_expr
from compiler_core.loop.ir import Buffer, For, ForKind, Prefetch
from compiler_core.loop.transform import walk_stmts
from compiler_core.passes.pipeline import optimize
from compiler_core.runtime import load
from compiler_core.schedule.primitives import Fuse, Parallel, Split, apply
from compiler_core.target import host_target
from tests.codegen.test_llvm import assert_native_matches_interpreter
from tests.conftest import FLOAT, assert_close_to_scale, make_model

LINE = weight_prefetch.CACHE_LINE_BYTES


def row_sums(rows: int = 32, width: int = 64):
    """A small stage and a heavy one (a row sum over a parallel loop of fused rows)."""
    a = te.placeholder((rows, width), "float32", "a")
    k = te.reduce_axis(width, "k")
    scaled = te.compute((rows, width), lambda i, j: a[i, j] * 2.0, "s")
    out = te.compute((rows,), lambda i: te.reduce_sum(scaled[i, k], k), "o")
    func = te.lower([a], [out], "rows")
    return apply(func, [Split("o_i0", 4), Fuse("o_i0_o", "o_i0_i"), Parallel("o_i0_o_o_i0_i_f")])


def prefetched(func) -> set[int]:
    """Every element the prefetches of `func` ask for, over all iterations of their loops."""
    seen: set[int] = set()

    def visit(s, env):
        if isinstance(s, Prefetch):
            seen.add(_compile_expr(s.offset)(env))
        elif isinstance(s, For):
            if any(isinstance(x, Prefetch) for x in walk_stmts(s.body)):
                for i in range(s.extent):
                    visit(s.body, {**env, s.var.name: i})
        else:
            for child in getattr(s, "stmts", ()) or [getattr(s, "body", None)]:
                if child is not None:
                    visit(child, env)

    visit(func.body, {})
    return seen


@pytest.mark.parametrize(("start", "nbytes"), [(0, 16 * 1024), (1024, 8192), (64, 64)])
def test_exactly_the_slice_is_prefetched_a_line_at_a_time(start, nbytes):
    source = Buffer("w", (64, 256), "float32")  # 64 KB
    func = weight_prefetch.add_prefetch(row_sums(), 1, source, start, nbytes)
    assert [p.name for p in func.params] == ["a", "prefetch0", "o"]
    elements = prefetched(func)
    per_line = LINE // 4
    first, last = start // 4, (start + nbytes) // 4 - 1
    assert min(elements) == first and max(elements) <= last  # never past the slice
    assert {e // per_line for e in elements} == set(range(first // per_line, last // per_line + 1))


def test_prefetches_spread_over_the_heaviest_nest_and_its_parallel_loop():
    func = weight_prefetch.add_prefetch(row_sums(), 1, Buffer("w", (4096,), "float32"), 0, 8192)
    # 128 lines over the 32 fused rows (parallel) x 64 reduction steps: the 2048 steps
    # would outnumber them, so 4 lines at the top of each row.
    loops = [s for s in walk_stmts(func.body) if isinstance(s, For)]
    row = next(loop for loop in loops if loop.kind == ForKind.PARALLEL)
    hints = [s for s in walk_stmts(row.body) if isinstance(s, Prefetch)]
    assert len(hints) == 4
    assert hints == [s for s in walk_stmts(func.body) if isinstance(s, Prefetch)]
    # ... each at the top of the row's body, before its first statement
    assert all(isinstance(s, Prefetch) for s in row.body.stmts[:4])


def test_a_prefetch_only_parameter_reaches_the_parallel_loop_and_changes_nothing(tmp_path):
    func = weight_prefetch.add_prefetch(row_sums(), 1, Buffer("w", (4096,), "float32"), 0, 8192)
    assert_native_matches_interpreter([func], tmp_path)


def dense_chain(widths=(256, 256, 512, 256)):
    """x -> MatMul -> Relu -> MatMul -> ...: every weight 256 KB or more."""
    rng = np.random.default_rng(3)
    nodes, weights, value = [], {}, "x"
    for k, (n_in, n_out) in enumerate(itertools.pairwise(widths)):
        weights[f"w{k}"] = (rng.standard_normal((n_in, n_out)) / n_in**0.5).astype(np.float32)
        nodes += [
            helper.make_node("MatMul", [value, f"w{k}"], [f"m{k}"]),
            helper.make_node("Relu", [f"m{k}"], [f"r{k}"]),
        ]
        value = f"r{k}"
    return make_model(
        nodes, [("x", FLOAT, [64, widths[0]])], [(value, FLOAT, [64, widths[-1]])], weights
    )


def test_the_plan_hands_weights_back_first_bytes_first_within_budgets():
    graph = optimize(import_model(dense_chain()))
    kernels = build.build_kernels(graph, host_target(), prefetch_weights=False)
    funcs, inputs = [k.func for k in kernels], [k.inputs for k in kernels]
    flops = [sum(build._stage_flops(s) for s in k.stages) for k in kernels]
    weights = set(graph.constants) | {n for k in kernels for n in k.packed}
    plan = weight_prefetch.plan(funcs, inputs, flops, weights)
    assert plan, "a chain of 256 KB weights gets prefetches"
    budgets = weight_prefetch.prefetch_budgets(funcs, inputs, flops, weights)
    for by in {p.by for p in plan}:
        assert sum(p.nbytes for p in plan if p.by == by) <= budgets[by]
    for of, value in {(p.of, p.value) for p in plan}:
        slices = [p for p in plan if p.of == of and p.value == value]
        size = funcs[of].params[inputs[of].index(value)].nbytes
        assert weight_prefetch.PREFETCH_MIN_BYTES <= size <= weight_prefetch.STAGED_BYTES
        starts = [p.start for p in slices]
        assert starts[0] == 0 and all(p.start % LINE == 0 for p in slices)
        assert [p.by for p in slices] == sorted((p.by for p in slices), reverse=True)
        assert all(of - weight_prefetch.HORIZON <= p.by < of for p in slices)
        ends = [p.start + p.nbytes for p in slices]
        assert starts[1:] == ends[:-1] and ends[-1] <= size


def member(archive, name: str) -> dict:
    with zipfile.ZipFile(BytesIO(archive.to_bytes())) as z:
        return json.loads(z.read(name))


def plan_kernels(archive) -> list[dict]:
    return member(archive, "plan.json")["kernels"]


def manifest(archive) -> dict:
    return member(archive, "manifest.json")


def test_a_model_runs_bit_identical_with_and_without_prefetches(monkeypatch):
    model = dense_chain()
    feeds = {"x": np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)}
    with_prefetch = compiler_core.compile(model)
    # The second MatMul's weights (packed or not) are an input of the first kernel too, and
    # the manifest says which bytes it prefetches for which kernel.
    first, second = plan_kernels(with_prefetch)[:2]
    assert any(i.startswith("w1") for i in first["inputs"])
    (note,) = manifest(with_prefetch)["weight_prefetches"][first["name"]]
    assert note["for"] == second["name"] and note["value"] in first["inputs"]
    assert note["start"] == 0 and 0 < note["bytes"] <= 256 * 512 * 4
    monkeypatch.setattr(build, "add_weight_prefetches", lambda graph, kernels: None)
    without = compiler_core.compile(model)
    assert all(not i.startswith("w1") for i in plan_kernels(without)[0]["inputs"])
    actual = load(with_prefetch, num_threads=2).run(feeds)["r2"]
    np.testing.assert_array_equal(actual, load(without, num_threads=2).run(feeds)["r2"])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert_close_to_scale(actual, session.run(None, feeds)[0])
