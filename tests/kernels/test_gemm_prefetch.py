"""The dense template's `prefetch` knob: a GEMM by constant weights brings its next column
tile's panels of B into cache during this tile's reduction steps. Which GEMMs are offered it
(compute-bound ones, of more than one column tile, whose B is a constant), the prefetches in
the scheduled loop program, and every algorithm, loop order, parallel loop, tail and row
block with it on, against the reference answer."""

from __future__ import annotations

import pytest

from compiler_core.autotune.tasks import ALGORITHM
from compiler_core.kernels.nn import PACKED_A
from compiler_core.kernels.schedules import PrefetchNext
from compiler_core.kernels.strassen import STRASSEN
from compiler_core.loop.ir import Prefetch
from compiler_core.loop.transform import walk_stmts
from compiler_core.schedule.primitives import apply
from compiler_core.target import host_target
from tests.conftest import measurement_errors
from tests.kernels.test_matmul_family import matmul_model as activations_model
from tests.kernels.test_packed_a import gemm_model, matmul_model
from tests.kernels.test_row_blocks import dense_task, fits


def prefetch_knob(task, algorithm="direct"):
    tunable = task.variants[algorithm].tunable if task.variants else task.tunable
    return next((k for k in tunable.knobs if k.name == "prefetch"), None)


def prefetches(task, config) -> list[Prefetch]:
    func = apply(task.lowered_for(config).func, task.records(config))
    return [s for s in walk_stmts(func.body) if isinstance(s, Prefetch)]


def test_prefetch_is_offered_to_compute_bound_gemms_by_constant_weights():
    knob = prefetch_knob(dense_task(gemm_model(64, 256, 128)))
    assert knob is not None and knob.choices == (0, 1)
    assert knob.default == int(host_target().prefetches_panels)
    assert knob.absent == 0  # records logged before the knob ran without it
    # 16 rows: 8 FLOPs a byte of B, which streams at the memory's pace (a GEMV's case).
    assert prefetch_knob(dense_task(gemm_model(16, 256, 128))) is None
    # Column tiles of the host's panel: two vectors (32 columns with AVX-512, 16 with AVX2).
    lanes = host_target().vector_lanes
    panel = 2 * lanes
    assert prefetch_knob(dense_task(gemm_model(64, 256, panel))) is None  # one column tile
    one_and_tail = gemm_model(64, 256, panel + lanes // 2)  # one panel, of 3 vectors
    assert prefetch_knob(dense_task(one_and_tail)) is None
    two_and_tail = gemm_model(64, 256, 2 * panel + 8)
    assert prefetch_knob(dense_task(two_and_tail)) is not None
    model, _ = activations_model([64, 256], [256, 128])  # B an activation: no constant
    assert prefetch_knob(dense_task(model)) is None


def test_the_next_column_tiles_panels_are_prefetched_where_the_knob_is_on():
    task = dense_task(gemm_model(64, 256, 128))
    on = {**task.default_config(), "prefetch": 1}
    assert any(isinstance(r, PrefetchNext) for r in task.records(on))
    assert prefetches(task, on)
    off = {**on, "prefetch": 0}
    assert not prefetches(task, off)
    assert not fits(task, {**on, "nr": 128})  # one column tile: nothing next
    half = host_target().vector_lanes  # half a panel: B's run jumps every other tile
    assert not fits(task, {**on, "nr": half})
    assert fits(task, {**on, "nr": half, "prefetch": 0})


def test_the_knob_is_off_by_default_where_the_cores_own_prefetchers_do_better():
    """Zen 3 and Zen 5 stream the next panels of B in by themselves (untuned mlp at batch 64
    10-13% and 1-5% faster without the software prefetches); other cores keep them on by
    default. The tuner offers both values everywhere."""
    from compiler_core.autotune.tasks import extract_tasks
    from compiler_core.frontend.onnx import import_model
    from compiler_core.passes.pipeline import optimize
    from compiler_core.target import parse_target

    for cpu, default in (("znver3", 0), ("znver5", 0), ("emeraldrapids", 1), ("znver4", 1)):
        target = parse_target(f"llvm -mcpu={cpu}")
        assert target.prefetches_panels is bool(default), cpu
        graph = optimize(import_model(gemm_model(64, 256, 128)), target=target)
        (task,) = [t for t in extract_tasks(graph, target) if t.template == "dense"]
        knob = prefetch_knob(task)
        assert (knob.default, knob.choices) == (default, (0, 1)), cpu


def test_prefetches_read_the_weights_parameter():
    task = dense_task(gemm_model(64, 256, 128))
    config = {**task.default_config(), "prefetch": 1}
    func = apply(task.lowered_for(config).func, task.records(config))
    params = {p.name for p in func.params}
    (buffer,) = {p.buffer.name for p in prefetches(task, config)}
    assert buffer in params


CASES = {
    "direct, both orders and parallel loops": (gemm_model(64, 256, 128), "direct"),
    "direct, a column tail": (gemm_model(64, 256, 200), "direct"),
    "packed A with row blocks": (gemm_model(200, 700, 96), PACKED_A),
    "a batch by shared weights": (matmul_model(40, 128, 96, (2,)), "direct"),
    "strassen's seven products": (gemm_model(64, 512, 512), STRASSEN),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_gemm_form_with_prefetch_computes_the_reference(case):
    model, algorithm = CASES[case]
    task = dense_task(model)
    base = task.algorithm_default(algorithm) if task.algorithms else task.default_config()
    assert prefetch_knob(task, algorithm) is not None
    configs = [
        {**base, "order": order, "parallel": parallel, "prefetch": 1}
        for order in ("ij", "ji")
        for parallel in ("outer", "fused")
    ]
    if algorithm == PACKED_A:
        configs = [{**c, "pack_a_at": "root"} for c in configs]
        configs += [{**configs[1], "row_block": 64}, {**configs[3], "row_block": 64}]
    configs = [c for c in configs if fits(task, c)]
    assert len(configs) >= 2 and all(prefetches(task, c) for c in configs)
    assert all(c.get(ALGORITHM, "direct") == algorithm for c in configs)
    errors = measurement_errors(task, configs)
    assert not errors, errors[:3]


@pytest.mark.parametrize("case", ["direct, a column tail", "strassen's seven products"])
def test_every_config_with_prefetch_in_a_space_schedules(case):
    """The template's fits is the whole contract: each config it lets through with the knob
    on schedules (no `PrefetchNext` on a run of B that is not affine) and prefetches."""
    task = dense_task(CASES[case][0])
    with_prefetch = [c for c in task.space() if c.get("prefetch")]
    assert len(with_prefetch) >= 12  # 16 with AVX2's 16-column panels, more with AVX-512's
    assert all(prefetches(task, c) for c in with_prefetch)
