"""pointwise_matmul: a 1x1 conv the layout pass leaves on plain data becomes a MatMul over its
pixels (grouped: one GEMM per group), checked against the reference executor (same
function) and compiled against ONNX Runtime; the views around the GEMM live in the bytes
they view (`build.view_aliases`) and their kernels copy nothing."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from compiler_core.build import build_kernels, plan_memory, view_aliases
from compiler_core.frontend.onnx import import_model
from compiler_core.loop.ir import Block
from compiler_core.passes import pointwise_matmul
from compiler_core.passes.pipeline import optimize
from compiler_core.target import parse_target
from tests.conftest import FLOAT, make_model
from tests.passes.test_passes import assert_same_function
from tests.passes.test_views import check_compiled

RNG = np.random.default_rng(17)
AVX512 = parse_target("llvm -mcpu=znver5 -mattr=+avx512f")
AVX2 = parse_target("llvm -mcpu=znver3 -mattr=+avx2,+fma")
ZEN4 = parse_target("llvm -mcpu=znver4 -mattr=+avx512f")  # a zmm FMA in two halves


def rand(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def shuffle_unit(batch=1, channels=136, group=4, spatial=(6, 6), bias=True, kernel=1, stride=1):
    """ShuffleNet's pointwise group conv (+ Relu), whose input a residual Add reads too."""
    taps = [kernel] * len(spatial)
    conv_inputs = ["r", "w", "b"] if bias else ["r", "w"]
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu_in"),
        helper.make_node(
            "Conv",
            conv_inputs,
            ["c"],
            name="gconv",
            group=group,
            kernel_shape=taps,
            strides=[stride] * len(spatial),
        ),  # fmt: skip
        helper.make_node("Relu", ["c"], ["a"], name="relu"),
    ]
    out_spatial = [(d - kernel) // stride + 1 for d in spatial]
    same = out_spatial == list(spatial)
    if same:
        nodes.append(helper.make_node("Add", ["a", "r"], ["y"], name="residual"))
    else:
        nodes.append(helper.make_node("Identity", ["a"], ["y"], name="out"))
    weights = {"w": rand(channels, channels // group, *taps, scale=0.3)}
    if bias:
        weights["b"] = rand(channels)
    return make_model(
        nodes,
        [("x", FLOAT, [batch, channels, *spatial])],
        [("y", FLOAT, [batch, channels, *out_spatial])],
        weights,
    )


def laid_out(model, target=AVX512):
    return optimize(import_model(model), stop_after="transform_layout", target=target)


@pytest.mark.parametrize(
    ("batch", "channels", "group", "spatial", "bias"),
    [
        (1, 136, 4, (6, 6), True),  # groups of 34: no channel block fills them
        (1, 136, 4, (5, 7), False),
        (2, 136, 4, (6, 6), True),  # the filters broadcast over the batch
        (1, 68, 2, (9,), True),  # 1-D
        (1, 68, 2, (3, 4, 5), True),  # 3-D
    ],
)
def test_a_plain_pointwise_conv_becomes_a_matmul_of_the_same_function(
    batch, channels, group, spatial, bias
):
    model = shuffle_unit(batch, channels, group, spatial, bias)
    before = laid_out(model)
    after = pointwise_matmul.run(before)
    assert before.op_histogram()["Conv"] == 1
    histogram = after.op_histogram()
    assert "Conv" not in histogram and histogram["MatMul"] == 1
    assert histogram.get("Add", 0) == 1 + bias  # the residual, and the bias
    (matmul,) = (n for n in after.nodes if n.op == "MatMul")
    filters = after.types[matmul.inputs[0]].shape
    assert filters == (group, channels // group, channels // group)
    assert_same_function(before, after)
    check_compiled(model, {"x": rand(batch, channels, *spatial)})


def test_an_ungrouped_plain_pointwise_conv_is_a_2d_gemm():
    """A 1x1 head of two classes over plain data (too few channels to block)."""
    model = make_model(
        [helper.make_node("Conv", ["x", "w", "b"], ["y"], name="head")],
        [("x", FLOAT, [1, 32, 7, 9])],
        [("y", FLOAT, [1, 2, 7, 9])],
        {"w": rand(2, 32, 1, 1), "b": rand(2)},
    )
    after = optimize(import_model(model), stop_after="pointwise_matmul", target=AVX2)
    (matmul,) = (n for n in after.nodes if n.op == "MatMul")
    assert [after.types[v].shape for v in matmul.inputs] == [(2, 32), (32, 63)]
    check_compiled(model, {"x": rand(1, 32, 7, 9)})


@pytest.mark.parametrize(
    ("channels", "group", "kernel", "stride"),
    [
        (128, 4, 1, 1),  # groups of 32 fill 16-lane blocks: the blocked conv
        (136, 4, 3, 1),  # not pointwise
        (136, 4, 1, 2),  # strided
        (12, 4, 1, 1),  # 3 input channels a group: too short a reduction
    ],
)
def test_other_convs_stay_convs(channels, group, kernel, stride):
    before = laid_out(shuffle_unit(channels=channels, group=group, kernel=kernel, stride=stride))
    assert pointwise_matmul.run(before) is before


@pytest.mark.parametrize(("target", "blocked"), [(AVX512, False), (ZEN4, True), (AVX2, True)])
def test_groups_that_fill_half_vector_blocks_take_the_gemm_on_full_width_fmas(target, blocked):
    """Groups of 136 channels fill blocks of 8, half a zmm register: where FMAs run 16 lanes
    at once the pointwise conv stays plain and becomes a MatMul (ShuffleNet's 544-channel
    convs at 7 x 7: 34 -> 24 us on Zen 5); where they run 8 (Zen 4, AVX2) it stays blocked."""
    model = shuffle_unit(channels=544, spatial=(7, 7))
    graph = optimize(import_model(model), stop_after="pointwise_matmul", target=target)
    assert ("Conv" in graph.op_histogram()) is blocked
    assert ("MatMul" in graph.op_histogram()) is not blocked
    if not blocked:
        check_compiled(model, {"x": rand(1, 544, 7, 7)})


def test_a_grouped_3x3_conv_of_half_vector_blocks_stays_blocked():
    graph = laid_out(shuffle_unit(channels=544, spatial=(7, 7), kernel=3))
    (conv,) = (n for n in graph.nodes if n.op == "Conv")
    assert conv.attr("out_layout") == "NCHW8c"


def test_a_gpu_target_keeps_its_convs():
    graph = optimize(import_model(shuffle_unit()), target=parse_target("cuda -arch=sm_90"))
    assert graph.op_histogram()["Conv"] == 1 and "MatMul" not in graph.op_histogram()


def test_the_gemm_operand_is_a_view_whose_kernel_copies_nothing():
    """The data's Reshape, read by the MatMul alone while the residual Add reads its source,
    is a group of its own that lives in its source's bytes (the Reshape back starts the
    Relu and Add's group)."""
    graph = optimize(import_model(shuffle_unit()), target=AVX512)
    aliases = view_aliases(graph)
    assert list(aliases.values()) == [("r", 0)]
    kernels = build_kernels(graph, AVX512)
    memory = plan_memory(graph, kernels)
    for view, (source, offset) in aliases.items():
        assert offset == 0 and memory.offsets[view] == memory.offsets[source]
        (kernel,) = (k for k in kernels if view in k.outputs)
        assert kernel.func.body == Block(())


def test_a_view_of_a_graph_input_is_copied():
    model = make_model(
        [
            helper.make_node("Reshape", ["x", "shape"], ["v"], name="view"),
            helper.make_node("MatMul", ["w", "v"], ["y"], name="gemm"),
        ],
        [("x", FLOAT, [1, 8, 4, 4])],
        [("y", FLOAT, [4, 16])],
        {"shape": np.array([8, 16], np.int64), "w": rand(4, 8)},
    )
    graph = optimize(import_model(model), target=AVX512)
    assert view_aliases(graph) == {}
    check_compiled(model, {"x": rand(1, 8, 4, 4)})


def test_a_view_of_a_view_lives_in_the_first_ones_source():
    """Relu -> Reshape -> Flatten -> two GEMMs: both views alias the Relu's output."""
    model = make_model(
        [
            helper.make_node("Relu", ["x"], ["r"], name="relu"),
            helper.make_node("Reshape", ["r", "shape"], ["v"], name="view"),
            helper.make_node("Flatten", ["v"], ["f"], name="flat", axis=1),
            helper.make_node("MatMul", ["f", "w"], ["y"], name="gemm"),
            helper.make_node("MatMul", ["f", "w"], ["z"], name="gemm2"),
        ],
        [("x", FLOAT, [2, 3, 4, 4])],
        [("y", FLOAT, [2, 5]), ("z", FLOAT, [2, 5])],
        {"shape": np.array([2, 3, 16], np.int64), "w": rand(48, 5)},
    )
    graph = optimize(import_model(model), target=AVX512)
    relu = next(n for n in graph.nodes if n.op == "Relu").outputs[0]
    assert set(view_aliases(graph).values()) == {(relu, 0)}
    check_compiled(model, {"x": rand(2, 3, 4, 4)})


def test_on_a_gpu_a_view_for_a_gemm_is_launched_as_nothing():
    """The CUDA plan places the view in its source's bytes and launches no copy for it."""
    from compiler_core.gpu.build import build_gpu_graph

    model = make_model(
        [
            helper.make_node("Relu", ["x"], ["r"], name="relu"),
            helper.make_node("Reshape", ["r", "shape"], ["v"], name="view"),
            helper.make_node("MatMul", ["w", "v"], ["y"], name="gemm"),
            helper.make_node("Add", ["r", "r"], ["z"], name="twice"),
        ],
        [("x", FLOAT, [1, 8, 4, 4])],
        [("y", FLOAT, [4, 16]), ("z", FLOAT, [1, 8, 4, 4])],
        {"shape": np.array([8, 16], np.int64), "w": rand(4, 8)},
    )
    cuda = parse_target("cuda -arch=sm_90")
    graph = optimize(import_model(model), target=cuda)
    (view,) = view_aliases(graph)
    gpu = build_gpu_graph(graph, cuda)
    assert gpu.memory.offsets[view] == gpu.memory.offsets["r"]
    launched = [launch.kernel for launch in gpu.launches]
    assert not any("view" in kernel for kernel in launched), launched
    assert any(view in launch.args for launch in gpu.launches)  # the GEMM reads it
