"""Winograd F(m x m, 3 x 3) convolutions (kernels/winograd.py): the transform matrices against
a direct 3x3 correlation, the rule that picks the algorithm, and whole convs through native
code against ONNX Runtime (padded channel blocks, tiles past the image's edge, fused
epilogues, batch 2, data the layout pass blocks for it)."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper

import compiler_core
from compiler_core.build import lower_group
from compiler_core.frontend.onnx import import_model
from compiler_core.kernels.schedules import default_schedule
from compiler_core.kernels.winograd import (
    TRANSFORMS,
    conv_algorithms,
    default_algorithm,
    transformed_filters,
)
from compiler_core.passes.pipeline import optimize
from compiler_core.runtime import load
from compiler_core.schedule.primitives import ReverseComputeInline
from compiler_core.target import host_target
from tests.conftest import FLOAT, assert_close_to_scale, make_model

RNG = np.random.default_rng(23)


def rand(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


@pytest.mark.parametrize("m", sorted(TRANSFORMS))
def test_transform_matrices_compute_a_3x3_correlation(m):
    """A^T [(G g G^T) * (B^T d B)] A is the m x m valid correlation of an alpha x alpha window
    d with a 3x3 filter g."""
    t = TRANSFORMS[m]
    bt, at = np.asarray(t.bt, np.float64), np.asarray(t.at, np.float64)
    d = RNG.standard_normal((t.alpha, t.alpha))
    g = RNG.standard_normal((3, 3))
    u = transformed_filters(g[None, None], t).astype(np.float64)  # float64 in, float64 out
    u = u.reshape(t.alpha, t.alpha)
    winograd = at @ (u * (bt @ d @ bt.T)) @ at.T
    direct = np.array([[np.sum(d[i : i + 3, j : j + 3] * g) for j in range(m)] for i in range(m)])
    np.testing.assert_allclose(winograd, direct, rtol=1e-10, atol=1e-10)


def test_algorithm_rules():
    """Winograd can run dense 3x3 stride-1 convs with enough channels; untuned, it does when
    the image has enough tiles (4x4 tiles on large images, 2x2 on small ones). Strided,
    dilated and grouped convs, and few channels, stay direct."""
    both = ("direct", "winograd2", "winograd4")
    assert conv_algorithms((3, 3), (1, 1), (1, 1), 1, 64, 64) == both
    assert conv_algorithms((3, 3), (2, 2), (1, 1), 1, 64, 64) == ("direct",)
    assert conv_algorithms((3, 3), (1, 1), (2, 2), 1, 64, 64) == ("direct",)
    assert conv_algorithms((3, 3), (1, 1), (1, 1), 2, 64, 64) == ("direct",)
    assert conv_algorithms((5, 5), (1, 1), (1, 1), 1, 64, 64) == ("direct",)
    assert conv_algorithms((3, 3), (1, 1), (1, 1), 1, 16, 64) == ("direct",)
    zen3 = dataclasses.replace(host_target(), cpu="znver3", features="+avx2,+fma")
    assert default_algorithm(both, 56, 56, zen3) == "winograd4"
    assert default_algorithm(both, 28, 28, zen3) == "winograd4"
    assert default_algorithm(both, 14, 14, zen3) == "winograd4"
    assert default_algorithm(both, 12, 12, zen3) == "winograd2"
    assert default_algorithm(both, 7, 7, zen3) == "winograd2"
    assert default_algorithm(both, 5, 5, zen3) == "direct"
    assert default_algorithm(("direct",), 56, 56, zen3) == "direct"


def test_where_fmas_run_at_half_width_small_images_take_the_larger_winograd_tile():
    """Zen 1 splits each 256-bit FMA in two: the multiplications F(4x4) saves weigh more than
    the transformed filters it reads, on every image F(2x2) would take."""
    both = ("direct", "winograd2", "winograd4")
    zen1 = dataclasses.replace(host_target(), cpu="znver1", features="+avx2,+fma")
    assert zen1.fma_lanes == 4
    assert default_algorithm(both, 12, 12, zen1) == "winograd4"
    assert default_algorithm(both, 7, 7, zen1) == "winograd4"
    assert default_algorithm(both, 5, 5, zen1) == "direct"


def winograd_chain(c, m, size, batch=1, pads=(1, 1, 1, 1), bias=True, residual=False):
    """Conv 3x3 (c -> c) -> Relu -> Conv 3x3 (c -> m, `pads`) [+ bias] [+ x] -> Relu."""
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"], name="c1", pads=[1] * 4),
        helper.make_node("Relu", ["a"], ["r"], name="relu1"),
        helper.make_node("Conv", ["r", "w2", *(["b2"] if bias else [])], ["b"], name="c2",
                         pads=list(pads)),
    ]  # fmt: skip
    last = "b"
    if residual:
        nodes.append(helper.make_node("Add", ["b", "x"], ["s"], name="add"))
        last = "s"
    nodes.append(helper.make_node("Relu", [last], ["y"], name="relu2"))
    out_h = size + pads[0] + pads[2] - 2
    out_w = size + pads[1] + pads[3] - 2
    weights = {"w1": rand(c, c, 3, 3, scale=0.1), "w2": rand(m, c, 3, 3, scale=0.1)}
    if bias:
        weights["b2"] = rand(m)
    return make_model(
        nodes,
        [("x", FLOAT, [batch, c, size, size])],
        [("y", FLOAT, [batch, m, out_h, out_w])],
        weights,
    )


CASES = {
    # 36 tiles of 4x4 exactly.
    "whole_tiles": lambda: winograd_chain(32, 32, 24),
    # 21x21: the last row and column of 4x4 tiles hang past the image; 40 outputs fill 8-lane
    # blocks.
    "partial_tiles_40_channels": lambda: winograd_chain(32, 40, 21),
    # 2x2 tiles on small images: whole (8x8) and partial (7x7).
    "small_tiles": lambda: winograd_chain(32, 32, 8),
    "small_partial_tiles": lambda: winograd_chain(32, 48, 7),
    # 48 input channels into 36 outputs: a padded last output block.
    "padded_output_block": lambda: winograd_chain(48, 36, 25, bias=False),
    "residual_add": lambda: winograd_chain(32, 32, 26, residual=True),
    "batch_of_two": lambda: winograd_chain(32, 32, 23, batch=2),
    "asymmetric_pads": lambda: winograd_chain(32, 32, 13, pads=(0, 1, 2, 0)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_winograd_conv_matches_onnxruntime(name):
    model = CASES[name]()
    graph = optimize(import_model(model), target=host_target())
    convs = [n for n in graph.nodes if n.op == "Conv"]
    # Both convs read blocked data: the first one's plain input is transformed for it.
    assert all(n.attr("data_layout", "NCHW")[-1] == "c" for n in convs), name
    stages = [
        stage.name
        for index, group in enumerate(graph.groups)
        for stage in lower_group(graph, group, index, host_target()).stages
    ]
    assert sum(name.startswith("wgin") for name in stages) == 2, stages
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    feeds = {"x": rand(*shape)}
    module = load(compiler_core.compile(model))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = session.run(["y"], feeds)[0]
    assert_close_to_scale(module.run(feeds)["y"], expected, label=name)


def test_a_residual_epilogue_runs_in_the_output_transform():
    """Add (inlined) -> Relu after a Winograd conv is one store of the output transform, not
    a pass of its own over the output."""
    graph = optimize(import_model(CASES["residual_add"]()), target=host_target())
    index, group = next(
        (k, g) for k, g in enumerate(graph.groups) if "add" in " ".join(g.nodes).lower()
    )
    stages = lower_group(graph, group, index, host_target()).stages
    records = default_schedule(stages, host_target())
    last = stages[-1].name
    assert last.startswith("relu") and ReverseComputeInline(last) in records, records


def frames_chain(c, m, frames, size, batch=1, depth_pads=(0, 0)):
    """R(2+1)D's block: Conv (1, 3, 3) (c -> m, a 2-D conv of each frame) -> Relu -> Conv
    (3, 1, 1) (m -> c, across frames) -> Relu; `depth_pads` on the first conv."""
    front, back = depth_pads
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["a"], name="spatial",
                         pads=[front, 1, 1, back, 1, 1]),
        helper.make_node("Relu", ["a"], ["r"], name="relu1"),
        helper.make_node("Conv", ["r", "w2"], ["b"], name="temporal", pads=[1, 0, 0, 1, 0, 0]),
        helper.make_node("Relu", ["b"], ["y"], name="relu2"),
    ]  # fmt: skip
    out_frames = frames + front + back
    weights = {
        "w1": rand(m, c, 1, 3, 3, scale=0.1),
        "b1": rand(m),
        "w2": rand(c, m, 3, 1, 1, scale=0.1),
    }
    return make_model(
        nodes,
        [("x", FLOAT, [batch, c, frames, size, size])],
        [("y", FLOAT, [batch, c, out_frames, size, size])],
        weights,
    )


@pytest.mark.parametrize(
    ("size", "batch", "algorithm"),
    [(24, 1, "winograd4"), (8, 2, "winograd2"), (13, 1, "winograd4"), (11, 1, "winograd2")],
)
def test_a_conv_of_frames_runs_as_winograd_over_its_frames(size, batch, algorithm):
    """A (1, 3, 3) conv of 3-D data is a 2-D conv of each frame: its Winograd stages take the
    frames as a batch (frame d of image n at n * D + d) and write NCDHW[b]c; it matches ORT
    (partial tiles on 13 x 13 and 11 x 11, two images of three frames on 8 x 8)."""
    model = frames_chain(32, 48, 3, size, batch)
    graph = optimize(import_model(model), target=host_target())
    spatial = next(n for n in graph.nodes if n.name.startswith("spatial"))
    assert spatial.attr("data_layout")[-1] == "c"
    (index, group), *_ = [
        (k, g) for k, g in enumerate(graph.groups) if any("spatial" in n for n in g.nodes)
    ]
    lowered = lower_group(graph, group, index, host_target())
    (gemm,) = [s for s in lowered.stages if s.note("winograd")]
    assert gemm.note("algorithm") == algorithm
    assert gemm.shape[0] == batch * 3  # the frames are the GEMM's batch
    feeds = {"x": rand(batch, 32, 3, size, size)}
    module = load(compiler_core.compile(model))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = session.run(["y"], feeds)[0]
    assert_close_to_scale(module.run(feeds)["y"], expected, label=f"{size} x {size}")


def test_a_3d_conv_padded_or_strided_along_depth_stays_direct():
    """Only a conv of frames (one tap, stride 1, no padding along depth) runs as Winograd."""
    from compiler_core.kernels.winograd import spatial_algorithms

    frames = spatial_algorithms((1, 3, 3), (1, 1, 1), (1, 1, 1), (0, 1, 1, 0, 1, 1), 1, 64, 64)
    assert frames == ("direct", "winograd2", "winograd4")
    padded = spatial_algorithms((1, 3, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1, 1, 1, 1), 1, 64, 64)
    strided = spatial_algorithms((1, 3, 3), (2, 1, 1), (1, 1, 1), (0, 1, 1, 0, 1, 1), 1, 64, 64)
    cube = spatial_algorithms((3, 3, 3), (1, 1, 1), (1, 1, 1), (1,) * 6, 1, 64, 64)
    assert padded == strided == cube == ("direct",)
