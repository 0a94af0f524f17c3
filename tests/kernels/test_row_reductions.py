"""Row reductions (softmax, layer norm, group and instance norm, reduce over trailing and
spatial axes) and plain-NCHW pooling: native code agrees with ONNX Runtime on odd row lengths
(shorter than a vector, a prime number of elements, several vectors and a remainder), and the
loop-IR interpreter agrees with the native code for the row schedules."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper

import compiler_core
from compiler_core.build import build_group
from compiler_core.codegen.llvm import build_module
from compiler_core.codegen.native import emit_object, link_shared
from compiler_core.frontend.onnx import import_model
from compiler_core.kernels.schedules import schedule_for
from compiler_core.loop import interpreter
from compiler_core.loop.ir import For
from compiler_core.loop.transform import walk_stmts
from compiler_core.passes.pipeline import optimize
from compiler_core.runtime import load
from compiler_core.runtime.library import KernelLibrary
from compiler_core.schedule.primitives import ScheduleError, SplitOverlap, apply
from compiler_core.target import host_target
from tests.conftest import FLOAT, assert_close_to_scale, make_model

RNG = np.random.default_rng(11)


def one_node(op, shape, out_shape, inputs=("x",), weights=None, opset=18, **attrs):
    weights = weights or {}
    node = helper.make_node(op, [*inputs, *weights], ["y"], name=op.lower(), **attrs)
    return make_model(
        [node],
        [(name, FLOAT, shape) for name in inputs],
        [("y", FLOAT, out_shape)],
        {k: v.astype(np.float32) for k, v in weights.items()},
        opset=opset,
    )


def check_against_ort(model, shape, scale=1.0):
    x = (RNG.standard_normal(shape) * scale).astype(np.float32)
    data = model.SerializeToString()
    ours = load(compiler_core.compile(data)).run({"x": x})["y"]
    (theirs,) = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert_close_to_scale(ours, theirs)


@pytest.mark.parametrize("length", [1, 7, 8, 197, 1000])
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax_last_axis(op, length):
    shape = [3, 2, length]
    check_against_ort(one_node(op, shape, shape, axis=-1, opset=13), shape, scale=4.0)


@pytest.mark.parametrize(
    ("shape", "axis"), [([5, 13, 11], 0), ([5, 13, 11], 1), ([2, 21, 9, 10], 1)]
)
def test_softmax_other_axes(shape, axis):
    check_against_ort(one_node("Softmax", shape, shape, axis=axis, opset=13), shape)


def test_softmax_of_one_row():
    check_against_ort(one_node("Softmax", [197], [197], axis=0, opset=13), [197], scale=8.0)


@pytest.mark.parametrize(
    ("shape", "axis", "bias"),
    [
        ([5, 197], -1, True),
        ([3, 4, 768], -1, False),
        ([2, 3, 5], -1, True),  # rows shorter than a vector
        ([3, 7, 11], -2, True),  # two trailing axes, read as one flat row of 77
        ([2, 9, 13], 1, False),
    ],
)
def test_layer_norm(shape, axis, bias):
    inner = shape[axis:]
    weights = {"scale": RNG.standard_normal(inner) + 1.0}
    if bias:
        weights["bias"] = RNG.standard_normal(inner)
    model = one_node("LayerNormalization", shape, shape, weights=weights, opset=17, axis=axis)
    check_against_ort(model, shape, scale=3.0)


@pytest.mark.parametrize(
    "shape",
    [
        [1, 8, 3199],  # wav2vec2's extractor norm: 199 vectors and a remainder
        [2, 3, 7, 9],  # two spatial axes, read as one flat row of 63
        [2, 4, 5],  # rows shorter than a vector: the scalar sums
        [1, 2, 4, 4, 3],
    ],
)
def test_instance_norm(shape):
    channels = shape[1]
    weights = {"scale": RNG.standard_normal(channels) + 1.0, "bias": RNG.standard_normal(channels)}
    model = one_node("InstanceNormalization", shape, shape, weights=weights, opset=6)
    check_against_ort(model, shape, scale=3.0)


@pytest.mark.parametrize(
    ("shape", "groups"), [([1, 512, 49], 32), ([2, 6, 5, 7], 3), ([2, 4, 9], 2), ([3, 6], 3)]
)
def test_group_norm(shape, groups):
    channels = shape[1]
    weights = {"scale": RNG.standard_normal(channels), "bias": RNG.standard_normal(channels)}
    model = one_node(
        "GroupNormalization", shape, shape, weights=weights, opset=21, num_groups=groups
    )
    check_against_ort(model, shape)


REDUCE_CASES = [
    ([1, 32, 28, 28], [2, 3]),  # spatial, 784 per row
    ([2, 5, 13], [2]),  # trailing, prime
    ([3, 6, 9, 5], [2, 3]),  # 45 per row: vectors and a remainder
    ([4, 1000], [1]),
    ([3, 5, 7], [1]),  # not trailing
    ([2, 6, 3, 67], [1, 2]),  # not trailing, a row of 67 (one register tile of 67 lanes)
    ([1, 4, 3, 130], [1]),  # a row of 130: split into tiles
    ([2, 3, 4], [0, 1, 2]),  # everything
    ([6, 5], [1]),  # rows shorter than a vector
]


@pytest.mark.parametrize(("shape", "axes"), REDUCE_CASES)
@pytest.mark.parametrize("op", ["ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin"])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce(op, shape, axes, keepdims):
    out = [1 if k in axes else d for k, d in enumerate(shape)] if keepdims else None
    out = out or [d for k, d in enumerate(shape) if k not in axes]
    node = helper.make_node(op, ["x", "axes"], ["y"], name="r", keepdims=keepdims)
    model = make_model(
        [node],
        [("x", FLOAT, shape)],
        [("y", FLOAT, out)],
        {"axes": np.array(axes, np.int64)},
        opset=18,
    )
    check_against_ort(model, shape)


def test_reduce_of_a_fused_producer():
    """A reduction over two trailing axes of a value computed in the same kernel."""
    shape = [2, 4, 5, 9]
    nodes = [
        helper.make_node("Exp", ["x"], ["e"], name="exp"),
        helper.make_node("ReduceSum", ["e", "axes"], ["y"], name="r", keepdims=1),
    ]
    model = make_model(
        nodes,
        [("x", FLOAT, shape)],
        [("y", FLOAT, [2, 4, 1, 1])],
        {"axes": np.array([2, 3], np.int64)},
        opset=18,
    )
    check_against_ort(model, shape)


POOL_CASES = [
    ("AveragePool", [1, 6, 28, 28], dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1])),
    ("AveragePool", [2, 3, 13, 11], dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1])),
    (
        "AveragePool",
        [1, 5, 13, 11],
        dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=1),
    ),
    (
        "AveragePool",
        [1, 4, 12, 17],
        dict(kernel_shape=[3, 2], strides=[2, 2], pads=[1, 0, 1, 1], ceil_mode=1),
    ),
    ("AveragePool", [1, 3, 9, 70], dict(kernel_shape=[2, 2])),  # a row of 69: a split tile
    ("MaxPool", [1, 5, 15, 15], dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    ("MaxPool", [1, 3, 10, 10], dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1)),
    ("MaxPool", [1, 4, 40, 56], dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    ("AveragePool", [1, 2, 9, 50], dict(kernel_shape=[3, 3], strides=[1, 3])),
    ("MaxPool", [1, 2, 9, 50], dict(kernel_shape=[2, 5], strides=[2, 5])),  # gathered
]


def pooled_shape(shape, attrs):
    kernel = attrs["kernel_shape"]
    strides = attrs.get("strides", [1, 1])
    pads = attrs.get("pads", [0, 0, 0, 0])
    out = list(shape[:2])
    for k in range(2):
        span = shape[2 + k] + pads[k] + pads[k + 2] - kernel[k]
        steps = -(-span // strides[k]) if attrs.get("ceil_mode") else span // strides[k]
        if attrs.get("ceil_mode") and steps * strides[k] >= shape[2 + k] + pads[k]:
            steps -= 1  # the last window must start inside the input or its leading pad
        out.append(steps + 1)
    return out


@pytest.mark.parametrize(("op", "shape", "attrs"), POOL_CASES)
def test_plain_pooling(op, shape, attrs):
    model = one_node(op, shape, pooled_shape(shape, attrs), opset=17, **attrs)
    check_against_ort(model, shape)


SCHEDULED = {
    "softmax_10": lambda: one_node("Softmax", [64, 10], [64, 10], axis=-1, opset=13),
    "logsoftmax_12x8": lambda: one_node("LogSoftmax", [12, 5, 8], [12, 5, 8], axis=-1, opset=13),
    "softmax_197": lambda: one_node("Softmax", [2, 3, 197], [2, 3, 197], axis=-1, opset=13),
    "layer_norm_two_axes": lambda: one_node(
        "LayerNormalization",
        [2, 3, 7],
        [2, 3, 7],
        weights={"scale": RNG.standard_normal([3, 7])},
        opset=17,
        axis=-2,
    ),
    "reduce_mean_spatial": lambda: one_node(
        "ReduceMean", [1, 3, 5, 7], [1, 3, 1, 1], opset=17, axes=[2, 3]
    ),
    "softmax_channels": lambda: one_node("Softmax", [1, 5, 6, 10], [1, 5, 6, 10], axis=1),
    "reduce_sum_channels": lambda: one_node(
        "ReduceSum", [2, 7, 67], [2, 67], opset=11, axes=[1], keepdims=0
    ),
    "group_norm": lambda: one_node(
        "GroupNormalization",
        [2, 6, 5, 3],
        [2, 6, 5, 3],
        weights={"scale": RNG.standard_normal(6), "bias": RNG.standard_normal(6)},
        opset=21,
        num_groups=3,
    ),
    "instance_norm": lambda: one_node(
        "InstanceNormalization",
        [1, 3, 37],
        [1, 3, 37],
        weights={"scale": RNG.standard_normal(3), "bias": RNG.standard_normal(3)},
        opset=6,
    ),
    "avgpool_plain": lambda: one_node(
        "AveragePool", [1, 2, 9, 11], [1, 2, 9, 11], kernel_shape=[3, 3], pads=[1, 1, 1, 1]
    ),
    "maxpool_plain_stride2": lambda: one_node(
        "MaxPool",
        [1, 2, 17, 45],
        [1, 2, 9, 23],
        kernel_shape=[3, 3],
        strides=[2, 2],
        pads=[1, 1, 1, 1],
    ),
    "avgpool_plain_stride3": lambda: one_node(
        "AveragePool", [1, 2, 9, 50], [1, 2, 7, 16], kernel_shape=[3, 3], strides=[1, 3]
    ),
}


def random_args(func):
    return {b.name: RNG.standard_normal(b.shape).astype(b.dtype) for b in func.params}


@pytest.mark.parametrize(
    ("name", "config"),
    [(name, None) for name in SCHEDULED]
    + [
        ("softmax_197", {"per_row": 0}),
        ("softmax_10", {"per_row": 0}),
        ("group_norm", {"per_row": 0}),
    ],
)
def test_row_schedules_keep_meaning(name, config, tmp_path):
    """Interpreter before and after the schedule (at its default point, or `config` of the
    row_reduction template), and native code, agree."""
    graph = optimize(import_model(SCHEDULED[name]()))
    target = host_target()
    for index, group in enumerate(graph.groups):
        naive = build_group(graph, group, index, target, schedule=[])
        schedule = schedule_for(naive.stages, target, config) if config else None
        scheduled = build_group(graph, group, index, target, schedule=schedule)
        assert any(type(r).__name__ == "Vectorize" for r in scheduled.schedule), name
        args = random_args(naive.func)
        expected = {k: v.copy() for k, v in args.items()}
        interpreter.run(naive.func, expected)
        interpreted = {k: v.copy() for k, v in args.items()}
        interpreter.run(scheduled.func, interpreted)
        native = {k: v.copy() for k, v in args.items()}
        obj = emit_object(build_module([scheduled.func], target), target)
        library = KernelLibrary(link_shared([obj], tmp_path / f"{name}_{index}.so"))
        library.call(scheduled.func.name, [native[b.name] for b in scheduled.func.params])
        for buf in scheduled.func.params:
            np.testing.assert_allclose(interpreted[buf.name], expected[buf.name], 1e-4, 1e-5)
            np.testing.assert_allclose(native[buf.name], interpreted[buf.name], 1e-4, 1e-5)


def test_split_overlap_refuses_an_accumulating_loop():
    graph = optimize(import_model(one_node("ReduceSum", [4, 20], [4, 1], opset=11, axes=[1])))
    naive = build_group(graph, graph.groups[0], 0, host_target(), schedule=[])
    loops = [s.var.name for s in walk_stmts(naive.func.body) if isinstance(s, For)]
    reduce_loop = next(name for name in loops if name.endswith("_rv"))
    with pytest.raises(ScheduleError):
        apply(naive.func, [SplitOverlap(reduce_loop, 8)])


def test_row_reduction_has_no_scalar_tail():
    """A softmax row of 197 is 24 vectors and one more ending at 197, in every pass."""
    graph = optimize(import_model(SCHEDULED["softmax_197"]()))
    kernel = build_group(graph, graph.groups[0], 0, host_target())
    kinds = [type(r).__name__ for r in kernel.schedule]
    assert {"ComputeAt", "CacheWrite", "SplitOverlap", "Parallel"} <= set(kinds)


@pytest.mark.parametrize("length", [4, host_target().vector_lanes - 2])
def test_softmax_of_short_rows_is_one_pass_over_rows(length):
    """Rows shorter than a vector (4 keys; 14 classes with AVX-512, 6 with AVX2): each row's
    max and sum computed where the row is read, every stage in one parallel loop over the
    rows (not a parallel loop a stage), a row of 8 or more elements one shorter vector."""
    shape = [64, length]
    model = one_node("Softmax", shape, shape, axis=-1, opset=13)
    graph = optimize(import_model(model))
    kernel = build_group(graph, graph.groups[0], 0, host_target())
    kinds = [type(r).__name__ for r in kernel.schedule]
    assert kinds.count("Parallel") == 1 and kinds.count("ComputeAt") == 3
    assert ("Vectorize" in kinds) == (length >= 8)
    check_against_ort(model, shape, scale=4.0)


def test_layer_norm_of_short_rows_is_one_pass_over_rows_but_half_vectors_stay_plain():
    """Rows shorter than a vector run as rows (one parallel loop), except rows of half a
    vector: LLVM packs two of them a vector in the plain passes (one parallel loop a pass)."""
    half = host_target().vector_lanes // 2
    for length, loops in ((half, 3), (half + 2, 1)):
        shape = [64, length]
        weights = {"scale": RNG.standard_normal(length), "bias": RNG.standard_normal(length)}
        model = one_node("LayerNormalization", shape, shape, weights=weights, opset=17, axis=-1)
        graph = optimize(import_model(model))
        kernel = build_group(graph, graph.groups[0], 0, host_target())
        assert [type(r).__name__ for r in kernel.schedule].count("Parallel") == loops, length
        check_against_ort(model, shape)
