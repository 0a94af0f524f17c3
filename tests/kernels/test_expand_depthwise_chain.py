"""A 1x1 expand conv chained into the depthwise conv that reads it (one kernel computing the
expanded channels a tile of rows at a time): against ONNX Runtime, at every knob value the
tuner may pick, and the fusion rule's limits."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper

import compiler_core
from compiler_core.autotune.tasks import extract_tasks
from compiler_core.frontend.onnx import import_model
from compiler_core.passes.pipeline import optimize
from compiler_core.runtime import load
from compiler_core.target import host_target
from tests.conftest import (
    FLOAT,
    assert_close_to_scale,
    make_model,
    measurement_errors,
    one_knob_off_default,
    parallel_loop,
)

RNG = np.random.default_rng(5)


def rand(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def expand_depthwise(c=16, m=96, size=(20, 20), stride=1, kernel=3, expand_pads=0, expand_stride=1):
    """x -> 1x1 conv (c -> m, `expand_pads` / `expand_stride`: one the chain must refuse)
    -> ReLU6 -> depthwise kxk conv (pad k//2, `stride`) -> ReLU6 -> y."""
    pad = kernel // 2
    nodes = [
        helper.make_node(
            "Conv",
            ["x", "we", "be"],
            ["e"],
            name="expand",
            kernel_shape=[1, 1],
            pads=[expand_pads] * 4,
            strides=[expand_stride] * 2,
        ),
        helper.make_node("Clip", ["e", "lo", "hi"], ["e6"], name="relu6a"),
        helper.make_node(
            "Conv",
            ["e6", "wd", "bd"],
            ["d"],
            name="depthwise",
            kernel_shape=[kernel, kernel],
            strides=[stride, stride],
            pads=[pad] * 4,
            group=m,
        ),
        helper.make_node("Clip", ["d", "lo", "hi"], ["y"], name="relu6b"),
    ]
    grown = [(s + 2 * expand_pads - 1) // expand_stride + 1 for s in size]
    out = [(s + 2 * pad - kernel) // stride + 1 for s in grown]
    weights = {
        "we": rand(m, c, 1, 1, scale=0.4),
        "be": rand(m, scale=0.5),
        "wd": rand(m, 1, kernel, kernel, scale=0.4),
        "bd": rand(m, scale=0.5),
        "lo": np.array(0.0, np.float32),
        "hi": np.array(6.0, np.float32),
    }
    return make_model(nodes, [("x", FLOAT, [1, c, *size])], [("y", FLOAT, [1, m, *out])], weights)


def ort_output(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["y"], feeds)[0]


CASES = {
    "stride1": lambda: expand_depthwise(size=(20, 20)),
    "stride2": lambda: expand_depthwise(size=(20, 20), stride=2),
    "stride2_odd": lambda: expand_depthwise(c=8, m=48, size=(15, 13), stride=2),
    "kernel5": lambda: expand_depthwise(size=(14, 14), kernel=5),
    "wide_rows": lambda: expand_depthwise(c=24, m=144, size=(9, 56)),
    # MobileNetV2's last stage: rows of 7, which on AVX2 no tile of several blocks divides.
    "rows_of_seven": lambda: expand_depthwise(c=16, m=48, size=(7, 7)),
    # Rows of a prime width: both convs compute rows padded to a good register tile.
    "prime_width": lambda: expand_depthwise(c=16, m=32, size=(11, 23)),
    # Three rows of 1500 pixels exceed the largest stack tile: tiles of one row, computed in
    # the group's workspace buffer.
    "row_wider_than_a_tile": lambda: expand_depthwise(c=8, m=16, size=(4, 1500)),
}


def chained_groups(model):
    graph = optimize(import_model(model), target=host_target())
    ops = [[graph.node_by_name[n].op for n in group.nodes] for group in graph.groups]
    return graph, ops


@pytest.mark.parametrize("name", list(CASES))
def test_expand_and_depthwise_share_a_kernel_and_match_onnxruntime(name):
    model = CASES[name]()
    _, ops = chained_groups(model)
    assert ["Conv", "Clip", "Conv", "Clip"] in ops, ops
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    feeds = {"x": rand(*shape)}
    module = load(compiler_core.compile(model))
    assert_close_to_scale(module.run(feeds)["y"], ort_output(model, feeds), label=name)


def test_a_chained_pair_is_one_task_of_the_chain_template_counting_both_convs():
    graph, _ = chained_groups(CASES["stride2"]())
    (task,) = extract_tasks(graph)
    assert task.tunable.template.name == "conv2d_nchwc_chain"
    expand = 2 * 96 * 16 * 20 * 20
    depthwise = 2 * 96 * 9 * 10 * 10
    assert task.flops == pytest.approx(expand + depthwise)


def test_every_knob_value_of_a_chained_pair_measures_correct():
    """Each knob off its default, one at a time (tiles of one row up to the whole plane, every
    register tile of both convs), checked by the measurer against the reference answer."""
    graph, _ = chained_groups(CASES["stride2_odd"]())
    (task,) = extract_tasks(graph)
    configs = one_knob_off_default(task.tunable)
    assert len({c["rows"] for c in configs}) > 1
    errors = measurement_errors(task, configs)
    assert not errors, errors[:3]


def shared_expansion():
    """The expanded tensor is also a graph output: it must be written whole anyway."""
    model = expand_depthwise()
    model.graph.output.append(helper.make_tensor_value_info("e6", FLOAT, [1, 96, 20, 20]))
    return model


@pytest.mark.parametrize(
    "name, model",
    [
        ("padded expand", lambda: expand_depthwise(expand_pads=1)),
        ("strided expand", lambda: expand_depthwise(expand_stride=2)),
        ("expansion read twice", shared_expansion),
    ],
)
def test_no_chain_where_the_expand_conv_is_not_a_plain_pointwise_one(name, model):
    model = model()
    _, ops = chained_groups(model)
    assert ["Conv", "Clip", "Conv", "Clip"] not in ops, (name, ops)
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    feeds = {"x": rand(*shape)}
    module = load(compiler_core.compile(model))
    assert_close_to_scale(module.run(feeds)["y"], ort_output(model, feeds), label=name)


# --- tiles of several channel blocks (the `blocks` knob) --------------------------------------

AVX2 = "llvm -mattr=+avx2,+fma"
AVX512 = "llvm -mattr=+avx2,+fma,+avx512f"


def chain_task(model, target_text):
    from compiler_core.target import parse_target

    target = parse_target(target_text)
    (task,) = extract_tasks(optimize(import_model(model), target=target), target)
    return task


@pytest.mark.parametrize("name", ["stride1", "stride2", "wide_rows"])
def test_on_avx2_a_chain_tile_spans_three_channel_blocks_and_matches_onnxruntime(name):
    """AVX2's FMAs take no broadcast operand: the expand conv's register tile spans three
    channel blocks, so each broadcast input feeds three FMAs; the depthwise conv then runs
    over the three blocks' rows one block at a time."""
    model = CASES[name]()
    default = chain_task(model, AVX2).default_config()
    assert default["blocks"] == 3, default
    assert default["expand_tile"] * 3 <= 12  # AVX2's accumulators
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    feeds = {"x": rand(*shape)}
    module = load(compiler_core.compile(model, target=AVX2))
    assert_close_to_scale(module.run(feeds)["y"], ort_output(model, feeds), label=name)


def test_on_avx2_rows_of_seven_take_three_blocks_of_four_pixels_the_last_tile_overlapping():
    """No divisor of 7 makes a tile of several blocks (1 pixel x 3 blocks holds 3
    accumulators): the expand conv takes tiles of 4 pixels, the last one moved back to end at
    the row's end (pixels 3-6: pixel 3 computed twice), 12 accumulators (Zen 3, MobileNetV2's
    7x7 chains: 155 -> 130 us against one block of 7 pixels)."""
    model = CASES["rows_of_seven"]()
    task = chain_task(model, AVX2)
    default = task.default_config()
    assert (default["blocks"], default["expand_tile"]) == (3, 4), default
    feeds = {"x": rand(1, 16, 7, 7)}
    module = load(compiler_core.compile(model, target=AVX2))
    assert_close_to_scale(module.run(feeds)["y"], ort_output(model, feeds), label="rows of 7")


def test_expand_tiles_are_the_row_divisors_and_tiles_that_overlap_at_most_a_seventh():
    from compiler_core.kernels.schedules import _expand_tiles

    assert _expand_tiles(7, 12) == (1, 4, 7)
    # 14 in 4s: 0-3, 4-7, 8-11 and 10-13 (2 pixels again); in 6s 4 again: too many.
    assert _expand_tiles(14, 12) == (1, 2, 4, 5, 7, 8)
    assert _expand_tiles(56, 12) == (1, 2, 4, 5, 6, 7, 8, 9, 10, 12)


def test_every_expand_tile_of_rows_of_seven_measures_correct():
    """Each expand tile (the overlapping one among them) with each number of blocks that
    fits, checked by the measurer against the reference answer."""
    graph, _ = chained_groups(CASES["rows_of_seven"]())
    (task,) = extract_tasks(graph)
    tunable = task.tunable
    knobs = {knob.name: knob.choices for knob in tunable.knobs}
    assert 4 in knobs["expand_tile"], knobs
    default = tunable.default_config()
    configs = [
        {**default, "expand_tile": tile, "blocks": blocks}
        for tile in knobs["expand_tile"]
        for blocks in knobs["blocks"]
        if tunable.fits({**default, "expand_tile": tile, "blocks": blocks})
    ]
    assert any(c["expand_tile"] == 4 for c in configs), configs
    errors = measurement_errors(task, configs)
    assert not errors, errors[:3]


@pytest.mark.parametrize("target_text", [AVX2, AVX512])
def test_overlapping_expand_tiles_compute_what_the_unscheduled_chain_does(target_text):
    """The loop-IR interpreter runs each overlapping expand tile of a row of 7 (with every
    number of blocks that fits) against the chain's unscheduled loops, for AVX-512's blocks
    too, which a host without AVX-512 cannot run natively."""
    from compiler_core.loop import interpreter
    from compiler_core.schedule.primitives import apply

    task = chain_task(CASES["rows_of_seven"](), target_text)
    tunable, lowered = task.tunable, task.lowered_for(None)
    choices = {knob.name: knob.choices for knob in tunable.knobs}
    overlapping = [t for t in choices["expand_tile"] if 7 % t]
    configs = [
        {**tunable.default_config(), "expand_tile": tile, "blocks": blocks}
        for tile in overlapping
        for blocks in choices["blocks"]
        if tunable.fits({**tunable.default_config(), "expand_tile": tile, "blocks": blocks})
    ]
    assert configs, choices
    args = {b.name: rand(*b.shape) for b in lowered.func.params}
    expected = {k: v.copy() for k, v in args.items()}
    interpreter.run(lowered.func, expected)
    output = lowered.func.params[-1].name
    for config in configs:
        got = {k: v.copy() for k, v in args.items()}
        interpreter.run(apply(lowered.func, task.records(config)), got)
        np.testing.assert_allclose(got[output], expected[output], rtol=1e-4, atol=1e-5)


def avx512(cpu: str) -> str:
    return f"llvm -mcpu={cpu} -mattr=+avx2,+fma,+avx512f"


def test_on_zen4_a_chain_tile_keeps_one_channel_block_within_the_smaller_budget():
    """Zen 4 runs a zmm FMA in two halves and broadcasts from memory: one block per tile (its
    measured best), rows within CHAIN_TILE_BYTES."""
    from compiler_core.kernels.schedules import CHAIN_TILE_BYTES, chain_tile_bytes

    task = chain_task(expand_depthwise(c=24, m=144, size=(56, 56)), avx512("znver4"))
    default = task.default_config()
    assert default["blocks"] == 1, default
    assert chain_tile_bytes(task.tunable.anchor, default["rows"]) <= CHAIN_TILE_BYTES


@pytest.mark.parametrize("cpu", ["znver5", "cascadelake"])
def test_with_full_width_avx512_a_chain_tile_spans_three_blocks_of_taller_rows(cpu):
    """Full-width zmm FMAs (Zen 5, the Xeons): three blocks a tile (every such machine's
    tuning log picked two or three for MobileNetV2's chains), rows up to CHAIN_MAX_TILE_BYTES: at
    CHAIN_TILE_BYTES three blocks of this 56x56 chain (MobileNetV2's features.3) would get 8
    rows, and 14 ran 10% faster on Zen 5."""
    from compiler_core.kernels.schedules import (
        CHAIN_MAX_TILE_BYTES,
        CHAIN_TILE_BYTES,
        chain_tile_bytes,
    )

    task = chain_task(expand_depthwise(c=24, m=144, size=(56, 56)), avx512(cpu))
    default = task.default_config()
    assert (default["blocks"], default["rows"]) == (3, 14), default
    tile_bytes = 3 * chain_tile_bytes(task.tunable.anchor, default["rows"])
    assert CHAIN_TILE_BYTES < tile_bytes <= CHAIN_MAX_TILE_BYTES
    assert default["expand_tile"] * 3 <= 28  # the accumulators AVX-512 leaves


def test_a_tile_of_several_blocks_must_fit_the_stack_and_the_accumulators():
    task = chain_task(CASES["wide_rows"](), AVX2)  # 56-pixel rows, 18 blocks
    tunable = task.tunable
    default = tunable.default_config()
    assert not tunable.fits({**default, "blocks": 3, "expand_tile": 8})  # 24 accumulators
    assert tunable.fits({**default, "blocks": 3, "expand_tile": 4})
    assert tunable.fits({**default, "blocks": 1, "expand_tile": 8})
    with pytest.raises(ValueError, match="does not fit"):
        tunable.check({"blocks": 3, "expand_tile": 8})


# --- which the threads split first: rows or channel groups ------------------------------------


@pytest.mark.parametrize(
    "name, model, rows_first",
    [
        # 16 channels of 20x20 in (25.6 KB), 9.6 KB of weights: each thread its rows.
        ("input outweighs weights", lambda: expand_depthwise(size=(20, 20)), True),
        # 64 channels of 7x7 in (12.5 KB), 112 KB of weights: each thread its channel groups.
        ("weights outweigh input", lambda: expand_depthwise(c=64, m=384, size=(7, 7)), False),
    ],
)
def test_a_chain_splits_rows_first_when_its_input_outweighs_its_weights(name, model, rows_first):
    """Split by rows, a thread reads half the input (rows it wrote itself in the kernel
    before) and all the weights; split by channel groups, all the input and half the
    weights. Either way the values match ONNX Runtime's."""
    from compiler_core.kernels.schedules import chain_producer, rows_before_channels

    model = model()
    graph, _ = chained_groups(model)
    (task,) = extract_tasks(graph)
    anchor = task.tunable.anchor
    assert rows_before_channels(chain_producer(anchor), anchor) is rows_first, name
    fused = parallel_loop(task)
    row_tiles, groups = f"{anchor.loop(2)}_o", anchor.loop(1)
    assert (
        fused.index(row_tiles) < fused.index(groups)
        if rows_first
        else (fused.index(groups) < fused.index(row_tiles))
    ), fused
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    feeds = {"x": rand(*shape)}
    module = load(compiler_core.compile(model))
    assert_close_to_scale(module.run(feeds)["y"], ort_output(model, feeds), label=name)
