"""One and two levels of Strassen's algorithm for GEMMs by constant weights
(kernels/strassen.py): the block identities against numpy in float64, the rule that offers
the algorithm, whole Gemm and
MatMul kernels built with it (through a tuning record, as the tuner's choice reaches a build)
against ONNX Runtime, the tuner measuring it as a knob, and a choice a GEMM cannot take."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper

import compiler_core
from compiler_core.autotune.measure import MeasureOptions, Measurer, Result
from compiler_core.autotune.records import FileLog
from compiler_core.autotune.search import measured_record
from compiler_core.autotune.tasks import ALGORITHM, config_key, extract_tasks
from compiler_core.build import lower_group
from compiler_core.frontend.onnx import import_model
from compiler_core.kernels.base import KernelError
from compiler_core.kernels.schedules import TEMPLATES, default_schedule
from compiler_core.kernels.strassen import (
    ALPHA,
    BETA,
    GAMMA,
    STRASSEN,
    STRASSEN2,
    STRASSEN_PACKED,
    combined_weights,
    gemm_algorithms,
    strassen_tables,
)
from compiler_core.passes.pipeline import optimize
from compiler_core.runtime import load
from compiler_core.schedule.primitives import ReverseComputeInline
from compiler_core.target import host_target, parse_target
from tests.conftest import FLOAT, assert_close_to_scale, make_model

RNG = np.random.default_rng(31)
AVX2 = parse_target("llvm -mattr=+avx2,+fma")
AVX512 = parse_target("llvm -mattr=+avx2,+fma,+avx512f")


def rand(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def blocks(x):
    """[2r, 2c] -> the four [r, c] blocks, row-major."""
    r, c = x.shape[0] // 2, x.shape[1] // 2
    return [x[:r, :c], x[:r, c:], x[r:, :c], x[r:, c:]]


def test_seven_products_make_the_block_product():
    a, b = RNG.standard_normal((6, 8)), RNG.standard_normal((8, 10))
    a_blocks, b_blocks = blocks(a), blocks(b)
    products = [
        sum(x * m for x, m in zip(alpha, a_blocks, strict=True))
        @ sum(y * m for y, m in zip(beta, b_blocks, strict=True))
        for alpha, beta in zip(ALPHA, BETA, strict=True)
    ]
    c_blocks = [sum(g[c] * m for g, m in zip(GAMMA, products, strict=True)) for c in range(4)]
    c = np.block([[c_blocks[0], c_blocks[1]], [c_blocks[2], c_blocks[3]]])
    np.testing.assert_allclose(c, a @ b, rtol=1e-12, atol=1e-12)
    # The build-time sums of B's blocks are the products' right-hand factors.
    combined = combined_weights(b.astype(np.float32))
    for beta, factor in zip(BETA, combined, strict=True):
        expected = sum(y * m for y, m in zip(beta, blocks(b), strict=True))
        np.testing.assert_allclose(factor, expected, rtol=1e-6, atol=1e-6)


def grid_blocks(x, side):
    """[side r, side c] -> its side x side blocks of [r, c], row-major."""
    r, c = x.shape[0] // side, x.shape[1] // side
    return [x[i * r : (i + 1) * r, j * c : (j + 1) * c] for i in range(side) for j in range(side)]


def test_two_levels_make_the_block_product_from_49_products():
    """The Kronecker squares of the one-level tables over a 4 x 4 grid of blocks: 49 products
    of sums of one to four blocks of A and of B, each output block a sum of 4 to 16 of them."""
    alpha, beta, gamma = strassen_tables(2)
    assert alpha.shape == beta.shape == gamma.shape == (49, 16)
    a, b = RNG.standard_normal((8, 12)), RNG.standard_normal((12, 16))
    a_blocks, b_blocks = grid_blocks(a, 4), grid_blocks(b, 4)
    products = [
        sum(x * m for x, m in zip(al, a_blocks, strict=True))
        @ sum(y * m for y, m in zip(be, b_blocks, strict=True))
        for al, be in zip(alpha, beta, strict=True)
    ]
    c_blocks = [sum(g * m for g, m in zip(gamma[:, c], products, strict=True)) for c in range(16)]
    c = np.block([c_blocks[4 * i : 4 * i + 4] for i in range(4)])
    np.testing.assert_allclose(c, a @ b, rtol=1e-12, atol=1e-12)
    assert sorted({int(n) for n in np.count_nonzero(gamma, axis=0)}) == [4, 8, 16]
    combined = combined_weights(b.astype(np.float32), levels=2)
    for be, factor in zip(beta, combined, strict=True):
        expected = sum(y * m for y, m in zip(be, b_blocks, strict=True))
        np.testing.assert_allclose(factor, expected, rtol=1e-6, atol=1e-6)
    one = strassen_tables(1)
    assert all(np.array_equal(t, u) for t, u in zip(one, (ALPHA, BETA, GAMMA), strict=True))


def test_the_rule_offers_strassen_to_large_gemms_that_halve():
    both = ("direct", STRASSEN)
    levels = ("direct", STRASSEN, STRASSEN2)
    assert gemm_algorithms(64, 784, 1024, 16) == levels  # MLP at batch 64: 16-row quarters
    assert gemm_algorithms(32, 784, 1024, 16) == both  # ... at 32: 8-row quarters, too few
    assert gemm_algorithms(64, 784, 1056, 8) == both  # quarters not whole 16-column panels
    assert gemm_algorithms(2048, 2048, 2048, 16) == levels
    assert gemm_algorithms(128, 1024, 256, 16) == levels  # a transformer's second FFN GEMM
    assert gemm_algorithms(1024, 256, 1024, 16) == ("direct",)  # ... its first: too shallow
    assert gemm_algorithms(63, 784, 1024, 16) == ("direct",)  # odd rows
    assert gemm_algorithms(64, 785, 1024, 16) == ("direct",)  # odd depth
    assert gemm_algorithms(64, 784, 1056, 16) == ("direct",)  # halves not whole panels
    assert gemm_algorithms(64, 784, 1056, 8) == both  # ... of 16 columns, they are
    assert gemm_algorithms(1, 784, 1024, 16) == ("direct",)  # one row
    assert gemm_algorithms(128, 256, 256, 16) == ("direct",)  # too little work to gain
    assert gemm_algorithms(64, 512, 512, 16) == levels  # the least work that gains: 2^24 MACs
    assert gemm_algorithms(64, 512, 510, 16) == ("direct",)


def gemm_model(rows, depth, columns, trans_b=1, alpha=1.0, beta=1.0, bias_shape=(-1,), relu=True):
    """Gemm by constant weights [+ bias] [-> Relu]; `bias_shape` None: no bias."""
    w = rand(*((columns, depth) if trans_b else (depth, columns)), scale=depth**-0.5)
    weights = {"w": w}
    inputs = ["x", "w"]
    if bias_shape is not None:
        shape = tuple(columns if d == -1 else d for d in bias_shape)
        weights["b"] = rand(*shape)
        inputs.append("b")
    attrs = {"transB": trans_b, "alpha": alpha, "beta": beta}
    nodes = [helper.make_node("Gemm", inputs, ["y" if relu else "z"], **attrs)]
    if relu:
        nodes.append(helper.make_node("Relu", ["y"], ["z"]))
    return make_model(
        nodes, [("x", FLOAT, [rows, depth])], [("z", FLOAT, [rows, columns])], weights
    )


def matmul_model(rows, depth, columns, batch=(1,)):
    """MatMul of a [*batch, rows, depth] activation by constant weights, then Add of a bias."""
    weights = {"w": rand(depth, columns, scale=depth**-0.5), "b": rand(columns)}
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["y"]),
        helper.make_node("Add", ["y", "b"], ["z"]),
    ]
    x, z = [*batch, rows, depth], [*batch, rows, columns]
    return make_model(nodes, [("x", FLOAT, x)], [("z", FLOAT, z)], weights)


CASES = {
    "gemm_bias_relu": lambda: gemm_model(64, 512, 512),
    "gemm_untransposed_scaled_matrix_bias": lambda: gemm_model(
        32, 1024, 640, trans_b=0, alpha=0.5, beta=2.0, bias_shape=(32, -1)
    ),
    "gemm_no_bias_no_epilogue": lambda: gemm_model(48, 600, 768, bias_shape=None, relu=False),
    # 40 rows: each product's 20 rows pad to a whole register tile.
    "gemm_padded_product_rows": lambda: gemm_model(40, 800, 768),
    "matmul_add": lambda: matmul_model(128, 1024, 256),
    # Every row of every batch is a row of the GEMM: 2 x 64 rows, and 4 x 10 rows whose
    # halves (20 rows, padded in the products) split the second batch.
    "batched_matmul_add": lambda: matmul_model(64, 512, 512, batch=(2,)),
    "batched_rows_split_a_batch": lambda: matmul_model(10, 1024, 1024, batch=(2, 2)),
}
# The cases two levels apply to (rows, depth and columns in quarters of whole panels).
TWO_LEVEL_CASES = ("gemm_bias_relu", "matmul_add", "batched_matmul_add")


@pytest.fixture(scope="module")
def measurer():
    with Measurer(host_target(), MeasureOptions(repeats=2, min_repeat_seconds=0.001)) as m:
        yield m


def strassen_log(model, path, measurer, measure=False, algorithm=STRASSEN):
    """A tuning log whose record for every GEMM task that can run Strassen's algorithm picks
    it (`algorithm`, its template's default knobs), timed by `measurer` when `measure`."""
    tasks = [t for t in extract_tasks(optimize(import_model(model)), host_target()) if t.algorithms]
    with FileLog(path) as log:
        for task in tasks:
            config = next(c for c in task.space() if c[ALGORITHM] == algorithm)
            (result,) = measurer.measure(task, [config]) if measure else (Result((1e-6,)),)
            log.append(measured_record(task, config, result, measurer))
    return tasks


# The cases whose products read the sums in row-tile panels too: tiles that pad the rows (20
# rows a product, 40 split across two batches) or not, a bias of its own shape, no epilogue.
PACKED_CASES = (
    "gemm_bias_relu",
    "gemm_untransposed_scaled_matrix_bias",
    "gemm_no_bias_no_epilogue",
    "gemm_padded_product_rows",
    "batched_rows_split_a_batch",
)


@pytest.mark.parametrize(
    "name, algorithm",
    [(name, STRASSEN) for name in CASES]
    + [(name, STRASSEN_PACKED) for name in PACKED_CASES]
    + [(name, STRASSEN2) for name in TWO_LEVEL_CASES],
)
def test_strassen_gemms_match_onnxruntime(name, algorithm, tmp_path, measurer):
    model = CASES[name]()
    tasks = strassen_log(model, tmp_path / "t.jsonl", measurer, measure=True, algorithm=algorithm)
    assert len(tasks) == 1 and {"direct", algorithm} <= tasks[0].variants.keys(), name
    archive = compiler_core.compile(model, tuning=str(tmp_path / "t.jsonl"))
    assert archive.manifest["verification"]["passed"], archive.manifest["verification"]
    (note,) = [k for k in archive.manifest["kernels"].values() if isinstance(k, dict)]
    assert note["config"][ALGORITHM] == algorithm
    x = model.graph.input[0].type.tensor_type.shape.dim
    feeds = {"x": rand(*(d.dim_value for d in x))}
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = session.run(["z"], feeds)[0]
    assert_close_to_scale(load(archive).run(feeds)["z"], expected, label=name)


def test_a_build_from_explicit_configs_runs_each_named_task_at_its_config():
    """`compile_graph(configs=...)` (how the in-model check builds configs nobody measured):
    the named task at its config, noted "configured" in the manifest, equal to ONNX Runtime;
    a config the template refuses, or a log and configs at once, is an error."""
    from compiler_core.compiler import compile_graph

    model = gemm_model(64, 512, 512)
    graph = optimize(import_model(model))
    (task,) = extract_tasks(graph, host_target())
    config = next(c for c in task.space() if c[ALGORITHM] == STRASSEN)
    archive = compile_graph(graph, host_target(), configs={task.key: config})
    assert archive.manifest["verification"]["passed"], archive.manifest["verification"]
    (note,) = [k for k in archive.manifest["kernels"].values() if isinstance(k, dict)]
    assert note["schedule"] == "configured" and note["config"] == config
    feeds = {"x": rand(64, 512)}
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = session.run(["z"], feeds)[0]
    assert_close_to_scale(load(archive).run(feeds)["z"], expected, label="configured")
    with pytest.raises(ValueError, match="mr"):
        compile_graph(graph, host_target(), configs={task.key: {**config, "mr": 10_000}})
    with pytest.raises(ValueError, match="not both"):
        compile_graph(graph, host_target(), tuning="log.jsonl", configs={task.key: config})


def strassen_stages(model, algorithm=STRASSEN, target=None):
    target = target or host_target()
    graph = optimize(import_model(model), target=target)
    (group,) = graph.groups
    return lower_group(graph, group, 0, target, {"gemm_algorithm": algorithm}).stages


def gemm_algorithms_of(model, target):
    (task,) = extract_tasks(optimize(import_model(model), target=target), target)
    return task.algorithms


def test_strassen_over_packed_sums_is_offered_where_its_products_could_pack_a():
    """Strassen's products read the sums of A's blocks in row-tile panels where Strassen
    applies and its products (half the rows, depth and columns) hold two packed row tiles."""
    for target in (AVX2, AVX512):
        assert STRASSEN_PACKED in gemm_algorithms_of(gemm_model(64, 512, 512), target)
    # 8 rows a product: one AVX-512 tile holds them all; AVX2's 4-row tiles take two.
    assert STRASSEN_PACKED not in gemm_algorithms_of(gemm_model(16, 1024, 1024), AVX512)
    assert STRASSEN_PACKED in gemm_algorithms_of(gemm_model(16, 1024, 1024), AVX2)
    assert STRASSEN_PACKED not in gemm_algorithms_of(gemm_model(63, 512, 512), AVX2)


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_the_packed_sums_are_row_tile_panels_that_fix_the_products_row_tile(target):
    """The pass over A writes each product's sums as [tiles, K/2, mr] panels (rows past the
    real ones repeat the last), and the products' template offers that row tile only."""
    stages = strassen_stages(gemm_model(40, 800, 768), STRASSEN_PACKED, target)
    (sums,) = [s for s in stages if s.name.startswith("strsa")]
    (product,) = [s for s in stages if s.note("packed_rows")]
    mr = product.note("mr")
    assert sums.shape == (7, -(-20 // mr), 400, mr)
    assert product.shape[:2] == (7, sums.shape[1] * mr)
    knobs = {k.name: k for k in TEMPLATES["dense"].knobs(product, target)}
    assert knobs["mr"].choices == (mr,) and "pack_a_at" not in knobs


def test_two_levels_sum_16_blocks_of_a_for_49_products_and_unroll_a_4_by_4_grid():
    stages = strassen_stages(gemm_model(64, 512, 512), STRASSEN2)
    (sums,) = [s for s in stages if s.name.startswith("strsa")]
    (out,) = [s for s in stages if s.name.startswith("strout")]
    assert sums.shape == (49, 16, 128)
    assert out.note("strassen_output") == (16, 128)  # the grid's blocks: 16 rows, 128 columns
    (product,) = [s for s in stages if s.note("algorithm") == STRASSEN2]
    assert product.shape[0] == 49


def test_the_epilogue_runs_in_the_output_sums():
    """Bias and Relu are applied in the store of the pass that adds the output blocks, not in
    a pass of their own; the sums of A's blocks and the seven products are stages of the one
    kernel."""
    stages = strassen_stages(gemm_model(64, 512, 512))
    names = [s.name for s in stages]
    assert any(n.startswith("strsa") for n in names), names
    assert any(n.startswith("strout") for n in names), names
    last = stages[-1].name
    assert last.startswith("relu") and ReverseComputeInline(last) in default_schedule(
        stages, host_target()
    )


def test_a_gemm_that_cannot_run_strassen_refuses_the_choice():
    with pytest.raises(KernelError, match="no 'strassen' GEMM"):
        strassen_stages(gemm_model(63, 512, 512))  # odd rows
    with pytest.raises(KernelError, match="no 'winograd' GEMM"):
        graph = optimize(import_model(gemm_model(64, 512, 512)), target=host_target())
        lower_group(graph, graph.groups[0], 0, host_target(), {"gemm_algorithm": "winograd"})


def test_the_tuner_measures_both_algorithms_against_the_reference(measurer, tmp_path):
    """The algorithm is a knob of the GEMM's task: the default (direct) and Strassen configs
    are built, checked against the reference and timed; the workload key is the direct
    GEMM's, so records from before the knob still apply."""
    model = gemm_model(64, 512, 512)
    (task,) = extract_tasks(optimize(import_model(model)), host_target())
    space = task.space()
    assert space[0] == task.default_config() and space[0][ALGORITHM] == "direct"
    strassen = [c for c in space if c[ALGORITHM] == STRASSEN]
    assert strassen and len(strassen) < len(space)
    results = measurer.measure(task, [space[0], *strassen[:2]])
    assert [r.error for r in results] == ["ok"] * 3, results
    tasks = strassen_log(model, tmp_path / "t.jsonl", measurer, measure=True)
    assert tasks[0].key == task.key


def test_the_in_model_check_also_times_the_tuned_algorithm_at_its_default_knobs(measurer, tmp_path):
    """A tuned config that runs Strassen's algorithm at other knobs than the template's
    defaults: the in-model check times it, the direct default, and Strassen's default knobs
    (a third build), and the fastest of the three in the model becomes the task's best."""
    from compiler_core.autotune.in_model import check_in_model

    graph = optimize(import_model(gemm_model(64, 512, 512)))
    (task,) = extract_tasks(graph, host_target())
    variant, _ = task.variant({ALGORITHM: STRASSEN})
    knobs_default = {ALGORITHM: STRASSEN, **variant.tunable.default_config()}
    tuned = next(c for c in task.space() if c[ALGORITHM] == STRASSEN and c != knobs_default)
    log = FileLog(tmp_path / "t.jsonl")
    for config, cost in ((task.default_config(), 1e-3), (tuned, 1e-6)):
        log.append(measured_record(task, config, Result((cost,)), measurer))
    (timing,) = check_in_model(graph, host_target(), [task], log, measurer, rounds=2)
    ((alternative, times),) = timing.alternatives
    assert alternative == knobs_default and len(times) == 2
    in_model = [r for r in log.records() if r.in_model]
    assert [r.config for r in in_model] == [tuned, task.default_config(), knobs_default]
    fastest = min(timing.candidates(), key=lambda c: np.median(c[1]))[0]
    assert log.best(task.key, measurer.fingerprint).config == fastest


def test_the_tuner_summary_names_the_config_builds_apply(measurer, tmp_path):
    """When the in-model check prefers another config than the search's fastest alone, the
    summary line of `kiln tune` says which one builds apply."""
    import types

    from compiler_core.cli import _applied

    (task,) = extract_tasks(optimize(import_model(gemm_model(64, 512, 512))), host_target())
    alone, other = task.space()[1], task.space()[2]
    state = types.SimpleNamespace(task=task, best_config=alone)
    with FileLog(tmp_path / "t.jsonl") as log:
        log.append(measured_record(task, alone, Result((1e-6,)), measurer))
        assert _applied(log, state, measurer) == ""  # no in-model timing yet
        for config, cost in ((alone, 3e-6), (other, 2e-6)):
            record = measured_record(task, config, Result((cost,)), measurer)
            log.append(dataclasses.replace(record, retimed=True, in_model=True))
        applied = log.best(task.key, measurer.fingerprint).config
        assert config_key(applied) == config_key(other)
        assert _applied(log, state, measurer) == (
            f"; in the model {applied} ran faster: builds apply it"
        )
