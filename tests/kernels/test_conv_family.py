"""1-D, 2-D and 3-D convolutions on the blocked path (NC[D][H]W[b]c), compiled natively and
compared with ONNX Runtime: strides, dilation, padding, groups, one input channel, row lengths
that are prime or odd (padded register-tile rows), and a small Conv1d -> Relu -> Conv1d chain.
Every case also checks that the layout pass really blocked its convs."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import compiler_core
from compiler_core.autotune.tasks import extract_tasks
from compiler_core.build import build_kernels
from compiler_core.compiler import compile_graph
from compiler_core.frontend.onnx import import_model
from compiler_core.graph.ir import Graph, Node, TensorType
from compiler_core.graph.ops.layout import to_blocked, to_plain
from compiler_core.passes import fuse_operators
from compiler_core.passes.pipeline import optimize
from compiler_core.runtime import load
from compiler_core.target import host_target
from tests.conftest import (
    FLOAT,
    assert_close_to_scale,
    make_model,
    measurement_errors,
    one_knob_off_default,
)
from tests.passes.test_transform_layout import squeeze_excitation_model

RNG = np.random.default_rng(11)


def rand(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def out_size(size, kernel, stride=1, pad=(0, 0), dilation=1):
    return (size + pad[0] + pad[1] - dilation * (kernel - 1) - 1) // stride + 1


def conv_case(c, m, spatial, kernel, stride=1, pad=0, dilation=1, group=1, bias=True):
    """A one-Conv model over len(spatial) axes (the same kernel, stride... on every axis)."""
    nd = len(spatial)
    out = [out_size(s, kernel, stride, (pad, pad), dilation) for s in spatial]
    inputs = ["x", "w", "b"] if bias else ["x", "w"]
    node = helper.make_node(
        "Conv",
        inputs,
        ["y"],
        name="conv",
        kernel_shape=[kernel] * nd,
        strides=[stride] * nd,
        pads=[pad] * (2 * nd),
        dilations=[dilation] * nd,
        group=group,
    )
    weights = {"w": rand(m, c // group, *[kernel] * nd, scale=0.3)}
    if bias:
        weights["b"] = rand(m)
    return make_model(
        [node], [("x", FLOAT, [1, c, *spatial])], [("y", FLOAT, [1, m, *out])], weights
    )


def chain_1d():
    """Conv1d (1 input channel, stride 5) -> Relu -> Conv1d (stride 2) -> Relu -> grouped
    Conv1d: blocked from end to end."""
    return make_model(
        [
            helper.make_node("Conv", ["x", "w1", "b1"], ["a"], name="c1", strides=[5]),
            helper.make_node("Relu", ["a"], ["r"], name="relu1"),
            helper.make_node("Conv", ["r", "w2"], ["b"], name="c2", strides=[2]),
            helper.make_node("Relu", ["b"], ["s"], name="relu2"),
            helper.make_node("Conv", ["s", "w3"], ["y"], name="c3", pads=[1, 1], group=2),
        ],
        [("x", FLOAT, [1, 1, 401])],
        [("y", FLOAT, [1, 16, 39])],
        {
            "w1": rand(16, 1, 10, scale=0.3),
            "b1": rand(16),
            "w2": rand(16, 16, 3, scale=0.3),
            "w3": rand(16, 8, 3, scale=0.3),
        },
    )


def pooled_3d():
    """Conv3d -> MaxPool3d (padded) -> Conv3d -> AveragePool3d, all in NCDHW[b]c."""
    return make_model(
        [
            helper.make_node("Conv", ["x", "w1"], ["a"], name="c1", pads=[1] * 6),
            helper.make_node(
                "MaxPool", ["a"], ["p"], name="max", kernel_shape=[2, 3, 3], pads=[0, 1, 1] * 2
            ),
            helper.make_node("Conv", ["p", "w2", "b2"], ["b"], name="c2", strides=[1, 2, 2]),
            helper.make_node(
                "AveragePool", ["b"], ["y"], name="avg", kernel_shape=[1, 2, 2], strides=[1, 2, 2]
            ),
        ],
        [("x", FLOAT, [1, 4, 4, 9, 11])],
        [("y", FLOAT, [1, 16, 3, 2, 2])],
        {"w1": rand(16, 4, 3, 3, 3, scale=0.3), "w2": rand(16, 16, 1, 1, 1), "b2": rand(16)},
    )


def pooled_1d():
    """Conv1d -> MaxPool1d (stride 2) -> Conv1d (dilated) -> AveragePool1d (padded)."""
    return make_model(
        [
            helper.make_node("Conv", ["x", "w1"], ["a"], name="c1", pads=[2, 2]),
            helper.make_node("MaxPool", ["a"], ["p"], name="max", kernel_shape=[3], strides=[2]),
            helper.make_node("Conv", ["p", "w2"], ["b"], name="c2", dilations=[2], pads=[2, 2]),
            helper.make_node(
                "AveragePool", ["b"], ["y"], name="avg", kernel_shape=[3], pads=[1, 1]
            ),
        ],
        [("x", FLOAT, [1, 3, 47])],
        [("y", FLOAT, [1, 8, 23])],
        {"w1": rand(8, 3, 5, scale=0.3), "w2": rand(8, 8, 3, scale=0.3)},
    )


CASES = {
    "conv1d_strided": lambda: conv_case(16, 16, [37], 3, stride=2),
    "conv1d_dilated_padded": lambda: conv_case(8, 16, [29], 3, pad=2, dilation=2),
    "conv1d_prime_row": lambda: conv_case(16, 8, [41], 5),  # 37 outputs: a padded row
    "conv1d_long_odd_row": lambda: conv_case(8, 8, [203], 3, stride=2, bias=False),  # 101
    "conv1d_grouped": lambda: conv_case(32, 32, [23], 5, pad=2, group=2),
    "conv1d_grouped_8_per_group": lambda: conv_case(32, 32, [31], 7, pad=3, group=4),
    "conv1d_depthwise": lambda: conv_case(16, 16, [19], 3, pad=1, group=16),
    # 8 filters of 10 taps: a reduction longer than the rows, so not an im2col GEMM (below).
    "conv1d_one_input_channel": lambda: conv_case(1, 8, [203], 10, stride=5),
    "conv1d_chain": chain_1d,
    "conv1d_pooled": pooled_1d,
    "conv3d_pooled": pooled_3d,
    "conv3d_padded": lambda: conv_case(8, 16, [5, 6, 7], 3, pad=1),
    "conv3d_strided": lambda: conv_case(3, 8, [6, 7, 9], 3, stride=2, pad=1),
    "conv3d_grouped": lambda: conv_case(16, 16, [3, 4, 5], 3, pad=1, group=2),
    "conv2d_grouped": lambda: conv_case(16, 32, [9, 11], 3, pad=1, group=2),
    "conv2d_grouped_strided": lambda: conv_case(32, 32, [10, 7], 3, stride=2, pad=1, group=4),
    "conv2d_groups_of_4": lambda: conv_case(32, 32, [9, 11], 3, pad=1, group=8),
    "conv2d_groups_of_2_strided": lambda: conv_case(16, 16, [10, 7], 3, stride=2, pad=1, group=8),
    "conv1d_groups_of_4": lambda: conv_case(16, 16, [29], 5, pad=2, group=4),
    "conv2d_three_channel_stem": lambda: conv_case(3, 16, [17, 23], 3, stride=2, pad=1),
}


def ort_output(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["y"], feeds)[0]


@pytest.mark.parametrize("name", list(CASES))
def test_blocked_conv_matches_onnxruntime(name):
    model = CASES[name]()
    graph = optimize(import_model(model), target=host_target())
    convs = [n for n in graph.nodes if n.op == "Conv"]
    assert convs and all(n.attr("out_layout", "NCHW")[-1] == "c" for n in convs), name
    pools = [n for n in graph.nodes if n.op in ("MaxPool", "AveragePool")]
    assert all(n.attr("data_layout", "NCHW")[-1] == "c" for n in pools), name
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    feeds = {"x": rand(*shape)}
    module = load(compiler_core.compile(model))
    actual = module.run(feeds)["y"]
    assert_close_to_scale(actual, ort_output(model, feeds), label=name)


# --- 1-D convs with a short reduction: a GEMM over im2col columns, plain output --------------


def batched(model, batch: int):
    """`model` with its input's and output's batch set to `batch`."""
    for value in (*model.graph.input, *model.graph.output):
        value.type.tensor_type.shape.dim[0].dim_value = batch
    return model


IM2COL_CASES = {
    "raw_audio_stem": lambda: conv_case(1, 16, [203], 10, stride=5),
    "padded_dilated": lambda: conv_case(2, 24, [37], 5, pad=2, dilation=2, bias=False),
    "three_channels_batch_2": lambda: batched(conv_case(3, 32, [100], 7, stride=3), 2),
    "ragged_row_tile": lambda: conv_case(1, 13, [31], 4),  # 13 rows, 28 positions
}


@pytest.mark.parametrize("name", list(IM2COL_CASES))
def test_im2col_conv_writes_plain_output_and_matches_onnxruntime(name):
    model = IM2COL_CASES[name]()
    graph = optimize(import_model(model), target=host_target())
    (conv,) = [n for n in graph.nodes if n.op == "Conv"]
    assert conv.attr("out_layout", "NCW") == "NCW", name
    assert not [n for n in graph.nodes if n.op == "LayoutTransform"], name
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    feeds = {"x": rand(*shape)}
    module = load(compiler_core.compile(model))
    assert_close_to_scale(module.run(feeds)["y"], ort_output(model, feeds), label=name)


def test_im2col_conv_is_a_task_of_the_dense_template():
    graph = optimize(import_model(IM2COL_CASES["raw_audio_stem"]()), target=host_target())
    (task,) = extract_tasks(graph)
    assert task.tunable.template.name == "dense"
    assert task.tunable.anchor.note("layout") == "im2col"


def test_every_knob_value_of_an_im2col_conv_measures_correct():
    """Each knob of the dense template off its default, one at a time (`pack=0` reads the
    columns straight from the input, lane by lane), checked by the measurer against the
    reference answer."""
    model = IM2COL_CASES["three_channels_batch_2"]()
    (task,) = extract_tasks(optimize(import_model(model), target=host_target()))
    configs = one_knob_off_default(task.tunable)
    assert any(c["pack"] == 0 for c in configs)
    errors = measurement_errors(task, configs)
    assert not errors, errors[:3]


# --- channel counts no block divides: blocked convs with a padded last block -------------------


def plain_chain():
    """58-channel 1x1 conv (bias) -> Relu -> 3x3 conv to 29 channels without bias (a crop
    stage of its own) -> Sigmoid: channel counts no vector divides, strides and padding."""
    return make_model(
        [
            helper.make_node("Conv", ["x", "w1", "b1"], ["a"], name="c1"),
            helper.make_node("Relu", ["a"], ["r"], name="relu"),
            helper.make_node("Conv", ["r", "w2"], ["b"], name="c2", pads=[1] * 4, strides=[2] * 2),
            helper.make_node("Sigmoid", ["b"], ["y"], name="sig"),
        ],
        [("x", FLOAT, [1, 24, 13, 11])],
        [("y", FLOAT, [1, 29, 7, 6])],
        {"w1": rand(58, 24, 1, 1, scale=0.3), "b1": rand(58), "w2": rand(29, 58, 3, 3, scale=0.1)},
    )


PLAIN_CASES = {
    "conv2d_58_channels_1x1": lambda: conv_case(58, 58, [14, 14], 1),
    "conv2d_116_channels_strided": lambda: conv_case(24, 116, [9, 10], 3, stride=2, pad=1),
    "conv2d_13_channels_no_bias": lambda: conv_case(7, 13, [6, 9], 3, bias=False),
    "conv1d_58_channels": lambda: conv_case(16, 58, [33], 3, pad=1),
    "plain_chain": plain_chain,
}


def shuffle_unit():
    """A ShuffleNetV2 unit at 58 channels: Split -> (1x1, depthwise 3x3, 1x1) on one half ->
    Concat -> channel shuffle (Reshape, Transpose, Reshape)."""
    return make_model(
        [
            helper.make_node("Split", ["x", "halves"], ["x1", "x2"], name="split", axis=1),
            helper.make_node("Conv", ["x2", "w1", "b1"], ["a"], name="c1"),
            helper.make_node("Relu", ["a"], ["r"], name="relu1"),
            helper.make_node("Conv", ["r", "w2"], ["b"], name="dw", pads=[1] * 4, group=58),
            helper.make_node("Conv", ["b", "w3", "b3"], ["c"], name="c3"),
            helper.make_node("Relu", ["c"], ["s"], name="relu3"),
            helper.make_node("Concat", ["x1", "s"], ["joined"], name="concat", axis=1),
            helper.make_node("Reshape", ["joined", "grouped"], ["g"], name="group"),
            helper.make_node("Transpose", ["g"], ["t"], name="swap", perm=[0, 2, 1, 3, 4]),
            helper.make_node("Reshape", ["t", "flat"], ["y"], name="shuffle"),
        ],
        [("x", FLOAT, [1, 116, 9, 9])],
        [("y", FLOAT, [1, 116, 9, 9])],
        {
            "halves": np.array([58, 58], np.int64),
            "w1": rand(58, 58, 1, 1, scale=0.2),
            "b1": rand(58),
            "w2": rand(58, 1, 3, 3, scale=0.3),
            "w3": rand(58, 58, 1, 1, scale=0.2),
            "b3": rand(58),
            "grouped": np.array([1, 2, 58, 9, 9], np.int64),
            "flat": np.array([1, 116, 9, 9], np.int64),
        },
    )


# Grouped convs whose groups no vector block divides stay plain (the layout pass blocks a
# grouped conv only in whole blocks a group); each group's filters are padded to whole blocks.
# (A float32 1x1 conv of plain data is a MatMul instead: tests/passes/test_pointwise_matmul.py.)
PADDED_GROUP_CASES = {
    "groups_of_34_3x3": lambda: conv_case(136, 136, [7, 9], 3, pad=1, group=4),
    "groups_of_10_no_bias": lambda: conv_case(20, 20, [9, 11], 3, pad=1, group=2, bias=False),
    "groups_of_12_in_18_out_strided": lambda: conv_case(24, 36, [9, 10], 3, 2, 1, group=2),
    "groups_of_12_padded_past_a_block_of_4": lambda: conv_case(24, 24, [6, 7], 3, pad=1, group=2),
}


@pytest.mark.parametrize("name", list(PADDED_GROUP_CASES))
def test_grouped_plain_conv_pads_each_group_to_whole_blocks(name):
    model = PADDED_GROUP_CASES[name]()
    graph = optimize(import_model(model), target=host_target())
    (conv,) = [n for n in graph.nodes if n.op == "Conv"]
    assert conv.attr("out_layout", "NCHW") == "NCHW", name
    (kernel,) = build_kernels(graph, host_target())
    assert any(stage.note("layout") == "packed" for stage in kernel.stages), name
    feeds = {"x": rand(*[d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim])}
    actual = load(compiler_core.compile(model)).run(feeds)["y"]
    assert_close_to_scale(actual, ort_output(model, feeds), label=name)


def test_a_half_precision_grouped_conv_crops_its_padded_groups():
    model = conv_case(136, 136, [5, 6], 1, group=4)
    half = helper.make_model(model.graph, opset_imports=model.opset_import)
    for tensor in (*half.graph.input, *half.graph.output):
        tensor.type.tensor_type.elem_type = TensorProto.FLOAT16
    for i, init in enumerate(half.graph.initializer):
        array = numpy_helper.to_array(init).astype(np.float16)
        half.graph.initializer[i].CopyFrom(numpy_helper.from_array(array, init.name))
    feeds = {"x": rand(1, 136, 5, 6)}
    actual = load(compiler_core.compile(half)).run({"x": feeds["x"].astype(np.float16)})["y"]
    assert actual.dtype == np.float16
    assert_close_to_scale(actual, ort_output(model, feeds), rtol=3e-3)


def two_class_head():
    """3x3 conv 8->16 -> Relu -> 1x1 conv 16->2: the head reads blocked data and pads its two
    outputs to a block, cropped on the way out."""
    return make_model(
        [
            helper.make_node("Conv", ["x", "w1"], ["a"], name="c1", pads=[1] * 4),
            helper.make_node("Relu", ["a"], ["r"], name="relu"),
            helper.make_node("Conv", ["r", "w2", "b2"], ["y"], name="head"),
        ],
        [("x", FLOAT, [1, 8, 10, 13])],
        [("y", FLOAT, [1, 2, 10, 13])],
        {"w1": rand(16, 8, 3, 3, scale=0.3), "w2": rand(2, 16, 1, 1), "b2": rand(2)},
    )


PLAIN_CASES["shuffle_unit"] = shuffle_unit
PLAIN_CASES["two_class_head"] = two_class_head
PLAIN_CASES["squeeze_excitation_20"] = lambda: squeeze_excitation_model(20)


@pytest.mark.parametrize("name", list(PLAIN_CASES))
def test_odd_channel_counts_get_vector_blocks_and_match_onnxruntime(name):
    model = PLAIN_CASES[name]()
    graph = optimize(import_model(model), target=host_target())
    convs = [n for n in graph.nodes if n.op == "Conv"]
    assert all(n.attr("out_layout", "NCHW")[-1] == "c" for n in convs), name
    compiled = compiler_core.compile(model)
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    feeds = {"x": rand(*shape)}
    actual = load(compiled).run(feeds)["y"]
    assert_close_to_scale(actual, ort_output(model, feeds), label=name)


@pytest.mark.parametrize(
    ("channels", "group", "lanes", "expected"),
    [
        (64, 1, 16, (16, 64)),  # a block divides: no padding
        (58, 1, 16, (16, 64)),  # 64 either way: the larger block
        (116, 1, 16, (8, 120)),  # 8 pads least
        (58, 1, 8, (8, 64)),
        (6, 2, 16, (0, 12)),  # groups of fewer than 8: not padded
        (68, 4, 8, (8, 288)),  # groups of 68 in blocks of 8 (72 each), not 4
        (34, 4, 16, (8, 160)),  # 5 blocks of 8 a group, where a 16-lane FMA costs two 8-lane
        (3, 1, 16, (0, 3)),  # too few channels for a vector
    ],
)
def test_plain_conv_blocks(channels, group, lanes, expected):
    from compiler_core.kernels.nn import _plain_conv_block

    assert _plain_conv_block(channels, group, lanes) == expected


def test_plain_conv_blocks_where_16_lane_fmas_run_at_full_rate():
    """116 channels: 15 blocks of 8 (120) where a 16-lane FMA takes two passes, 8 blocks of
    16 (128) where it takes one."""
    from compiler_core.kernels.nn import _plain_conv_block

    assert _plain_conv_block(116, 1, 16, fma_lanes=8) == (8, 120)
    assert _plain_conv_block(116, 1, 16, fma_lanes=16) == (16, 128)
    assert _plain_conv_block(6, 2, 16, fma_lanes=16) == (0, 12)


@pytest.mark.parametrize("width", [4, 16, 20, 56])
def test_layout_transform_between_padded_blocks(width):
    """37 channels in 8-blocks (3 padding lanes) -> 16-blocks (11) -> plain, natively; rows
    shorter than a vector, whole vectors, and whole vectors with a ragged tail."""
    blocked8 = to_blocked(rand(1, 37, 3, width), 8)
    transform = {"dst_layout": "NCHW16c", "channels": 37}
    nodes = (
        Node("LayoutTransform", "t16", ("x",), ("a",), {"src_layout": "NCHW8c", **transform}),
        Node(
            "LayoutTransform",
            "tplain",
            ("a",),
            ("y",),
            {"src_layout": "NCHW16c", "dst_layout": "NCHW", "channels": 37},
        ),
    )
    types = {
        "x": TensorType(blocked8.shape, "float32"),
        "a": TensorType((1, 3, 3, width, 16), "float32"),
        "y": TensorType((1, 37, 3, width), "float32"),
    }
    graph = fuse_operators.run(Graph("padded", ("x",), ("y", "a"), nodes, types, {}))
    out = load(compile_graph(graph, host_target())).run({"x": blocked8})
    plain = to_plain(blocked8, 8, 37)
    np.testing.assert_array_equal(out["y"], plain)
    np.testing.assert_array_equal(out["a"], to_blocked(plain, 16))
    assert not out["a"][0, 2, ..., 5:].any()  # padding lanes are zero
    if host_target().vector_lanes == 16 and width >= 16:
        # 16-blocks -> plain copies tiles across, the last block's 5 channels stored alone.
        assert tiled_copies(graph)[-1], width


def tiled_copies(graph) -> list[bool]:
    """Per kernel of `graph`: whether the codegen copies tiles of it across in registers."""
    from compiler_core.build import build_kernels
    from compiler_core.codegen.llvm import _transposed_copy
    from compiler_core.loop.ir import For, ForKind
    from compiler_core.loop.transform import walk_stmts

    def unrolled(kernel):
        return [
            s
            for s in walk_stmts(kernel.func.body)
            if isinstance(s, For) and s.kind == ForKind.UNROLLED
        ]

    return [
        any(_transposed_copy(loop) for loop in unrolled(k))
        for k in build_kernels(graph, host_target())
    ]


@pytest.mark.parametrize(
    ("spatial", "dtype", "half"),
    [((3, 112), "float32", 0), ((5, 20), "float32", 0), ((2, 2, 36), "float32", 0)]
    + [((40,), "float32", 0), ((3, 8), "float32", 0), ((3, 48), "float16", 0)]
    + [((2, 64), "int64", 0), ((3, 28), "float32", 1), ((3, 4), "float32", 1)]
    + [((3, 36), "float32", 3)],
)
def test_layout_transforms_copy_whole_tiles_across(spatial, dtype, half):
    """Plain -> blocks of a vector's lanes (`half` 1: half of them; 3: full ones, the last
    three channels short, zero-padded) -> plain, for 1-3 spatial dims, rows of whole tiles, a
    ragged last tile (20, 36, 40, 28: it overlaps the one before) and shorter than a tile (8
    and 4: the generic schedule); each direction's tiles are copied across in registers (the
    codegen's transposed-tile rule matched: no gathers), bit-exact."""
    from compiler_core.build import build_kernels
    from compiler_core.codegen.llvm import build_module

    target = host_target()
    lanes = target.vector_lanes >> (half == 1)
    rank_name = "NC" + "DHW"[3 - len(spatial) :]
    channels = 2 * lanes - (3 if half == 3 else 0)
    x = (np.random.default_rng(5).standard_normal((1, channels, *spatial)) * 100).astype(dtype)
    blocked = (1, 2, *spatial, lanes)
    nodes = (
        Node(
            "LayoutTransform",
            "to_blocks",
            ("x",),
            ("a",),
            {"src_layout": rank_name, "dst_layout": f"{rank_name}{lanes}c", "channels": channels},
        ),
        Node(
            "LayoutTransform",
            "to_plain",
            ("a",),
            ("y",),
            {"src_layout": f"{rank_name}{lanes}c", "dst_layout": rank_name, "channels": channels},
        ),
    )
    types = {
        "x": TensorType(x.shape, dtype),
        "a": TensorType(blocked, dtype),
        "y": TensorType(x.shape, dtype),
    }
    graph = fuse_operators.run(Graph("tiles", ("x",), ("y", "a"), nodes, types, {}))
    out = load(compile_graph(graph, target)).run({"x": x})
    np.testing.assert_array_equal(out["a"], to_blocked(x, lanes))
    np.testing.assert_array_equal(out["y"], x)
    tiled = tiled_copies(graph)
    assert tiled == [spatial[-1] >= lanes] * 2, tiled
    if spatial[-1] >= lanes:
        text = str(build_module([k.func for k in build_kernels(graph, target)], target))
        assert "gather" not in text and "shufflevector" in text


