"""The packed-A GEMM (kernels/nn.py `_packed_a_product`): A packed into [rows / mr, K, mr]
row-tile panels before the register tiles read it, an algorithm the tuner may pick for a GEMM
by constant weights. Its row tile, the rule that offers it, whole Gemm and MatMul kernels
built with it (both places of the packing) against ONNX Runtime, and the configs the
template refuses."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper

from compiler_core.autotune.tasks import ALGORITHM, extract_tasks
from compiler_core.compiler import compile_graph
from compiler_core.frontend.onnx import import_model
from compiler_core.kernels.nn import PACKED_A
from compiler_core.kernels.schedules import gemm_row_tile, packed_row_tile
from compiler_core.passes.pipeline import optimize
from compiler_core.runtime import load
from compiler_core.target import host_target, parse_target
from tests.conftest import FLOAT, assert_close_to_scale, make_model
from tests.kernels.test_strassen import matmul_model as strassen_matmul_model

RNG = np.random.default_rng(47)
AVX2 = parse_target("llvm -mattr=+avx2,+fma")
AVX512 = parse_target("llvm -mattr=+avx2,+fma,+avx512f")


def rand(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def test_a_packed_tile_takes_the_most_rows_the_registers_hold_unless_that_pads_many():
    # AVX2: 12 accumulators, 6 rows of two vectors. 1024 rows pad 2 rows for 6-row tiles,
    # where the direct GEMM, its rows 4 KB apart, takes 4 rows that pad none.
    assert packed_row_tile(1024, AVX2) == 6
    assert gemm_row_tile(1024, AVX2, row_bytes=4096) == 4
    assert packed_row_tile(64, AVX2) == 6  # 66 rows: 2 of 64 padded
    # 49 rows would pad 5 (more than 1/16 of them): the least padding instead.
    assert packed_row_tile(49, AVX2) == gemm_row_tile(49, AVX2) == 5
    assert packed_row_tile(1024, AVX512) == 14  # 28 accumulators
    assert packed_row_tile(4, AVX2) == 4  # one tile of all the rows


def gemm_model(rows, depth, columns, trans_b=1, alpha=1.0, beta=1.0, bias_shape=(-1,)):
    """Gemm by constant weights [+ bias], then Relu; `bias_shape` None: no bias."""
    w = rand(*((columns, depth) if trans_b else (depth, columns)), scale=depth**-0.5)
    weights, inputs = {"w": w}, ["x", "w"]
    if bias_shape is not None:
        weights["b"] = rand(*(columns if d == -1 else d for d in bias_shape))
        inputs.append("b")
    nodes = [
        helper.make_node("Gemm", inputs, ["y"], transB=trans_b, alpha=alpha, beta=beta),
        helper.make_node("Relu", ["y"], ["z"]),
    ]
    return make_model(
        nodes, [("x", FLOAT, [rows, depth])], [("z", FLOAT, [rows, columns])], weights
    )


def matmul_model(rows, depth, columns, batch=()):
    """MatMul of a [*batch, rows, depth] activation by constant weights, then Add of a bias."""
    return strassen_matmul_model(rows, depth, columns, batch)


def the_task(model):
    graph = optimize(import_model(model), target=host_target())
    (task,) = [t for t in extract_tasks(graph, host_target()) if t.template == "dense"]
    return graph, task


def packed_config(task, **knobs):
    variant = task.variants[PACKED_A]
    return {ALGORITHM: PACKED_A, **variant.tunable.default_config(), **knobs}


def test_the_packed_form_is_offered_to_gemms_of_two_row_tiles_or_more_by_constant_weights():
    _, task = the_task(gemm_model(64, 512, 512))
    assert PACKED_A in task.algorithms and task.default_config()[ALGORITHM] == "direct"
    _, task = the_task(matmul_model(32, 256, 96, batch=(2,)))  # 64 rows, over a batch axis
    assert PACKED_A in task.algorithms
    _, one_tile = the_task(gemm_model(4, 512, 512))
    _, shallow = the_task(gemm_model(64, 32, 512))  # rows too short to gain from packing
    assert PACKED_A not in one_tile.algorithms and PACKED_A not in shallow.algorithms


CASES = {
    "gemm_bias_relu": lambda: gemm_model(64, 512, 512),
    "gemm_untransposed_scaled_matrix_bias": lambda: gemm_model(
        40, 300, 128, trans_b=0, alpha=0.5, beta=2.0, bias_shape=(40, -1)
    ),
    "gemm_padded_rows_no_bias": lambda: gemm_model(50, 256, 256, bias_shape=None),
    "matmul_add": lambda: matmul_model(96, 256, 128),
    # The rows of every batch are rows of one GEMM; 3 x 15 rows end inside a tile.
    "matmul_rows_over_batches": lambda: matmul_model(15, 128, 64, batch=(3,)),
    "matmul_rows_over_two_batch_axes": lambda: matmul_model(10, 96, 64, batch=(2, 2)),
}


@pytest.mark.parametrize("at", ["tile", "root"])
@pytest.mark.parametrize("name", list(CASES))
def test_packed_gemms_match_onnxruntime(name, at):
    model = CASES[name]()
    graph, task = the_task(model)
    # Packing in the row-tile loop takes the row tiles outermost, in one nest.
    config = packed_config(task, order="ij", parallel="outer", pack_a_at=at)
    if at == "tile" and not task.variants[PACKED_A].tunable.fits(
        {k: v for k, v in config.items() if k != ALGORITHM}
    ):
        config = {**config, "nr": 16}  # a whole number of column tiles: no tail nest
    archive = compile_graph(graph, host_target(), configs={task.key: config})
    assert archive.manifest["verification"]["passed"], archive.manifest["verification"]
    (note,) = [k for k in archive.manifest["kernels"].values() if isinstance(k, dict)]
    assert note["config"] == config
    x = model.graph.input[0].type.tensor_type.shape.dim
    feeds = {"x": rand(*(d.dim_value for d in x))}
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = session.run(["z"], feeds)[0]
    assert_close_to_scale(load(archive).run(feeds)["z"], expected, label=f"{name} at {at}")


def test_packing_in_the_row_tile_loop_needs_the_row_tiles_outermost_in_one_nest():
    graph, task = the_task(gemm_model(64, 512, 512))
    tunable = task.variants[PACKED_A].tunable
    base = {k: v for k, v in packed_config(task, order="ij", parallel="outer").items()}
    base.pop(ALGORITHM)
    assert tunable.fits({**base, "pack_a_at": "tile"})
    assert not tunable.fits({**base, "pack_a_at": "tile", "order": "ji"})
    assert not tunable.fits({**base, "pack_a_at": "tile", "parallel": "fused"})
    assert tunable.fits({**base, "pack_a_at": "root", "order": "ji"})
    # The packed panels are mr rows wide: the row tile is not a free knob.
    with pytest.raises(ValueError, match="mr"):
        compile_graph(
            graph, host_target(), configs={task.key: packed_config(task, mr=base["mr"] + 1)}
        )
    # Every packed config the tuner may try places the packing where it can run.
    space = [c for c in task.space() if c.get(ALGORITHM) == PACKED_A]
    assert space and all(c["order"] == "ij" for c in space if c["pack_a_at"] == "tile")


def test_the_in_model_check_also_times_each_other_algorithms_fastest_config(tmp_path):
    """A GEMM tuned to Strassen's algorithm whose log also holds packed-A configs: the
    in-model check builds the packed form's fastest config alone too (not its slower one,
    nor a faster record whose knobs the template no longer takes), and the fastest of all in
    the model becomes the task's best."""
    from compiler_core.autotune.in_model import check_in_model
    from compiler_core.autotune.measure import MeasureOptions, Measurer, Result
    from compiler_core.autotune.records import FileLog
    from compiler_core.autotune.search import measured_record
    from compiler_core.kernels.strassen import STRASSEN

    graph, task = the_task(gemm_model(64, 512, 512))
    strassen = {ALGORITHM: STRASSEN, **task.variants[STRASSEN].tunable.default_config()}
    packed = packed_config(task)
    slower = packed_config(task, order="ji" if packed["order"] == "ij" else "ij")
    stale = packed_config(task, mr=packed["mr"] + 1)  # the panels' width is the row tile
    costs = ((task.default_config(), 1e-3), (strassen, 1e-6), (packed, 2e-6), (slower, 3e-6))
    costs += ((stale, 1.5e-6),)
    with Measurer(host_target(), MeasureOptions(repeats=2, min_repeat_seconds=0.001)) as measurer:
        log = FileLog(tmp_path / "t.jsonl")
        for config, cost in costs:
            log.append(measured_record(task, config, Result((cost,)), measurer))
        (timing,) = check_in_model(graph, host_target(), [task], log, measurer, rounds=2)
    assert [config for config, _ in timing.alternatives] == [packed]
    in_model = [r.config for r in log.records() if r.in_model]
    assert in_model == [strassen, task.default_config(), packed]
    fastest = min(timing.candidates(), key=lambda c: np.median(c[1]))[0]
    assert log.best(task.key, measurer.fingerprint).config == fastest


