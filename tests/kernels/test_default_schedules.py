"""Every op family's kernel with its default schedule: the loop-IR interpreter gives the same
result before and after scheduling, and the native code agrees with the interpreter."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

import compiler_core
from compiler_core.build import build_group
from compiler_core.codegen.llvm import build_module
from compiler_core.codegen.native import emit_object, link_shared
from compiler_core.frontend.onnx import import_model
from compiler_core.loop import interpreter
from compiler_core.loop.printer import format_func
from compiler_core.passes.pipeline import optimize
from compiler_core.runtime import load
from compiler_core.runtime.library import KernelLibrary
from compiler_core.target import host_target
from tests.conftest import FLOAT, make_model, parallel_loop

RNG = np.random.default_rng(5)


def w(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def conv_model(c_in, c_out, group, kernel, stride, pads, epilogue=True, pooled=False):
    """Conv (+ bias) -> Relu (with `epilogue`), then a 1x1 MaxPool (with `pooled`: a reader
    that takes the conv's output blocked)."""
    nodes = [
        helper.make_node(
            "Conv",
            ["x", "w", "b"],
            ["c"],
            name="conv",
            group=group,
            strides=[stride, stride],
            pads=pads,
        )
    ]
    out = "c"
    if epilogue:
        nodes += [helper.make_node("Relu", ["c"], ["y"], name="relu")]
        out = "y"
    if pooled:
        nodes += [helper.make_node("MaxPool", [out], ["p"], name="pool", kernel_shape=[1, 1])]
        out = "p"
    size = (8 + pads[0] + pads[2] - kernel) // stride + 1
    return make_model(
        nodes,
        [("x", FLOAT, [1, c_in, 8, 8])],
        [(out, FLOAT, [1, c_out, size, size])],
        {"w": w(c_out, c_in // group, kernel, kernel), "b": w(c_out)},
    )


def residual_model():
    return make_model(
        [
            helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
            helper.make_node("Add", ["c", "x"], ["s"], name="add"),
            helper.make_node("Relu", ["s"], ["y"], name="relu"),
        ],
        [("x", FLOAT, [1, 16, 6, 6])],
        [("y", FLOAT, [1, 16, 6, 6])],
        {"w": w(16, 16, 3, 3)},
    )


def blocked_chain_model():
    """conv (plain data, NCHW16c out) -> relu -> depthwise stride 2 (16c) -> 1x1 conv reading
    16c and writing 8c (24 channels): every blocked conv variant and a block change."""
    return make_model(
        [
            helper.make_node("Conv", ["x", "wa"], ["a"], name="a", pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["a"], ["r"], name="relu"),
            helper.make_node(
                "Conv",
                ["r", "wb", "bb"],
                ["b"],
                name="dw",
                group=16,
                strides=[2, 2],
                pads=[1, 1, 1, 1],
            ),
            helper.make_node("Conv", ["b", "wc"], ["y"], name="project"),
        ],
        [("x", FLOAT, [1, 8, 8, 8])],
        [("y", FLOAT, [1, 24, 4, 4])],
        {"wa": w(16, 8, 3, 3), "wb": w(16, 1, 3, 3), "bb": w(16), "wc": w(24, 16, 1, 1)},
    )


def blocked_pools_model(channels: int = 16):
    """conv (NCHW16c out, or NCHW8c for 24 channels) -> MaxPool 3x3/2 -> AveragePool 2x2 with
    pads, both in the conv's block."""
    return make_model(
        [
            helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
            helper.make_node(
                "MaxPool",
                ["c"],
                ["m"],
                name="max",
                kernel_shape=[3, 3],
                strides=[2, 2],
                pads=[1, 1, 1, 1],
            ),
            helper.make_node(
                "AveragePool",
                ["m"],
                ["y"],
                name="avg",
                kernel_shape=[2, 2],
                pads=[0, 0, 1, 1],
            ),
        ],
        [("x", FLOAT, [1, 4, 8, 8])],
        [("y", FLOAT, [1, channels, 4, 4])],
        {"w": w(channels, 4, 3, 3)},
    )


def blocked_1d_chain_model():
    """Conv1d (1 input channel, stride 2, 19 outputs: a prime row, padded to whole register
    tiles) -> Relu -> grouped Conv1d reading NCW8c."""
    return make_model(
        [
            helper.make_node("Conv", ["x", "wa", "ba"], ["a"], name="stem", strides=[2]),
            helper.make_node("Relu", ["a"], ["r"], name="relu"),
            helper.make_node("Conv", ["r", "wb"], ["y"], name="grouped", group=2, pads=[1, 1]),
        ],
        [("x", FLOAT, [1, 1, 41])],
        [("y", FLOAT, [1, 16, 19])],
        {"wa": w(16, 1, 5), "ba": w(16), "wb": w(16, 8, 3)},
    )


def blocked_3d_model():
    return make_model(
        [helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv3d", pads=[1] * 6)],
        [("x", FLOAT, [1, 8, 3, 4, 5])],
        [("y", FLOAT, [1, 16, 3, 4, 5])],
        {"w": w(16, 8, 3, 3, 3), "b": w(16)},
    )


def gemm_model(m, k, n):
    return make_model(
        [
            helper.make_node("Gemm", ["a", "b", "c"], ["g"], name="fc", transB=1),
            helper.make_node("Relu", ["g"], ["y"], name="relu"),
        ],
        [("a", FLOAT, [m, k])],
        [("y", FLOAT, [m, n])],
        {"b": w(n, k), "c": w(n)},
    )


def batched_matmul_model():
    return make_model(
        [helper.make_node("MatMul", ["a", "b"], ["y"], name="mm")],
        [("a", FLOAT, [2, 4, 8]), ("b", FLOAT, [2, 8, 16])],
        [("y", FLOAT, [2, 4, 16])],
    )


def single(op, shape, out_shape=None, **attrs):
    return make_model(
        [helper.make_node(op, ["x"], ["y"], name=op.lower(), **attrs)],
        [("x", FLOAT, shape)],
        [("y", FLOAT, out_shape or shape)],
    )


def layer_norm_model():
    return make_model(
        [helper.make_node("LayerNormalization", ["x", "s", "b"], ["y"], name="ln", axis=-1)],
        [("x", FLOAT, [2, 3, 16])],
        [("y", FLOAT, [2, 3, 16])],
        {"s": w(16), "b": w(16)},
    )


def transposed_scaled_model(tokens=64):
    return make_model(
        [
            helper.make_node("Transpose", ["x"], ["t"], name="t", perm=[1, 2, 0]),
            helper.make_node("Mul", ["t", "scale"], ["y"], name="scale"),
        ],
        [("x", FLOAT, [tokens, 2, 48])],
        [("y", FLOAT, [2, 48, tokens])],
        {"scale": np.array([0.125], np.float32)},
    )


def injective_model():
    return make_model(
        [
            helper.make_node("Transpose", ["x"], ["t"], name="t", perm=[0, 2, 1]),
            helper.make_node("Reshape", ["t", "shape"], ["r"], name="r"),
            helper.make_node("Concat", ["r", "r"], ["c"], name="cat", axis=1),
            helper.make_node("Slice", ["c", "st", "en"], ["s"], name="slice"),
            helper.make_node("Pad", ["s", "pads"], ["y"], name="pad"),
        ],
        [("x", FLOAT, [2, 3, 4])],
        [("y", FLOAT, [4, 14])],
        {
            "shape": np.array([2, 12], np.int64),
            "st": np.array([1], np.int64),
            "en": np.array([11], np.int64),
            "pads": np.array([1, 2, 1, 2], np.int64),
        },
    )


MODELS = {
    "conv_packed16": lambda: conv_model(8, 16, 1, 3, 1, [1, 1, 1, 1]),
    "conv_packed8_stride2": lambda: conv_model(4, 24, 1, 3, 2, [1, 1, 1, 1]),
    "conv_1x1": lambda: conv_model(16, 32, 1, 1, 1, [0, 0, 0, 0]),
    # Split among the threads by rows first (16 KB in, 4 KB of weights), by channels first.
    "conv_1x1_rows_first": lambda: conv_model(64, 16, 1, 1, 1, [0, 0, 0, 0]),
    "conv_1x1_channels_first": lambda: conv_model(48, 256, 1, 1, 1, [0, 0, 0, 0]),
    # Read blocked: NCHW16c; read plain (a graph output): a window along each output row.
    "conv_depthwise": lambda: conv_model(16, 16, 16, 3, 1, [1, 1, 1, 1], pooled=True),
    "conv_depthwise_plain": lambda: conv_model(16, 16, 16, 3, 1, [1, 1, 1, 1]),
    "conv_packed4_nchw": lambda: conv_model(8, 4, 1, 3, 1, [1, 1, 1, 1]),
    "conv_depthwise_nchw": lambda: conv_model(12, 12, 12, 3, 2, [1, 1, 1, 1]),
    "conv_blocked_chain": blocked_chain_model,
    "pools_blocked": blocked_pools_model,
    "pools_blocked_8_lanes": lambda: blocked_pools_model(24),
    "conv1d_blocked_chain": blocked_1d_chain_model,
    "conv3d_blocked": blocked_3d_model,
    "conv_grouped": lambda: conv_model(6, 6, 2, 3, 1, [1, 1, 1, 1], epilogue=False),
    "conv_residual": residual_model,
    "gemm_bias_relu": lambda: gemm_model(12, 20, 64),
    "gemm_batch1_odd": lambda: gemm_model(1, 30, 10),
    "gemm_padded_panels": lambda: gemm_model(2, 70, 100),
    "matmul_batched": batched_matmul_model,
    "maxpool": lambda: single(
        "MaxPool",
        [1, 4, 8, 8],
        [1, 4, 4, 4],
        kernel_shape=[3, 3],
        strides=[2, 2],
        pads=[1, 1, 1, 1],
    ),
    # Separable: the maxima along the rows, then down the columns; a row wider than one
    # register tile (115 outputs), ceil mode, dilation, stride 1.
    "maxpool_wide_ceil": lambda: single(
        "MaxPool",
        [1, 3, 9, 230],
        [1, 3, 5, 115],
        kernel_shape=[3, 3],
        strides=[2, 2],
        pads=[1, 1, 0, 0],
        ceil_mode=1,
    ),
    "maxpool_dilated": lambda: single(
        "MaxPool",
        [1, 2, 11, 12],
        [1, 2, 3, 6],
        kernel_shape=[3, 2],
        strides=[3, 2],
        dilations=[2, 1],
    ),
    "maxpool_stride1": lambda: single(
        "MaxPool", [1, 2, 7, 9], [1, 2, 7, 9], kernel_shape=[3, 3], pads=[1, 1, 1, 1]
    ),
    "avgpool": lambda: single(
        "AveragePool", [1, 4, 8, 8], [1, 4, 4, 4], kernel_shape=[2, 2], strides=[2, 2]
    ),
    "global_avgpool": lambda: single("GlobalAveragePool", [1, 16, 5, 5], [1, 16, 1, 1]),
    "softmax": lambda: single("Softmax", [3, 16], axis=-1),
    "layer_norm": layer_norm_model,
    "elementwise": lambda: single("Sigmoid", [4, 32]),
    "injective": injective_model,
    # Keys laid out for Q K^T: a column of the input per vector, tiled by transposed_read_tiles.
    "transposed": lambda: single("Transpose", [64, 2, 48], [2, 48, 64], perm=[1, 2, 0]),
    "transposed_ragged": lambda: single("Transpose", [40, 2, 24], [2, 24, 40], perm=[1, 2, 0]),
    # ... scaled as it is transposed (a head's keys times 1/sqrt(d)): square tiles copied across.
    "transposed_scaled": transposed_scaled_model,
    "transposed_scaled_ragged": lambda: transposed_scaled_model(tokens=197),
}


def test_a_transposed_copy_takes_square_tiles_the_codegen_copies_across():
    """Keys transposed and scaled: the tile of 16 rows x one vector is unrolled, the codegen
    copies it across in registers (no gathers), and it matches numpy."""
    from compiler_core.codegen.llvm import _transposed_copy
    from compiler_core.loop.ir import For, ForKind
    from compiler_core.loop.transform import walk_stmts

    target = host_target()
    graph = optimize(import_model(transposed_scaled_model()))
    (group,) = graph.groups
    func = build_group(graph, group, 0, target).func
    loops = [s for s in walk_stmts(func.body) if isinstance(s, For) and s.kind == ForKind.UNROLLED]
    assert any(_transposed_copy(loop) for loop in loops)
    assert "gather" not in str(build_module([func], target))
    x = RNG.standard_normal((64, 2, 48)).astype(np.float32)
    y = load(compiler_core.compile(transposed_scaled_model())).run({"x": x})["y"]
    np.testing.assert_array_equal(y, x.transpose(1, 2, 0) * np.float32(0.125))


def random_args(func):
    args = {}
    for buf in func.params:
        if np.dtype(buf.dtype).kind in "iu":
            args[buf.name] = RNG.integers(0, 3, buf.shape).astype(buf.dtype)
        else:
            args[buf.name] = RNG.standard_normal(buf.shape).astype(buf.dtype)
    return args


def run_native(func, args, target, library_path):
    """A copy of `args` after the function compiled for `target` ran on it."""
    native = {k: v.copy() for k, v in args.items()}
    obj = emit_object(build_module([func], target), target)
    library = KernelLibrary(link_shared([obj], library_path))
    library.call(func.name, [native[b.name] for b in func.params])
    return native


@pytest.mark.parametrize("name", list(MODELS))
def test_default_schedule_keeps_meaning_and_compiles(name, tmp_path):
    graph = optimize(import_model(MODELS[name]()))
    target = host_target()
    for index, group in enumerate(graph.groups):
        naive = build_group(graph, group, index, target, schedule=[])
        scheduled = build_group(graph, group, index, target)
        args = random_args(naive.func)
        expected = {k: v.copy() for k, v in args.items()}
        interpreter.run(naive.func, expected)
        interpreted = {k: v.copy() for k, v in args.items()}
        interpreter.run(scheduled.func, interpreted)
        native = run_native(scheduled.func, args, target, tmp_path / f"{name}_{index}.so")
        for buf in scheduled.func.params:
            np.testing.assert_allclose(
                interpreted[buf.name],
                expected[buf.name],
                rtol=1e-4,
                atol=1e-5,
                err_msg=f"{name}: schedule changed {buf.name}",
            )
            np.testing.assert_allclose(
                native[buf.name],
                interpreted[buf.name],
                rtol=1e-4,
                atol=1e-5,
                err_msg=f"{name}: native {buf.name}",
            )


def test_anchor_groups_get_their_tiled_schedules():
    graph = optimize(import_model(residual_model()))
    index, group = next((k, g) for k, g in enumerate(graph.groups) if g.anchor)
    kernel = build_group(graph, group, index, host_target())
    kinds = [type(r).__name__ for r in kernel.schedule]
    assert {"CacheWrite", "Vectorize", "ReverseComputeInline", "Parallel"} <= set(kinds)


@pytest.mark.parametrize(
    ("width", "tile"),
    [(56, (4, 2)), (28, (4, 2)), (14, (2, 4)), (7, (4, 2)), (1599, (4, 2)), (3, (3, 2))],
)
def test_the_default_conv_tile_has_the_most_accumulators(width, tile):
    """AVX2, 8-channel blocks, 32 output blocks: two blocks per tile when that holds as many
    accumulators as one; rows whose divisors give fewer than FMA_CHAINS accumulators (7 x 1
    on 14 and 7 pixels) take 2 pixels x 4 blocks, or 4 x 2 with a partial last tile."""
    import dataclasses

    from compiler_core.kernels.schedules import nchwc_default_tile

    target = dataclasses.replace(host_target(), features="+avx2,+fma")
    assert (target.vector_lanes, target.vector_registers) == (8, 16)
    assert nchwc_default_tile(width, 8, False, 32, target) == tile


def test_a_latency_tile_keeps_its_blocks_in_one_group():
    """Two output blocks per group (ResNeXt's grouped 3x3): a 4-block tile would span two
    groups and share no input broadcast, so a 14-pixel row takes 4 pixels x 2 blocks."""
    import dataclasses

    from compiler_core.kernels.schedules import nchwc_default_tile

    target = dataclasses.replace(host_target(), features="+avx2,+fma")
    assert nchwc_default_tile(14, 8, False, 64, target, group_blocks=2) == (4, 2)
    assert nchwc_default_tile(14, 8, False, 64, target, group_blocks=64) == (2, 4)


def test_a_tile_pairs_channel_blocks_only_within_a_group():
    """One output block per group (ResNeXt's 8 channels a group in 8-channel blocks): two
    blocks of a tile would read two groups' inputs and share no broadcast, so the tile is one
    block with twice the pixels (a 28-pixel row: 7 x 2 -> 14 x 1 on AVX-512; alone, 78 ->
    149 GFLOP/s on Zen 4, the best the tuner found in 40 trials)."""
    import dataclasses

    from compiler_core.kernels.schedules import nchwc_default_tile

    avx512 = dataclasses.replace(host_target(), features="+avx2,+fma,+avx512f")
    assert avx512.vector_lanes == 16
    assert nchwc_default_tile(28, 8, False, 32, avx512, group_blocks=1) == (14, 1)
    assert nchwc_default_tile(28, 8, False, 32, avx512, group_blocks=2) == (7, 2)
    assert nchwc_default_tile(28, 8, False, 32, avx512) == (7, 2)  # ungrouped


def test_pools_of_either_block_get_the_blocked_pool_tile():
    """A pool over 8-lane blocks (ShuffleNet's 24-channel stem) runs the same register tile as
    one over 16-lane blocks (left to the generic schedule, it ran 5x slower)."""
    for channels in (16, 24):
        graph = optimize(import_model(blocked_pools_model(channels)))
        pools = [
            (k, g)
            for k, g in enumerate(graph.groups)
            if graph.node_by_name[g.nodes[0]].op == "MaxPool"
        ]
        (index, group), *_ = pools
        kernel = build_group(graph, group, index, host_target())
        assert any(type(r).__name__ == "CacheWrite" for r in kernel.schedule), channels


def test_a_plain_max_pool_takes_the_maxima_along_rows_a_plane_at_a_time_then_down_columns():
    """ResNet's stem pool over plain NCHW (3x3, stride 2): the row maxima of a channel plane
    in a local buffer (computed in the plane's loop, vectorized along the row), then the
    pool down their columns; 3 + 3 loads a window where the 2-d pool took 9 strided ones."""
    model = single(
        "MaxPool",
        [1, 4, 112, 112],
        [1, 4, 56, 56],
        kernel_shape=[3, 3],
        strides=[2, 2],
        pads=[1, 1, 1, 1],
    )
    graph = optimize(import_model(model))
    ((index, group),) = list(enumerate(graph.groups))
    func = build_group(graph, group, index, host_target()).func
    text = format_func(func)
    assert "alloc local float32 maxpool" in text and "_rows[1, 1, 113, 56]" in text, text
    vectorized = [line for line in text.splitlines() if "_rows_i3_at in 0..56 vectorized" in line]
    assert vectorized, text


def test_a_conv_without_taps_shares_each_broadcast_among_three_blocks_where_fmas_load_it():
    """Three 8-channel output blocks (24 channels) do not pair up: on AVX2, whose FMAs take no
    broadcast operand, a 1x1 conv's tile spans all three (4 pixels, 12 accumulators); a conv
    with taps keeps one block (its three weight vectors a tap would not fit beside 12
    accumulators). On AVX-512 the 8-channel blocks are half a register (ymm FMAs, each with a
    broadcast load of its own in a one-block tile): three blocks there too, as many pixels as
    the accumulators allow; 16-channel blocks, whose FMAs broadcast from memory at their own
    rate, keep one."""
    import dataclasses

    from compiler_core.kernels.schedules import nchwc_default_tile

    avx2 = dataclasses.replace(host_target(), features="+avx2,+fma")
    avx512 = dataclasses.replace(host_target(), features="+avx2,+fma,+avx512f")
    assert not avx2.fma_broadcasts and avx512.fma_broadcasts
    assert nchwc_default_tile(56, 8, False, 3, avx2, taps=False) == (4, 3)
    assert nchwc_default_tile(14, 8, False, 9, avx2, taps=False) == (2, 3)
    assert nchwc_default_tile(56, 8, False, 3, avx2, taps=True) == (8, 1)
    assert nchwc_default_tile(56, 8, False, 6, avx2, taps=False) == (4, 2)  # they pair up
    assert nchwc_default_tile(56, 8, False, 3, avx512, taps=False) == (8, 3)
    assert nchwc_default_tile(56, 16, False, 3, avx512, taps=False)[1] == 1


def test_a_blocked_conv_prefetches_its_next_weights_and_old_records_keep_their_meaning():
    """The default schedule of a conv over channel blocks prefetches the next chunk's weights;
    a config logged before the `prefetch` knob existed (it lacks it) means no prefetch, as
    when it was measured. A depthwise conv, whose weights are a few lines, has no such knob."""
    from compiler_core.autotune.tasks import extract_tasks

    target = host_target()
    graph = optimize(import_model(conv_model(32, 64, 1, 3, 1, [1, 1, 1, 1])), target=target)
    (task,) = [t for t in extract_tasks(graph, target) if "prefetch" in t.default_config()]
    default = task.default_config()
    assert default["prefetch"] == 1

    def prefetches(config):
        return [r for r in task.records(config) if type(r).__name__ == "PrefetchNext"]

    assert prefetches(None) and prefetches(default)
    logged_before = {k: v for k, v in default.items() if k != "prefetch"}
    assert not prefetches(logged_before)
    depthwise = optimize(import_model(conv_model(16, 16, 16, 3, 1, [1, 1, 1, 1])), target=target)
    assert all("prefetch" not in t.default_config() for t in extract_tasks(depthwise, target))


@pytest.mark.parametrize(
    "name, rows_first",
    [("conv_1x1_rows_first", True), ("conv_1x1_channels_first", False), ("conv_depthwise", True)],
)
def test_a_conv_hands_its_threads_rows_first_when_its_input_outweighs_its_weights(name, rows_first):
    """Split by rows, each thread reads half the input and all the weights; by output
    channels, all the input and half the weights: the parallel loop puts first the split
    that reads less (the values either way: test_default_schedule_keeps_meaning_...)."""
    from compiler_core.autotune.tasks import extract_tasks
    from compiler_core.kernels.schedules import rows_before_channels

    target = host_target()
    graph = optimize(import_model(MODELS[name]()), target=target)
    (task,) = extract_tasks(graph, target)
    conv = task.tunable.anchor
    assert rows_before_channels(conv) is rows_first
    fused = parallel_loop(task)
    rows, channels = fused.index(conv.loop(2)), fused.index(conv.loop(1))
    assert (rows < channels) is rows_first, fused


def conv1d_pair():
    """Conv1d of plain data (32 channels x 301: more input than weights) -> Relu -> Conv1d
    of the first conv's blocked output."""
    return make_model(
        [
            helper.make_node("Conv", ["x", "w1"], ["a"], name="c1", strides=[2]),
            helper.make_node("Relu", ["a"], ["r"], name="relu"),
            helper.make_node("Conv", ["r", "w2"], ["y"], name="c2", strides=[2]),
        ],
        [("x", FLOAT, [1, 32, 301])],
        [("y", FLOAT, [1, 32, 74])],
        {"w1": w(32, 32, 3) * 0.2, "w2": w(32, 32, 3) * 0.2},
    )


def test_a_1d_conv_of_plain_data_hands_its_threads_row_tiles_first(tmp_path):
    """Split by channel chunks, every chunk of a 1-D conv of plain data reads each input
    channel's row in pieces; its default puts the row tiles first (`x_mo`); the conv of
    blocked data keeps channels first. Each parallel value computes the same result."""
    from compiler_core.autotune.tasks import extract_tasks
    from compiler_core.kernels.schedules import TILES_FIRST

    target = host_target()
    graph = optimize(import_model(conv1d_pair()), target=target)
    plain, blocked = extract_tasks(graph, target)
    assert plain.tunable.anchor.note("plain_data") and not blocked.tunable.anchor.note("plain_data")
    assert plain.default_config()["parallel"] == TILES_FIRST
    assert blocked.default_config()["parallel"] == "mo_y"
    conv = plain.tunable.anchor
    fused = parallel_loop(plain)
    assert fused.index(conv.loop(2)) < fused.index(conv.loop(1)), fused
    index = [g.name for g in graph.groups].index(plain.groups[0])
    group = graph.groups[index]
    naive = build_group(graph, group, index, target, schedule=[])
    args = random_args(naive.func)
    expected = {k: v.copy() for k, v in args.items()}
    interpreter.run(naive.func, expected)
    for parallel in ("mo_y", "mo_y_x", TILES_FIRST):
        records = plain.records({**plain.default_config(), "parallel": parallel})
        scheduled = build_group(graph, group, index, target, schedule=records)
        native = run_native(scheduled.func, args, target, tmp_path / f"{parallel}.so")
        for buf in scheduled.func.params:
            np.testing.assert_allclose(
                native[buf.name], expected[buf.name], rtol=1e-4, atol=1e-5, err_msg=parallel
            )


@pytest.mark.parametrize(
    ("shape", "tiled"),
    [
        ([64, 2, 48], True),
        ([host_target().vector_lanes, 2, 48], False),  # one vector of s
        ([64, 2, 8], False),
        ([40, 2, 48], True),
    ],
)
def test_a_transposing_copy_reads_its_columns_a_tile_of_rows_at_a_time(shape, tiled):
    """y[h, d, s] = x[s, h, d] (keys laid out for Q K^T): each vector along s gathers a
    column of x. With 64 values of s and 48 of d, the loop over d (x's rows, contiguous) is
    split by the vector width and its inner part put just outside the vector loop; with a
    ragged s (40: two vectors and one ending at 40), d is split before s's overlapping split
    and its inner part put outside both of s's vector loops; with one vector of s, or rows of
    x too short to gather across lines, nothing is added."""
    model = single("Transpose", shape, [shape[1], shape[2], shape[0]], perm=[1, 2, 0])
    graph = optimize(import_model(model))
    kernel = build_group(graph, graph.groups[0], 0, host_target())
    added = [r for r in kernel.schedule if type(r).__name__ == "Reorder"]
    assert bool(added) == tiled, kernel.schedule
    if not tiled:
        return
    split = [r for r in kernel.schedule if type(r).__name__ == "Split"][-1]
    assert split.loop.endswith("_i1")  # d, the loop along x's rows, not s
    overlaps = [r for r in kernel.schedule if type(r).__name__ == "SplitOverlap"]
    if not overlaps:
        assert added[-1].loops[-2] == split.inner  # just outside the vector loop
        return
    (overlap,) = overlaps
    tail_inner = overlap.in_tail(split.inner)
    assert (split.inner, overlap.inner) in [r.loops for r in added]
    assert (tail_inner, overlap.tail_loop) in [r.loops for r in added]


def test_a_ragged_copy_is_not_tiled_under_a_record_that_names_its_rows_loop():
    """The tiles split the rows loop before the overlapping split: a later record that
    addresses that loop by name (here a Reorder that keeps the order) would no longer find
    it, so the records are left as they are and still apply."""
    from compiler_core.build import lower_group
    from compiler_core.kernels.schedules import default_schedule, transposed_read_tiles
    from compiler_core.schedule.primitives import Reorder, SplitOverlap, apply

    target = host_target()
    graph = optimize(import_model(transposed_scaled_model(tokens=197)))
    lowered = lower_group(graph, graph.groups[0], 0, target)
    records = list(default_schedule(lowered.stages, target))
    (overlap,) = [r for r in records if isinstance(r, SplitOverlap)]
    stage = overlap.loop[: -len("_i2")]
    rows = stage + "_i1"  # d, the loop along x's rows
    func = apply(lowered.func, records)
    assert transposed_read_tiles(func, target, records) != records  # tiled without it
    named = [*records, Reorder((stage + "_i0", rows))]
    func = apply(lowered.func, named)
    assert transposed_read_tiles(func, target, named) == named
    apply(lowered.func, named)


def test_a_ragged_transposed_copy_takes_square_tiles_in_its_last_vector_too():
    """Keys of 197 tokens transposed and scaled (ViT-B/16): 12 whole vectors and one ending
    at 197, each inside an unrolled loop of 16 rows; the codegen copies every tile across in
    registers (no gathers), and the result matches numpy."""
    from compiler_core.codegen.llvm import _transposed_copy
    from compiler_core.loop.ir import For, ForKind
    from compiler_core.loop.transform import walk_stmts

    target = host_target()
    model = transposed_scaled_model(tokens=197)
    graph = optimize(import_model(model))
    (group,) = graph.groups
    func = build_group(graph, group, 0, target).func
    loops = [s for s in walk_stmts(func.body) if isinstance(s, For) and s.kind == ForKind.UNROLLED]
    assert sum(bool(_transposed_copy(loop)) for loop in loops) == 2
    assert "gather" not in str(build_module([func], target))
    x = RNG.standard_normal((197, 2, 48)).astype(np.float32)
    y = load(compiler_core.compile(model)).run({"x": x})["y"]
    np.testing.assert_array_equal(y, x.transpose(1, 2, 0) * np.float32(0.125))


def channels_first_permute_model(height=3, width=20, channels=32):
    """NHWC -> NCHW, as ConvNeXt's LayerNorm2d writes at each stage's start."""
    return make_model(
        [helper.make_node("Transpose", ["x"], ["y"], name="t", perm=[0, 3, 1, 2])],
        [("x", FLOAT, [1, height, width, channels])],
        [("y", FLOAT, [1, channels, height, width])],
        {},
    )


def test_a_ragged_permute_tiles_its_parallel_channels_across_the_rows_between():
    """NHWC -> NCHW with rows of 20 pixels: the channels loop (parallel, outermost) walks the
    input's rows, with the image rows between it and the pixels; the tiles split the
    channels, move their inner part down to the pixels' vectors and hand the threads the
    outer part: no gathers, and the result is numpy's."""
    from compiler_core.loop.ir import For, ForKind
    from compiler_core.loop.transform import walk_stmts

    target = host_target()
    model = channels_first_permute_model()
    graph = optimize(import_model(model))
    (group,) = graph.groups
    kernel = build_group(graph, group, 0, target)
    parallel = [s for s in walk_stmts(kernel.func.body) if isinstance(s, For)]
    parallel = [s for s in parallel if s.kind == ForKind.PARALLEL]
    assert [loop.extent for loop in parallel] == [32 // target.vector_lanes]
    assert "gather" not in str(build_module([kernel.func], target))
    x = RNG.standard_normal((1, 3, 20, 32)).astype(np.float32)
    y = load(compiler_core.compile(model)).run({"x": x})["y"]
    np.testing.assert_array_equal(y, x.transpose(0, 3, 1, 2))