# --- three channel blocks per register tile (AVX2, output blocks that come in threes) --------

AVX2 = "llvm -mattr=+avx2,+fma"


def pointwise_to_24_channels(out: int = 24):
    """1x1 conv 48 -> `out` channels (24: three 8-channel blocks that do not pair up) on a
    12-pixel row, over a blocked input (a 3x3 conv before it), with ReLU."""
    return make_model(
        [
            helper.make_node("Conv", ["x", "w1"], ["a"], name="c1", pads=[1] * 4),
            helper.make_node("Conv", ["a", "w2", "b2"], ["c"], name="c2"),
            helper.make_node("Relu", ["c"], ["y"], name="relu"),
        ],
        [("x", FLOAT, [1, 16, 12, 12])],
        [("y", FLOAT, [1, out, 12, 12])],
        {
            "w1": rand(48, 16, 3, 3, scale=0.2),
            "w2": rand(out, 48, 1, 1, scale=0.2),
            "b2": rand(out),
        },
    )


def pointwise_task(target, out: int = 24):
    graph = optimize(import_model(pointwise_to_24_channels(out)), target=target)
    return next(t for t in extract_tasks(graph, target) if "x1x1x" in t.workload)


def test_a_1x1_conv_to_three_blocks_takes_a_tile_of_three_blocks_on_avx2_and_matches_ort():
    from compiler_core.target import parse_target

    task = pointwise_task(parse_target(AVX2))
    assert task.default_config()["mo_tile"] == 3
    assert task.default_config()["tile"] == 4  # 12 accumulators: all AVX2's tile may hold
    model = pointwise_to_24_channels()
    feeds = {"x": rand(1, 16, 12, 12)}
    module = load(compiler_core.compile(model, target=AVX2))
    assert_close_to_scale(module.run(feeds)["y"], ort_output(model, feeds), label="24 channels")


def test_every_tile_of_three_blocks_measures_correct():
    """Three blocks per tile is a knob value on every target; each tile length with it runs
    and matches the reference in the measurer."""
    target = host_target()
    task = pointwise_task(target, out=3 * target.vector_lanes)  # three of the host's blocks
    knobs = {k.name: k for k in task.tunable.knobs}
    assert 3 in knobs["mo_tile"].choices
    default = task.default_config()
    configs = [
        {**default, "mo_tile": 3, "mo_chunk": chunk, "tile": tile}
        for tile in knobs["tile"].choices
        for chunk in (1, 3)
        if task.tunable.fits({**default, "mo_tile": 3, "mo_chunk": chunk, "tile": tile})
    ]
    assert len(configs) >= 4
    errors = measurement_errors(task, configs)
    assert not errors, errors[:3]