def test_kiln_tune_names_each_alternative_timed_in_the_model(tmp_path, capsys):
    """`kiln tune`'s in-model lines name every config the check built: an algorithm at its
    default knobs, or the knobs that differ from them (a record from before the algorithm
    knob ran the direct GEMM)."""
    from compiler_core.autotune.measure import MeasureOptions, Measurer, Result
    from compiler_core.autotune.records import FileLog
    from compiler_core.autotune.search import measured_record
    from compiler_core.cli import _check_in_model
    from compiler_core.kernels.strassen import STRASSEN

    graph, task = the_task(gemm_model(64, 512, 512))
    strassen = {ALGORITHM: STRASSEN, **task.variants[STRASSEN].tunable.default_config()}
    direct = {k: v for k, v in task.default_config().items() if k != ALGORITHM}
    direct["order"] = "ji" if direct["order"] == "ij" else "ij"  # no algorithm knob: direct
    costs = ((task.default_config(), 1e-3), (strassen, 1e-6), (direct, 2e-6))
    costs += ((packed_config(task), 3e-6),)
    with Measurer(host_target(), MeasureOptions(repeats=2, min_repeat_seconds=0.001)) as measurer:
        log = FileLog(tmp_path / "t.jsonl")
        for config, cost in costs:
            log.append(measured_record(task, config, Result((cost,)), measurer))
        _check_in_model(graph, host_target(), [task], log, measurer, threads=None)
    out = capsys.readouterr().out
    assert "checked in the model: 1 tuned tasks" in out
    assert f"direct order={direct['order']} " in out and "packed_a at its default knobs " in out


def test_untuned_a_gemm_of_many_rows_runs_packed_on_avx2():
    """With AVX2's 16 registers a GEMM of 256 rows or more whose direct tile is held to
    fewer rows (4, to pad none) than the packed one (6) runs packed untuned, and matches ONNX
    Runtime; fewer rows, a direct tile as tall as the packed one, or AVX-512's registers
    keep the direct GEMM."""
    import compiler_core

    def default_algorithm(model, target):
        graph = optimize(import_model(model), target=target)
        (task,) = [t for t in extract_tasks(graph, target) if t.template == "dense"]
        return task.default_config()[ALGORITHM]

    model = matmul_model(256, 128, 64)
    assert default_algorithm(model, AVX2) == PACKED_A
    assert default_algorithm(matmul_model(128, 128, 64), AVX2) == "direct"
    assert default_algorithm(matmul_model(258, 128, 64), AVX2) == "direct"  # 6-row tiles
    assert default_algorithm(model, AVX512) == "direct"
    module = load(compiler_core.compile(model, target=str(AVX2)))
    feeds = {"x": rand(256, 128)}
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = session.run(["z"], feeds)[0]
    assert_close_to_scale(module.run(feeds)["z"], expected, label="untuned packed")
