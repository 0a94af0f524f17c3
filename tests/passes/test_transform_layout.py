"""The layout pass: conv chains stay in NCHW[b]c, transforms only at the chain's edges, and the
graph computes what it did before (reference executor; blocks checked against numpy)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from onnx import helper

from compiler_core.frontend.onnx import import_model
from compiler_core.graph.ops.layout import block_of, to_blocked, to_plain
from compiler_core.passes import transform_layout
from compiler_core.passes.pipeline import optimize
from compiler_core.target import host_target, parse_target
from tests.conftest import FLOAT, INT64, make_model, shared_model
from tests.passes.test_passes import assert_same_function, rand


def before_layout(model):
    return optimize(import_model(model), stop_after="eliminate_dead_code")


def conv(name, x, w, out, **attrs):
    return helper.make_node("Conv", [x, w], [out], name=name, **attrs)


def chain_model():
    """conv 8->16 (3x3) -> Clip -> depthwise 16 (stride 2) -> 1x1 16->24 -> Add(itself)."""
    return make_model(
        [
            conv("stem", "x", "wa", "a", pads=[1, 1, 1, 1]),
            helper.make_node("Clip", ["a", "lo", "hi"], ["r"], name="clip"),
            conv("dw", "r", "wb", "b", group=16, strides=[2, 2], pads=[1, 1, 1, 1]),
            conv("project", "b", "wc", "c"),
            helper.make_node("Add", ["c", "c"], ["y"], name="add"),
        ],
        [("x", FLOAT, [1, 8, 8, 8])],
        [("y", FLOAT, [1, 24, 4, 4])],
        {
            "wa": rand(16, 8, 3, 3),
            "wb": rand(16, 1, 3, 3),
            "wc": rand(24, 16, 1, 1),
            "lo": np.array(0.0, np.float32),
            "hi": np.array(6.0, np.float32),
        },
    )


def layouts(graph):
    return [
        (n.name, n.attr("data_layout", "NCHW"), n.attr("out_layout", "NCHW"))
        for n in graph.nodes
        if n.op == "Conv"
    ]


def test_chain_stays_blocked_with_one_transform_at_the_end():
    before = before_layout(chain_model())
    after = transform_layout.run(before)
    assert layouts(after) == [
        ("stem", "NCHW", "NCHW16c"),
        ("dw", "NCHW16c", "NCHW16c"),
        ("project", "NCHW16c", "NCHW8c"),
    ]
    transforms = [n for n in after.nodes if n.op == "LayoutTransform"]
    assert [(n.attr("src_layout"), n.attr("dst_layout")) for n in transforms] == [
        ("NCHW8c", "NCHW")
    ]
    assert transforms[0].outputs == ("y",)
    assert_same_function(before, after)


def test_24_channels_take_padded_16_lane_blocks_where_16_lane_fmas_run_at_full_rate():
    """Zen 5 (and Intel's server cores) run a 16-lane FMA at the rate of an 8-lane one: 24
    channels are cheaper as two blocks of 16 (8 lanes of padding) than as three of 8; on Zen
    4, which splits a 16-lane FMA in two passes, three blocks of 8 are."""
    before = before_layout(chain_model())
    assert transform_layout.block_cost(24, 16, 16) < transform_layout.block_cost(24, 8, 16)
    assert transform_layout.block_cost(24, 8, 8) < transform_layout.block_cost(24, 16, 8)
    wide = transform_layout.run(before, lanes=16, fma_lanes=16)
    assert layouts(wide)[-1] == ("project", "NCHW16c", "NCHW16c")
    assert_same_function(before, wide)
    split = transform_layout.run(before, lanes=16, fma_lanes=8)
    assert layouts(split)[-1] == ("project", "NCHW16c", "NCHW8c")
    zen5 = parse_target("llvm -mcpu=znver5 -mattr=+avx512f")
    zen4 = parse_target("llvm -mcpu=znver4 -mattr=+avx512f")
    avx2 = parse_target("llvm -mcpu=znver3 -mattr=+avx2,+fma")
    assert (zen5.fma_lanes, zen4.fma_lanes, avx2.fma_lanes) == (16, 8, 8)


def test_per_channel_constant_is_blocked_at_build_time():
    model = make_model(
        [
            conv("conv", "x", "w", "a", pads=[1, 1, 1, 1]),
            helper.make_node("Mul", ["a", "scale"], ["y"], name="scale"),
        ],
        [("x", FLOAT, [1, 4, 5, 5])],
        [("y", FLOAT, [1, 16, 5, 5])],
        {"w": rand(16, 4, 3, 3), "scale": rand(1, 16, 1, 1)},
    )
    before = before_layout(model)
    after = transform_layout.run(before)
    mul = next(n for n in after.nodes if n.op == "Mul")
    assert [after.types[v].shape for v in mul.inputs] == [(1, 1, 5, 5, 16), (1, 1, 1, 1, 16)]
    assert "scale" not in after.constants  # stored once, blocked
    assert [n.op for n in after.nodes] == ["Conv", "Mul", "LayoutTransform"]
    assert_same_function(before, after)


def dense_block_model(scale_shape):
    """DenseNet's pre-activation join as Caffe's exporters write it: a conv's output joined
    to its input, scaled and shifted per channel by constants of shape [C, 1, 1] (a batch
    norm or Scale layer), Relu, then the next conv."""
    return make_model(
        [
            conv("grow", "x", "wa", "g", pads=[1, 1, 1, 1]),
            helper.make_node("Concat", ["x", "g"], ["j"], name="join", axis=1),
            helper.make_node("Mul", ["j", "scale"], ["s"], name="scale"),
            helper.make_node("Add", ["s", "shift"], ["t"], name="shift"),
            helper.make_node("Relu", ["t"], ["r"], name="relu"),
            conv("next", "r", "wb", "y"),
        ],
        [("x", FLOAT, [1, 16, 6, 6])],
        [("y", FLOAT, [1, 16, 6, 6])],
        {
            "wa": rand(16, 16, 3, 3),
            "wb": rand(16, 32, 1, 1),
            "scale": rand(*scale_shape),
            "shift": rand(32, 1, 1),
        },
    )


def test_per_channel_constants_of_lower_rank_are_blocked_too():
    before = before_layout(dense_block_model((32, 1, 1)))
    assert (32, 1, 1) in [before.types[v].shape for n in before.nodes for v in n.inputs]
    after = transform_layout.run(before)
    # The input blocked to join the conv's output, the output made plain: nothing between.
    assert [n.op for n in after.nodes] == [
        "Conv", "LayoutTransform", "Concat", "Mul", "Add", "Relu", "Conv", "LayoutTransform"
    ]  # fmt: skip
    scale = next(n for n in after.nodes if n.op == "Mul")
    assert [after.types[v].rank for v in scale.inputs] == [5, 5]
    assert {"scale", "shift"}.isdisjoint(after.constants)  # stored once, blocked
    assert_same_function(before, after)


def test_a_lower_rank_constant_along_the_width_sends_the_value_back_to_plain():
    """A [6] constant broadcasts along the width, not the channels: it cannot be blocked."""
    before = before_layout(dense_block_model((6,)))
    after = transform_layout.run(before)
    scale = next(n for n in after.nodes if n.op == "Mul")
    assert [after.types[v].shape for v in scale.inputs] == [(1, 32, 6, 6), (6,)]
    assert_same_function(before, after)


def test_operand_broadcast_over_channels_sends_the_value_back_to_plain():
    model = make_model(
        [
            conv("conv", "x", "w", "a"),
            helper.make_node("Mul", ["a", "mask"], ["y"], name="mask"),
        ],
        [("x", FLOAT, [1, 4, 5, 5])],
        [("y", FLOAT, [1, 16, 5, 5])],
        {"w": rand(16, 4, 1, 1), "mask": rand(1, 1, 5, 5)},
    )
    before = before_layout(model)
    after = transform_layout.run(before)
    mul = next(n for n in after.nodes if n.op == "Mul")
    assert after.types[mul.inputs[0]].shape == (1, 16, 5, 5)
    assert_same_function(before, after)


def squeeze_excitation_model(channels=24):
    """conv -> HardSwish -> GlobalAveragePool -> 1x1 conv -> Relu -> 1x1 conv -> HardSigmoid
    -> Mul with the HardSwish output (MobileNetV3's SE block)."""
    return make_model(
        [
            conv("conv", "x", "w", "a", pads=[1, 1, 1, 1]),
            helper.make_node("HardSwish", ["a"], ["h"], name="hswish"),
            helper.make_node("GlobalAveragePool", ["h"], ["g"], name="squeeze"),
            helper.make_node("Conv", ["g", "w1", "b1"], ["s1"], name="fc1"),
            helper.make_node("Relu", ["s1"], ["r"], name="relu"),
            helper.make_node("Conv", ["r", "w2", "b2"], ["s2"], name="fc2"),
            helper.make_node("HardSigmoid", ["s2"], ["gate"], name="gate", alpha=1 / 6),
            helper.make_node("Mul", ["h", "gate"], ["y"], name="excite"),
        ],
        [("x", FLOAT, [1, 8, 7, 9])],
        [("y", FLOAT, [1, channels, 7, 9])],
        {
            "w": rand(channels, 8, 3, 3),
            "w1": rand(8, channels, 1, 1),
            "b1": rand(8),
            "w2": rand(channels, 8, 1, 1),
            "b2": rand(channels),
        },
    )


@pytest.mark.parametrize("channels", [24, 20])
def test_squeeze_excitation_stays_blocked(channels):
    before = before_layout(squeeze_excitation_model(channels))
    after = transform_layout.run(before, lanes=8)
    transforms = [n for n in after.nodes if n.op == "LayoutTransform"]
    assert [n.outputs for n in transforms] == [("y",)]
    assert after.types["g_nchw8c"].shape == (1, -(-channels // 8), 1, 1, 8)
    assert_same_function(before, after)


def test_blocked_value_that_is_also_an_output_keeps_its_name():
    model = make_model(
        [conv("conv", "x", "w", "a"), helper.make_node("Relu", ["a"], ["y"], name="relu")],
        [("x", FLOAT, [1, 4, 5, 5])],
        [("a", FLOAT, [1, 16, 5, 5]), ("y", FLOAT, [1, 16, 5, 5])],
        {"w": rand(16, 4, 1, 1)},
    )
    before = before_layout(model)
    after = transform_layout.run(before)
    produced = {out for n in after.nodes for out in n.outputs}
    assert {"a", "y"} <= produced
    assert_same_function(before, after)


@pytest.mark.parametrize(
    "channels, group",
    [(4, 1), (24, 4)],
    ids=["fewer_than_8_channels", "groups_of_4_inputs_and_6_outputs"],
)
def test_ineligible_convs_are_left_alone(channels, group):
    model = make_model(
        [conv("conv", "x", "w", "y", group=group)],
        [("x", FLOAT, [1, 16, 5, 5])],
        [("y", FLOAT, [1, channels, 5, 5])],
        {"w": rand(channels, 16 // group, 1, 1)},
    )
    before = before_layout(model)
    assert transform_layout.run(before) is before


def padded_chain_model():
    """Channel counts no block divides: conv 8->58 -> Sigmoid (padding lanes 0.5) ->
    depthwise 58 -> Add(the Sigmoid) -> MaxPool -> conv 58->29 -> Exp (not padding-safe)."""
    return make_model(
        [
            conv("stem", "x", "wa", "a", pads=[1, 1, 1, 1]),
            helper.make_node("Sigmoid", ["a"], ["s"], name="sig"),
            conv("dw", "s", "wb", "b", group=58, pads=[1, 1, 1, 1]),
            helper.make_node("Add", ["b", "s"], ["c"], name="add"),
            helper.make_node(
                "MaxPool", ["c"], ["p"], name="pool", kernel_shape=[3, 3], pads=[1] * 4
            ),
            conv("project", "p", "wc", "d"),
            helper.make_node("Exp", ["d"], ["y"], name="exp"),
        ],
        [("x", FLOAT, [1, 8, 6, 7])],
        [("y", FLOAT, [1, 29, 6, 7])],
        {"wa": rand(58, 8, 3, 3), "wb": rand(58, 1, 3, 3), "wc": rand(29, 58, 1, 1) * 0.1},
    )


@pytest.mark.parametrize("lanes", [16, 8])
def test_odd_channel_counts_stay_blocked_with_padded_blocks(lanes):
    before = before_layout(padded_chain_model())
    after = transform_layout.run(before, lanes=lanes)
    blocked = f"NCHW{lanes}c"
    assert layouts(after) == [
        ("stem", "NCHW", blocked),
        ("dw", blocked, blocked),
        ("project", blocked, blocked),
    ]
    assert after.types["s_" + blocked.lower()].shape == (1, 64 // lanes, 6, 7, lanes)
    transforms = [n for n in after.nodes if n.op == "LayoutTransform"]
    assert [(n.attr("src_layout"), n.attr("channels")) for n in transforms] == [(blocked, 29)]
    exp = next(n for n in after.nodes if n.op == "Exp")
    assert exp.inputs == transforms[0].outputs  # Exp runs on plain data
    assert_same_function(before, after)


def test_padded_blocks_round_trip_and_change_block():
    x = rand(2, 40, 3, 5)
    blocked = to_blocked(x, 16)
    assert blocked.shape == (2, 3, 3, 5, 16)
    assert not blocked[:, 2, ..., 8:].any()  # padding lanes are zero
    np.testing.assert_array_equal(to_plain(blocked, 16, 40), x)
    eights = to_blocked(to_plain(blocked, 16, 40), 8)
    np.testing.assert_array_equal(to_plain(eights, 8), x)


def test_non_constant_weights_are_left_alone():
    model = make_model(
        [conv("conv", "x", "w", "y")],
        [("x", FLOAT, [1, 16, 5, 5]), ("w", FLOAT, [16, 16, 1, 1])],
        [("y", FLOAT, [1, 16, 5, 5])],
    )
    before = before_layout(model)
    assert transform_layout.run(before) is before


def test_block_helpers_round_trip():
    x = rand(2, 32, 3, 5)
    blocked = to_blocked(x, 16)
    assert blocked.shape == (2, 2, 3, 5, 16)
    np.testing.assert_array_equal(blocked[1, 1, 2, 4], x[1, 16:, 2, 4])
    np.testing.assert_array_equal(to_plain(blocked, 16), x)
    assert block_of("NCHW8c") == 8 and block_of("NCHW") == 0
    assert block_of("NCW16c") == 16 and block_of("NCDHW8c") == 8 and block_of("NCW") == 0
    for bad in ("NHWC", "NCW0c", "NCHWc"):
        with pytest.raises(ValueError, match="unknown activation layout"):
            block_of(bad)


@pytest.mark.parametrize("features, block", [("+avx512f,+avx2,+fma", 16), ("+avx2,+fma", 8)])
def test_resnet18_convs_all_blocked(features, block):
    """Blocks of one vector register: 16 channels with AVX-512, 8 with AVX2."""
    target = dataclasses.replace(host_target(), features=features)
    graph = optimize(import_model(shared_model("resnet18")), target=target)
    convs = [n for n in graph.nodes if n.op == "Conv"]
    assert all(n.attr("out_layout") == f"NCHW{block}c" for n in convs)
    # The stem reads the 3-channel input plain and the max pool runs blocked: only the head
    # (global pooling, the classifier) needs plain NCHW.
    assert [n.op for n in graph.nodes if n.op == "LayoutTransform"] == ["LayoutTransform"]
    pool = next(n for n in graph.nodes if n.op == "MaxPool")
    assert pool.attr("data_layout") == f"NCHW{block}c"


def test_pools_run_blocked_unless_indices_are_asked_for():
    def model(with_indices):
        outputs = ["p", "i"] if with_indices else ["p"]
        nodes = [
            conv("conv", "x", "w", "a"),
            helper.make_node("MaxPool", ["a"], outputs, name="pool", kernel_shape=[2, 2]),
            helper.make_node("Relu", ["p"], ["y"], name="relu"),
        ]
        declared = [("y", FLOAT, [1, 16, 4, 4])]
        if with_indices:
            declared.append(("i", INT64, [1, 16, 4, 4]))
        return make_model(nodes, [("x", FLOAT, [1, 4, 5, 5])], declared, {"w": rand(16, 4, 1, 1)})

    for with_indices, expected in ((False, "NCHW16c"), (True, "NCHW")):
        before = before_layout(model(with_indices))
        after = transform_layout.run(before)
        pool = next(n for n in after.nodes if n.op == "MaxPool")
        assert pool.attr("data_layout", "NCHW") == expected
        assert_same_function(before, after)


def test_channel_concat_of_blocked_operands_stays_blocked():
    """U-Net's skip join: two conv outputs concatenated on channels feed a conv; no plain
    round trip in between, and a plain operand is blocked to join them."""
    model = make_model(
        [
            conv("a", "x", "wa", "p", pads=[1, 1, 1, 1]),
            conv("b", "p", "wb", "q", pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["x"], ["r"], name="plain"),
            helper.make_node("Concat", ["q", "p", "r"], ["j"], name="join", axis=-3),
            conv("head", "j", "wc", "y"),
        ],
        [("x", FLOAT, [1, 16, 6, 6])],
        [("y", FLOAT, [1, 16, 6, 6])],
        {"wa": rand(16, 16, 3, 3), "wb": rand(32, 16, 3, 3), "wc": rand(16, 64, 1, 1)},
    )
    before = before_layout(model)
    after = transform_layout.run(before)
    join = next(n for n in after.nodes if n.op == "Concat")
    assert after.types[join.outputs[0]].rank == 5 and join.attr("axis") == 1
    head = next(n for n in after.nodes if n.op == "Conv" and n.inputs[0] == join.outputs[0])
    assert head.attr("data_layout") == "NCHW16c"
    assert_same_function(before, after)


def test_concat_whose_channels_split_a_block_stays_plain():
    model = make_model(
        [
            conv("a", "x", "wa", "p"),
            helper.make_node("Concat", ["p", "x"], ["y"], name="join", axis=1),
        ],
        [("x", FLOAT, [1, 4, 5, 5])],
        [("y", FLOAT, [1, 20, 5, 5])],
        {"wa": rand(16, 4, 1, 1)},
    )
    before = before_layout(model)
    after = transform_layout.run(before)
    join = next(n for n in after.nodes if n.op == "Concat")
    assert after.types[join.outputs[0]].rank == 4
    assert_same_function(before, after)


def gelu_nodes(x, y, prefix):
    """GELU as exported by PyTorch (x * 0.5 * (1 + erf(x / sqrt 2))): scalar operands only."""
    return [
        helper.make_node("Div", [x, "sqrt2"], [f"{prefix}_d"], name=f"{prefix}_div"),
        helper.make_node("Erf", [f"{prefix}_d"], [f"{prefix}_e"], name=f"{prefix}_erf"),
        helper.make_node("Add", [f"{prefix}_e", "one"], [f"{prefix}_a"], name=f"{prefix}_add"),
        helper.make_node("Mul", [x, f"{prefix}_a"], [f"{prefix}_m"], name=f"{prefix}_mul"),
        helper.make_node("Mul", [f"{prefix}_m", "half"], [y], name=f"{prefix}_half"),
    ]


GELU_CONSTANTS = {
    "sqrt2": np.array(np.sqrt(2.0), np.float32),
    "one": np.array(1.0, np.float32),
    "half": np.array(0.5, np.float32),
}


def test_1d_chain_stays_blocked_through_gelu_and_pooling():
    """wav2vec2's feature extractor: strided Conv1d -> GELU -> Conv1d -> GELU, plus a grouped
    Conv1d and a MaxPool over the row: one transform, at the end."""
    model = make_model(
        [
            conv("c1", "x", "w1", "a", kernel_shape=[10], strides=[5]),
            *gelu_nodes("a", "g1", "g1"),
            conv("c2", "g1", "w2", "b", kernel_shape=[3], strides=[2]),
            *gelu_nodes("b", "g2", "g2"),
            conv("c3", "g2", "w3", "c", kernel_shape=[5], pads=[2, 2], group=2),
            helper.make_node("MaxPool", ["c"], ["y"], name="pool", kernel_shape=[2], strides=[2]),
        ],
        [("x", FLOAT, [1, 1, 203])],
        [("y", FLOAT, [1, 32, 9])],
        {
            "w1": rand(32, 1, 10),
            "w2": rand(32, 32, 3),
            "w3": rand(32, 16, 5),
            **GELU_CONSTANTS,
        },
    )
    before = before_layout(model)
    after = transform_layout.run(before)
    assert layouts(after) == [
        ("c1", "NCW", "NCW16c"),
        ("c2", "NCW16c", "NCW16c"),
        ("c3", "NCW16c", "NCW16c"),
    ]
    transforms = [n for n in after.nodes if n.op == "LayoutTransform"]
    assert [(n.attr("src_layout"), n.attr("dst_layout")) for n in transforms] == [("NCW16c", "NCW")]
    assert transforms[0].outputs == ("y",)
    assert next(n for n in after.nodes if n.op == "MaxPool").attr("data_layout") == "NCW16c"
    assert all(
        len(after.types[v].shape) == 4 for n in after.nodes if n.op == "Erf" for v in n.outputs
    )
    assert_same_function(before, after)


def test_3d_chain_stays_blocked():
    """Conv3d (padded, strided) -> Relu -> AveragePool3d -> Conv3d -> residual Add."""
    model = make_model(
        [
            conv("c1", "x", "w1", "a", pads=[1] * 6, strides=[1, 2, 2]),
            helper.make_node("Relu", ["a"], ["r"], name="relu"),
            helper.make_node(
                "AveragePool",
                ["r"],
                ["p"],
                name="pool",
                kernel_shape=[2, 2, 2],
                pads=[0, 0, 0, 1, 1, 1],
            ),
            conv("c2", "p", "w2", "b", pads=[0, 1, 1, 0, 1, 1], kernel_shape=[1, 3, 3]),
            helper.make_node("Add", ["b", "p"], ["y"], name="add"),
        ],
        [("x", FLOAT, [1, 3, 4, 7, 9])],
        [("y", FLOAT, [1, 8, 4, 4, 5])],
        {"w1": rand(8, 3, 3, 3, 3), "w2": rand(8, 8, 1, 3, 3)},
    )
    before = before_layout(model)
    after = transform_layout.run(before, lanes=8)
    assert layouts(after) == [("c1", "NCDHW", "NCDHW8c"), ("c2", "NCDHW8c", "NCDHW8c")]
    transforms = [n for n in after.nodes if n.op == "LayoutTransform"]
    assert [(n.attr("src_layout"), n.attr("dst_layout")) for n in transforms] == [
        ("NCDHW8c", "NCDHW")
    ]
    assert_same_function(before, after)


def test_grouped_conv_reads_its_own_block():
    """A grouped conv (8 channels per group) after a 16-channel block converts its input to
    blocks of 8, so that every input block lies in one group."""
    model = make_model(
        [
            conv("c1", "x", "w1", "a", pads=[1, 1, 1, 1]),
            conv("c2", "a", "w2", "y", pads=[1, 1, 1, 1], group=4),
        ],
        [("x", FLOAT, [1, 4, 6, 5])],
        [("y", FLOAT, [1, 32, 6, 5])],
        {"w1": rand(32, 4, 3, 3), "w2": rand(32, 8, 3, 3)},
    )
    before = before_layout(model)
    after = transform_layout.run(before)
    assert layouts(after) == [("c1", "NCHW", "NCHW16c"), ("c2", "NCHW8c", "NCHW8c")]
    transforms = [
        (n.attr("src_layout"), n.attr("dst_layout"))
        for n in after.nodes
        if n.op == "LayoutTransform"
    ]
    assert transforms == [("NCHW16c", "NCHW8c"), ("NCHW8c", "NCHW")]
    assert_same_function(before, after)


def stem_model(reader: str):
    """A raw-audio stem (1 channel, 10 taps, stride 5, 16 filters) read by `reader`
    ("Relu+MaxPool": a Relu, then a pool)."""
    nodes = [conv("stem", "x", "w", "a", strides=[5])]
    if reader == "Softmax":
        nodes.append(helper.make_node("Softmax", ["a"], ["y"], name="softmax", axis=1))
    elif reader == "Relu+MaxPool":
        nodes.append(helper.make_node("Relu", ["a"], ["r"], name="relu"))
        nodes.append(helper.make_node("MaxPool", ["r"], ["y"], name="pool", kernel_shape=[1]))
    else:
        nodes.append(helper.make_node(reader, ["a"], ["y"], name="reader"))
    return make_model(
        nodes, [("x", FLOAT, [1, 1, 205])], [("y", FLOAT, [1, 16, 40])], {"w": rand(16, 1, 10)}
    )


@pytest.mark.parametrize(
    "reader, blocked",
    [("Softmax", False), ("Identity", False), ("Relu", False), ("Relu+MaxPool", True)],
)
def test_short_reduction_conv_stays_plain_unless_a_reader_takes_it_blocked(reader, blocked):
    """An im2col conv writes plain output from its GEMM tile; blocking it pays only when a
    reader keeps the block: a layout op, directly or behind elementwise ops (which would only
    carry the block to a transform back)."""
    before = before_layout(stem_model(reader))
    after = transform_layout.run(before)
    expected = ("NCW", "NCW16c") if blocked else ("NCHW", "NCHW")  # (no layout attributes)
    assert layouts(after) == [("stem", *expected)]
    assert any(n.op == "LayoutTransform" for n in after.nodes) == blocked
    assert_same_function(before, after)


def depthwise_model(reader: str, stride: int = 1, kernel: int = 3):
    """A depthwise 3x3 conv of plain data (16 channels) read by `reader`: "output" (a graph
    output), "Transpose" (ConvNeXt's permute to channels-last), "Relu" (then the output) or
    "Relu+Conv" (a 1x1 conv after the Relu)."""
    pads = [kernel // 2] * 4
    nodes = [conv("dw", "x", "w", "a", group=16, strides=[stride] * 2, pads=pads)]
    size = (9 - 1) // stride + 1
    out, shape, weights = "a", [1, 16, size, size], {"w": rand(16, 1, kernel, kernel)}
    if reader == "Transpose":
        nodes.append(helper.make_node("Transpose", ["a"], ["y"], name="nhwc", perm=[0, 2, 3, 1]))
        out, shape = "y", [1, size, size, 16]
    elif reader.startswith("Relu"):
        nodes.append(helper.make_node("Relu", ["a"], ["r"], name="relu"))
        out = "r"
    if reader == "Relu+Conv":
        nodes.append(conv("project", "r", "wp", "y"))
        out, weights["wp"] = "y", rand(24, 16, 1, 1)
        shape = [1, 24, size, size]
    return make_model(nodes, [("x", FLOAT, [1, 16, 9, 9])], [(out, FLOAT, shape)], weights)


@pytest.mark.parametrize(
    "reader, stride, kernel, blocked",
    [
        ("output", 1, 3, False),
        ("Transpose", 1, 5, False),
        ("Relu", 1, 3, False),
        ("Relu+Conv", 1, 3, True),
        ("output", 2, 3, False),
        ("output", 2, 5, True),  # strided, 25 taps: a masked load and a shuffle each
        ("output", 3, 3, True),
        ("Transpose", 1, 7, True),  # 49 taps: the blocked conv's whole-vector loads win
    ],
)
def test_depthwise_conv_of_plain_data_stays_plain_unless_a_reader_takes_it_blocked(
    reader, stride, kernel, blocked
):
    before = before_layout(depthwise_model(reader, stride, kernel))
    after = transform_layout.run(before)
    dw = next(n for n in after.nodes if n.op == "Conv" and n.attr("group", 1) == 16)
    assert (dw.attr("out_layout", "NCHW") == "NCHW16c") == blocked
    assert dw.attr("data_layout", "NCHW") == ("NCHW16c" if blocked else "NCHW")
    assert_same_function(before, after)


def test_a_reader_is_looked_for_once_per_value_down_branching_elementwise_chains():
    """dw -> 40 x (Add(v, v)): each value read twice by one node. Walked per read, the search
    for a reader that takes blocked data would visit 2^40 paths; per value, 40."""
    nodes = [conv("dw", "x", "w", "v0", group=16, pads=[1, 1, 1, 1])]
    for k in range(40):
        nodes.append(helper.make_node("Add", [f"v{k}", f"v{k}"], [f"v{k + 1}"], name=f"add{k}"))
    model = make_model(
        nodes,
        [("x", FLOAT, [1, 16, 9, 9])],
        [("v40", FLOAT, [1, 16, 9, 9])],
        {"w": rand(16, 1, 3, 3)},
    )
    after = transform_layout.run(before_layout(model))
    assert not any(n.op == "LayoutTransform" for n in after.nodes)
