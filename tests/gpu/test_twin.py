"""GPU schedules that synchronise (shared memory, barriers) checked on PoCL through their
OpenCL twin against the unscheduled function on the loop-IR interpreter, over a spread of
template points; and the renderer's arithmetic against the interpreter, operator by
operator."""

from __future__ import annotations

import numpy as np
import pytest

from compiler_core import te
from compiler_core.codegen.opencl import render_opencl
from compiler_core.gpu.launch import launch_dims
from compiler_core.gpu.schedules import (
    dense_records,
    elementwise_records,
    gpu_schedule_for,
    row_records,
)
from compiler_core.gpu.verify import verify_device
from compiler_core.kernels.schedules import StageInfo
from compiler_core.loop import interpreter
from compiler_core.loop.ir import ARITHMETIC, UNARY_OPS, Binary, Cast, Const, Select, Unary
from compiler_core.runtime.opencl import OpenCLBackend, opencl_available
from compiler_core.schedule.primitives import apply
from compiler_core.target import parse_target

pytestmark = pytest.mark.skipif(
    not opencl_available()[0], reason=f"no OpenCL device: {opencl_available()[1]}"
)
SM90 = parse_target("cuda -arch=sm_90")


def run_twin(func, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run one device kernel on the OpenCL device: every parameter in, every one back."""
    backend = OpenCLBackend()
    backend.load({"kernels.cl": render_opencl([func]).encode()})
    buffers = {}
    for param in func.params:
        array = np.ascontiguousarray(arrays[param.name], dtype=param.dtype)
        buffers[param.name] = backend.alloc(max(array.nbytes, 1))
        backend.upload(buffers[param.name], array)
    grid, block = launch_dims(func)
    backend.launch(backend.function(func.name), grid, block, [buffers[p.name] for p in func.params])
    backend.synchronize()
    out = {}
    for param in func.params:
        out[param.name] = np.empty(param.shape, param.dtype)
        backend.download(buffers[param.name], out[param.name])
    return out


def reference(func, arrays):
    out = {k: v.copy() for k, v in arrays.items()}
    interpreter.run(func, out)
    return out


def inputs_for(func, seed=0):
    rng = np.random.default_rng(seed)
    return {b.name: rng.standard_normal(b.shape).astype(b.dtype) for b in func.params}


def batched_panel_gemm(batch, m, n, k, panel=32):
    a = te.placeholder((batch, m, k), "float32", "a")
    bp = te.placeholder((batch, n // panel, k, panel), "float32", "bp")
    kk = te.reduce_axis(k, "rk")
    c = te.compute(
        (batch, m, n),
        lambda z, i, j: te.reduce_sum(a[z, i, kk] * bp[z, j // panel, kk, j % panel], kk),
        "c",
    )
    func = te.lower([a, bp], [c], "bgemm")
    notes = (("panel", panel), ("operands", ("a", "bp")))
    stage = StageInfo("c", (batch, m, n), (("c_rk", k),), True, "MatMul", (), notes)
    return func, stage


@pytest.mark.parametrize(
    "config",
    [
        {"block_m": 8, "thread_m": 2, "thread_n": 1, "block_k": 4},
        {"block_m": 16, "thread_m": 4, "thread_n": 2, "block_k": 8},
        {"block_m": 4, "thread_m": 1, "thread_n": 4, "block_k": 16},
    ],
)
def test_dense_template_through_shared_memory_matches(config):
    func, stage = batched_panel_gemm(batch=2, m=16, n=64, k=48)
    scheduled = verify_device(apply(func, dense_records(stage, None, config)), SM90)
    args = inputs_for(func)
    got = run_twin(scheduled, args)["c"]
    np.testing.assert_allclose(got, reference(func, args)["c"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("combiner", ["sum", "max", "min"])
@pytest.mark.parametrize(("length", "threads"), [(200, 64), (1000, 256), (37, 32)])
def test_cross_thread_reduction_matches(combiner, length, threads):
    reduce = {"sum": te.reduce_sum, "max": te.reduce_max, "min": te.reduce_min}[combiner]
    x = te.placeholder((5, length), "float32", "x")
    r = te.reduce_axis(length, "r")
    s = te.compute((5,), lambda i: reduce(x[i, r], r), "s")
    func = te.lower([x], [s], "rows")
    stage = StageInfo("s", (5,), (("s_r", length),), True, "Reduce", ())
    scheduled = verify_device(apply(func, row_records(stage, None, {"threads": threads})), SM90)
    args = inputs_for(func, seed=length)
    got = run_twin(scheduled, args)["s"]
    np.testing.assert_allclose(got, reference(func, args)["s"], rtol=1e-5, atol=1e-5)


def test_cross_thread_reduction_over_two_axes_with_an_epilogue():
    x = te.placeholder((3, 7, 30), "float32", "x")
    r1, r2 = te.reduce_axis(7, "r1"), te.reduce_axis(30, "r2")
    total = te.compute((3,), lambda i: te.reduce_sum(x[i, r1, r2], (r1, r2)), "total")
    mean = te.compute((3,), lambda i: total[i] * (1.0 / 210), "mean")
    func = te.lower([x], [mean], "mean")
    stage = StageInfo("total", (3,), (("total_r1", 7), ("total_r2", 30)), False, "ReduceMean", ())
    epilogue = StageInfo("mean", (3,), (), True, "ReduceMean", ("total",))
    scheduled = verify_device(apply(func, row_records(stage, epilogue, {"threads": 64})), SM90)
    args = inputs_for(func)
    got = run_twin(scheduled, args)["mean"]
    np.testing.assert_allclose(got, args["x"].mean(axis=(1, 2)), rtol=1e-5, atol=1e-6)


def elementwise(body, dtype="float32", out_dtype=None, shape=(97,)):
    x = te.placeholder(shape, dtype, "x")
    y = te.placeholder(shape, dtype, "y")
    out = te.compute(shape, lambda i: body(x[i], y[i]), "out", out_dtype or dtype)
    func = te.lower([x, y], [out], "ew")
    stage = StageInfo("out", shape, (), True, "Op", ())
    return func, verify_device(apply(func, elementwise_records(stage, None, {"threads": 32})), SM90)


def check(func, scheduled, args, rtol=1e-5, atol=1e-6):
    expected = reference(func, args)["out"]
    got = run_twin(scheduled, args)["out"]
    np.testing.assert_allclose(got.astype(np.float64), expected.astype(np.float64), rtol, atol)


DOMAINS = {
    "acosh": (1.1, 4.0),
    "atanh": (-0.9, 0.9),
    "asin": (-0.9, 0.9),
    "acos": (-0.9, 0.9),
    "log": (0.1, 5.0),
    "sqrt": (0.1, 5.0),
    "rsqrt": (0.1, 5.0),
}


@pytest.mark.parametrize("op", [op for op in UNARY_OPS if op != "not"])
def test_every_unary_operator_means_what_the_interpreter_computes(op):
    func, scheduled = elementwise(lambda a, b: Unary(op, a))
    low, high = DOMAINS.get(op, (-3.0, 3.0))
    rng = np.random.default_rng(1)
    args = {
        "x": rng.uniform(low, high, 97).astype(np.float32),
        "y": np.zeros(97, np.float32),
        "out": np.zeros(97, np.float32),
    }
    if op == "round":
        args["x"][:8] = [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, -3.5]  # half to even
    check(func, scheduled, args, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize(
    "op", ["add", "sub", "mul", "div", "floordiv", "mod", "min", "max", "pow", "fmod"]
)
def test_float_binary_operators(op):
    func, scheduled = elementwise(lambda a, b: Binary(op, a, b))
    rng = np.random.default_rng(2)
    y = rng.uniform(0.5, 2.0, 97).astype(np.float32) * rng.choice([-1, 1], 97)
    x = rng.uniform(0.5, 3.0, 97).astype(np.float32) if op == "pow" else rng.standard_normal(97)
    y = np.abs(y) if op == "pow" else y
    args = {"x": x.astype(np.float32), "y": y.astype(np.float32), "out": np.zeros(97, np.float32)}
    check(func, scheduled, args, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", [op for op in ARITHMETIC if op not in ("fmod", "pow")])
def test_integer_binary_operators_with_negative_operands(op):
    func, scheduled = elementwise(lambda a, b: Binary(op, a, b), dtype="int64")
    rng = np.random.default_rng(3)
    x = rng.integers(-50, 50, 97)
    y = rng.integers(1, 7, 97) * (rng.choice([-1, 1], 97) if op not in ("shl", "shr") else 1)
    args = {"x": x, "y": y, "out": np.zeros(97, np.int64)}
    check(func, scheduled, args, rtol=0, atol=0)


def test_casts_to_integers_bools_and_bytes_and_back():
    x = te.placeholder((64,), "float32", "x")
    out_int = te.compute((64,), lambda i: Cast("int32", x[i] * 10.0), "as_int")
    out_bool = te.compute((64,), lambda i: Cast("bool", Cast("int32", x[i] * 2.0)), "as_bool")
    out_u8 = te.compute((64,), lambda i: Cast("uint8", Cast("int32", x[i] * 4.0 + 100.0)), "as_u8")
    back = te.compute(
        (64,), lambda i: Cast("float32", out_bool[i]) + Cast("float32", out_u8[i]), "back"
    )
    funcs = []
    rng = np.random.default_rng(4)
    for tensor, name in ((out_int, "as_int"), (out_bool, "as_bool"), (out_u8, "as_u8")):
        func = te.lower([x], [tensor], f"cast_{name}")
        stage = StageInfo(name, (64,), (), True, "Cast", ())
        scheduled = verify_device(
            apply(func, elementwise_records(stage, None, {"threads": 32})), SM90
        )
        args = {"x": rng.standard_normal(64).astype(np.float32), name: np.zeros(64, tensor.dtype)}
        np.testing.assert_array_equal(run_twin(scheduled, args)[name], reference(func, args)[name])
        funcs.append(func)
    func = te.lower([x], [back], "roundtrip")
    stages = [
        StageInfo("as_bool", (64,), (), False, "Cast", ()),
        StageInfo("as_u8", (64,), (), False, "Cast", ()),
        StageInfo("back", (64,), (), True, "Add", ("as_bool", "as_u8")),
    ]
    scheduled = verify_device(apply(func, gpu_schedule_for(stages, SM90, func=func)), SM90)
    args = {"x": rng.standard_normal(64).astype(np.float32), "back": np.zeros(64, np.float32)}
    np.testing.assert_array_equal(run_twin(scheduled, args)["back"], reference(func, args)["back"])


def test_select_of_a_comparison():
    func, scheduled = elementwise(lambda a, b: Select(Binary("gt", a, b), a * 2.0, b - 1.0))
    rng = np.random.default_rng(6)
    args = {
        "x": rng.standard_normal(97).astype(np.float32),
        "y": rng.standard_normal(97).astype(np.float32),
        "out": np.zeros(97, np.float32),
    }
    check(func, scheduled, args)


def test_float16_buffers_load_and_store_with_rounding():
    x = te.placeholder((50,), "float16", "x")
    out = te.compute((50,), lambda i: x[i] * Const(3.0, "float16") + x[i], "out", "float16")
    func = te.lower([x], [out], "half")
    stage = StageInfo("out", (50,), (), True, "Mul", ())
    scheduled = verify_device(apply(func, elementwise_records(stage, None, {"threads": 32})), SM90)
    args = {
        "x": np.random.default_rng(5).standard_normal(50).astype(np.float16),
        "out": np.zeros(50, np.float16),
    }
    got = run_twin(scheduled, args)["out"].astype(np.float32)
    np.testing.assert_allclose(
        got, (args["x"].astype(np.float32) * 4).astype(np.float16).astype(np.float32), rtol=2e-3
    )
