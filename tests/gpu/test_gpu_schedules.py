"""GPU schedule primitives, templates and the device-kernel checks.

Schedules without barriers run on the loop-IR interpreter (bound loops run one after
another) and must match the unscheduled function; schedules with barriers are run through
their OpenCL twin in test_twin.py. Every check of `gpu/verify.py` rejects what it is for, with
the numbers named."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from compiler_core import te
from compiler_core.gpu.kernels import device_kernels
from compiler_core.gpu.launch import launch_dims
from compiler_core.gpu.schedules import (
    TEMPLATES,
    conv_records,
    default_config,
    dense_records,
    elementwise_records,
    gpu_schedule_for,
    row_records,
    template_for,
)
from compiler_core.gpu.verify import GpuScheduleError, verify_device
from compiler_core.kernels.schedules import StageInfo
from compiler_core.loop import interpreter
from compiler_core.loop.ir import Barrier, Binary, Block, Const, For, IfThenElse
from compiler_core.loop.transform import map_stmt, replace_stmt, walk_stmts
from compiler_core.schedule.primitives import (
    Bind,
    CacheRead,
    CrossThreadReduce,
    ScheduleError,
    Split,
    apply,
    from_json,
    to_json,
)
from compiler_core.target import parse_target

SM90 = parse_target("cuda -arch=sm_90")
RNG = np.random.default_rng(0)


def panel_gemm(m=16, n=64, k=32, panel=32):
    """c[m, n] = a[m, k] @ b, with b packed as [n / panel, k, panel] (as the builders do)."""
    a = te.placeholder((m, k), "float32", "a")
    bp = te.placeholder((n // panel, k, panel), "float32", "bp")
    kk = te.reduce_axis(k, "rk")
    c = te.compute(
        (m, n), lambda i, j: te.reduce_sum(a[i, kk] * bp[j // panel, kk, j % panel], kk), "c"
    )
    func = te.lower([a, bp], [c], "gemm")
    stage = StageInfo(
        "c",
        (m, n),
        (("c_rk", k),),
        True,
        "MatMul",
        (),
        (("panel", panel), ("operands", ("a", "bp"))),
    )
    return func, stage


def row_sum(rows=6, length=200):
    x = te.placeholder((rows, length), "float32", "x")
    r = te.reduce_axis(length, "r")
    s = te.compute((rows,), lambda i: te.reduce_sum(x[i, r], r), "s")
    stage = StageInfo("s", (rows,), (("s_r", length),), True, "ReduceSum", ())
    return te.lower([x], [s], "rowsum"), stage


def reference(func, arrays):
    out = {k: v.copy() for k, v in arrays.items()}
    interpreter.run(func, out)
    return out


def random_args(func):
    return {b.name: RNG.standard_normal(b.shape).astype(b.dtype) for b in func.params}


def test_elementwise_template_matches_the_unscheduled_function():
    func, stage = row_sum(rows=37, length=5)
    records = elementwise_records(stage, None, {"threads": 16})
    scheduled = verify_device(apply(func, records), SM90)
    assert launch_dims(scheduled) == ((3, 1, 1), (16, 1, 1))  # 37 rows: a guarded last block
    args = random_args(func)
    np.testing.assert_allclose(reference(scheduled, args)["s"], reference(func, args)["s"], 1e-6)


def test_conv_template_register_tile_matches():
    x = te.placeholder((1, 3, 9, 9), "float32", "x")
    w = te.placeholder((8, 3, 3, 3), "float32", "w")
    rc, kh, kw = te.reduce_axis(3, "rc"), te.reduce_axis(3, "rk0"), te.reduce_axis(3, "rk1")
    conv = te.compute(
        (1, 8, 7, 7),
        lambda n, o, y, z: te.reduce_sum(x[n, rc, y + kh, z + kw] * w[o, rc, kh, kw], (rc, kh, kw)),
        "conv",
    )
    func = te.lower([x, w], [conv], "conv")
    axes = (("conv_rc", 3), ("conv_rk0", 3), ("conv_rk1", 3))
    stage = StageInfo("conv", (1, 8, 7, 7), axes, True, "Conv", ())
    args = random_args(func)
    expected = reference(func, args)["conv"]
    for config in (
        {"threads": 32, "tile_axis": "channel", "tile": 4},
        {"threads": 64, "tile_axis": "width", "tile": 7},
    ):
        scheduled = verify_device(apply(func, conv_records(stage, None, config)), SM90)
        np.testing.assert_allclose(reference(scheduled, args)["conv"], expected, rtol=1e-5)


def test_dense_template_stages_both_operands_and_passes_every_check():
    func, stage = panel_gemm()
    config = default_config(TEMPLATES["gpu_dense"], stage, SM90)
    scheduled = verify_device(apply(func, dense_records(stage, None, config)), SM90)
    shared = [
        s.buffer
        for s in walk_stmts(scheduled.body)
        if s.__class__.__name__ == "Allocate" and s.buffer.scope == "shared"
    ]
    assert {b.name.split("_shared")[0] for b in shared} == {"a", "bp"}
    barriers = sum(isinstance(s, Barrier) for s in walk_stmts(scheduled.body))
    assert barriers == 2  # both copies before one barrier; one barrier after the compute
    grid, block = launch_dims(scheduled)
    assert grid[0] == 2 and block[0] == 32  # a block per panel, a thread per panel column


def test_a_one_row_gemm_folds_each_dot_product_with_a_block_of_threads():
    # A batch-1 dense layer: the tiled template would give 2 blocks of 32 threads, each
    # thread walking all of K alone; a block per output folds K with all of its threads.
    func, stage = panel_gemm(m=1, n=64, k=256)
    template = template_for(stage, SM90)
    assert template.name == "gpu_row_reduction"
    records = template.schedule(stage, None, default_config(template, stage, SM90), SM90)
    grid, block = launch_dims(verify_device(apply(func, records), SM90))
    assert grid[0] == 64 and block[0] == 256
    assert template_for(panel_gemm(m=16)[1], SM90).name == "gpu_dense"  # rows to tile


def test_a_dense_conv_default_tile_leaves_the_grid_enough_threads():
    def conv_stage(channels, size, inputs):
        axes = (("c_rc", inputs), ("c_rk0", 3), ("c_rk1", 3))
        return StageInfo("c", (1, channels, size, size), axes, True, "Conv", ())

    gpu_conv = TEMPLATES["gpu_conv"]
    tile = {
        (channels, size): default_config(gpu_conv, conv_stage(channels, size, 64), SM90)["tile"]
        for channels, size in ((64, 112), (64, 56), (256, 14))
    }
    # 802816 outputs: 8 channels a thread; 200704: 2; 50176: one
    assert tile == {(64, 112): 8, (64, 56): 2, (256, 14): 1}


def without_barriers(func):
    return dataclasses.replace(
        func,
        body=map_stmt(func.body, stmt_fn=lambda s: Block(()) if isinstance(s, Barrier) else None),
    )


def test_planted_race_is_rejected():
    """The dense kernel with its barriers removed: threads read tiles others write."""
    func, stage = panel_gemm()
    config = default_config(TEMPLATES["gpu_dense"], stage, SM90)
    racy = without_barriers(apply(func, dense_records(stage, None, config)))
    with pytest.raises(GpuScheduleError) as err:
        verify_device(racy, SM90)
    assert err.value.check == "shared_races"
    assert "no barrier between" in str(err.value)


def test_row_reduction_tree_without_barriers_is_a_race():
    func, stage = row_sum()
    scheduled = apply(func, row_records(stage, None, {"threads": 64}))
    verify_device(scheduled, SM90)
    with pytest.raises(GpuScheduleError, match="shared_races"):
        verify_device(without_barriers(scheduled), SM90)


def test_shared_memory_over_the_limit_names_the_numbers():
    func, stage = panel_gemm(m=64, n=64, k=4096, panel=32)
    config = {"block_m": 64, "thread_m": 8, "thread_n": 1, "block_k": 4096}
    scheduled = apply(func, dense_records(stage, None, config))
    with pytest.raises(GpuScheduleError) as err:
        verify_device(scheduled, SM90)
    assert err.value.check == "launch_fits"
    # A: 64 x 4096 floats, B: 4096 x 32 floats
    assert f"{4 * (64 * 4096 + 4096 * 32)} bytes of shared memory" in str(err.value)
    assert "limit of 49152" in str(err.value)


def test_too_many_threads_per_block_names_the_numbers():
    func, stage = row_sum(rows=4096, length=3)
    scheduled = apply(func, elementwise_records(stage, None, {"threads": 2048}))
    with pytest.raises(
        GpuScheduleError, match="2048 threads per block .* exceed the limit of 1024"
    ):
        verify_device(scheduled, SM90)


def test_barrier_under_a_thread_condition_is_rejected():
    func, _ = row_sum(rows=4, length=100)
    scheduled = apply(func, [CrossThreadReduce("s", 64)])
    thread = next(
        s for s in walk_stmts(scheduled.body) if isinstance(s, For) and s.binding == "threadIdx.x"
    )
    guarded = dataclasses.replace(
        thread, body=IfThenElse(Binary("lt", thread.var, Const(32, "int64")), thread.body)
    )
    bad = dataclasses.replace(scheduled, body=replace_stmt(scheduled.body, thread, guarded))
    with pytest.raises(GpuScheduleError, match="barriers_uniform"):
        verify_device(bad, SM90)


def test_bind_refuses_what_a_gpu_cannot_run():
    func, _ = row_sum(rows=8, length=4)
    with pytest.raises(ScheduleError, match="a reduction loop"):
        apply(func, [Bind("s_r", "threadIdx.x")])
    with pytest.raises(ScheduleError, match="unknown binding"):
        apply(func, [Bind("s_i0", "warpIdx.x")])
    split = apply(func, [Split("s_i0", 4), Bind("s_i0_i", "threadIdx.x")])
    with pytest.raises(ScheduleError, match="block binding cannot sit inside a thread binding"):
        apply(split, [Bind("s_r", "blockIdx.x")])
    with pytest.raises(ScheduleError, match="already bound"):
        apply(split, [Bind("s_i0_o", "threadIdx.x")])


def test_cache_read_refuses_a_loop_outside_the_blocks():
    func, stage = panel_gemm()
    with pytest.raises(ScheduleError, match="not inside a block binding"):
        apply(func, [CacheRead("a", "c_rk")])


def test_gpu_records_round_trip_through_json():
    func, stage = panel_gemm()
    records = dense_records(stage, None, default_config(TEMPLATES["gpu_dense"], stage, SM90))
    records.append(CrossThreadReduce("other", 128))
    assert from_json(to_json(records)) == records


def test_device_kernels_split_stages_into_launches_with_scratch():
    x = te.placeholder((4, 100), "float32", "x")
    r = te.reduce_axis(100, "r")
    total = te.compute((4,), lambda i: te.reduce_sum(x[i, r], r), "total")
    out = te.compute((4, 100), lambda i, j: x[i, j] / total[i], "out")
    func = te.lower([x], [out], "norm")
    stages = [
        StageInfo("total", (4,), (("total_r", 100),), False, "ReduceSum", ()),
        StageInfo("out", (4, 100), (), True, "Div", ("total",)),
    ]
    scheduled = apply(func, gpu_schedule_for(stages, SM90, func=func))
    kernels, scratch = device_kernels(scheduled)
    assert [k.args for k in kernels] == [
        (("param", 0), ("scratch", "total")),
        (("param", 0), ("param", 1), ("scratch", "total")),
    ]
    assert [b.name for b in scratch] == ["total"] and scratch[0].scope == "global"
    for kernel in kernels:
        verify_device(kernel.func, SM90)


def test_a_single_element_stage_runs_as_a_one_thread_kernel():
    x = te.placeholder((5,), "float32", "x")
    r = te.reduce_axis(5, "r")
    total = te.compute((), lambda: te.reduce_sum(x[r], r), "total")
    func = te.lower([x], [total], "scalar")
    (kernel,), _ = device_kernels(func)
    assert launch_dims(kernel.func) == ((1, 1, 1), (1, 1, 1))
    args = {"x": RNG.standard_normal(5).astype("float32"), "total": np.zeros((), "float32")}
    got = reference(verify_device(kernel.func, SM90), args)["total"]
    np.testing.assert_allclose(got, args["x"].sum(), rtol=1e-6)
