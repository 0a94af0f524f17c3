"""Row blocks of a packed-A GEMM (the dense template's `row_block` knob): where A outgrows
the L2, its rows are cut into blocks with the column tiles inside each block, so that a block
of A stays in L2 for every column tile. Which GEMMs are offered it, the configs the template
refuses, and every block size with both parallel loops, against the reference answer."""

from __future__ import annotations

import pytest

from compiler_core.autotune.tasks import ALGORITHM, config_of_knobs, extract_tasks
from compiler_core.frontend.onnx import import_model
from compiler_core.kernels.nn import PACKED_A
from compiler_core.kernels.schedules import GEMM_L2_BYTES, Reorder, Split
from compiler_core.passes.pipeline import optimize
from tests.conftest import measurement_errors
from tests.kernels.test_matmul_family import matmul_model as batched_model
from tests.kernels.test_packed_a import gemm_model, matmul_model


def dense_task(model):
    (task,) = [t for t in extract_tasks(optimize(import_model(model))) if t.template == "dense"]
    return task


def fits(task, config) -> bool:
    tunable = task.variants[config.get(ALGORITHM, "direct")].tunable
    return tunable.fits(config_of_knobs(config))


def row_blocks(task, algorithm="direct") -> tuple:
    tunable = task.variants[algorithm].tunable if task.variants else task.tunable
    knobs = {k.name: k for k in tunable.knobs}
    return knobs["row_block"].choices if "row_block" in knobs else ()


def test_row_blocks_are_offered_where_a_outgrows_the_l2():
    # 200 x 700 floats of A: 560 KB, over GEMM_L2_BYTES; blocks of up to 2 x that budget.
    assert GEMM_L2_BYTES < 200 * 700 * 4
    task = dense_task(gemm_model(200, 700, 64))
    assert row_blocks(task, PACKED_A) == (0, 32, 64, 128)
    assert row_blocks(task) == ()  # the direct GEMM: its rows a stride apart, no gain
    default = task.algorithm_default(PACKED_A)
    assert default.get("row_block", 0) == 0  # untuned builds do not change
    assert row_blocks(dense_task(gemm_model(64, 700, 64)), PACKED_A) == ()  # A fits the L2
    # A batch by shared weights is more rows of one GEMM (400 here).
    task = dense_task(matmul_model(200, 700, 64, batch=(2,)))
    assert row_blocks(task, PACKED_A)[-1] == 256
    model, _ = batched_model([2, 200, 700], [2, 700, 64])  # of two activations: no packed A
    assert row_blocks(dense_task(model)) == ()


def test_a_block_is_refused_where_the_row_tiles_are_outermost_or_it_is_all_the_rows():
    task = dense_task(gemm_model(200, 700, 64))
    config = {**task.algorithm_default(PACKED_A), "order": "ji", "pack_a_at": "root"}
    assert fits(task, {**config, "row_block": 64})
    assert not fits(task, {**config, "row_block": 64, "order": "ij"})
    assert not fits(task, {**config, "row_block": 64, "pack_a_at": "tile"})
    assert not fits(task, {**config, "row_block": 128 * config["mr"]})  # 200 rows: one block


def test_the_blocked_nest_splits_the_row_tiles_outside_the_column_tiles():
    task = dense_task(gemm_model(200, 700, 64))
    config = {**task.algorithm_default(PACKED_A), "order": "ji", "pack_a_at": "root"}
    config["row_block"] = 64
    records = task.records(config)
    splits = [r for r in records if isinstance(r, Split)]
    (row_tile,) = [s for s in splits if s.factor == config["mr"]]
    (block,) = [s for s in splits if s.loop == row_tile.outer]
    (columns,) = [s for s in splits if s.factor == config["nr"]]
    assert block.factor == max(64 // config["mr"], 1)
    (order,) = [r.loops for r in records if isinstance(r, Reorder)]
    assert order[:3] == (block.outer, columns.outer, block.inner)


@pytest.mark.parametrize("model", [gemm_model(200, 700, 64), matmul_model(100, 700, 64, (2,))])
def test_every_row_block_computes_the_gemm(model):
    task = dense_task(model)
    # Panels packed a tile at a time would need the row tiles outermost.
    base = {**task.algorithm_default(PACKED_A), "order": "ji", "pack_a_at": "root"}
    configs = [
        {**base, "parallel": parallel, "row_block": rows}
        for rows in row_blocks(task, PACKED_A)[1:]
        for parallel in ("outer", "fused")
    ]
    configs = [c for c in configs if fits(task, c)]
    assert len(configs) == 6
    errors = measurement_errors(task, configs)
    assert not errors, errors[:3]
