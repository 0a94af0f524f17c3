"""Native code from the LLVM renderer against the loop-IR interpreter (the oracle)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from compiler_core import te
from compiler_core.codegen import native
from compiler_core.codegen.llvm import build_module
from compiler_core.codegen.native import emit_assembly, emit_object, link_shared
from compiler_core.loop import interpreter
from compiler_core.loop.ir import (
    Binary,
    Buffer,
    Cast,
    Const,
    For,
    Load,
    PrimFunc,
    Select,
    Store,
    Unary,
    Var,
    maximum,
)
from compiler_core.runtime.library import KernelLibrary, set_num_threads
from compiler_core.schedule.primitives import (
    CacheWrite,
    ComputeAt,
    ComputeInline,
    Fuse,
    Parallel,
    Reorder,
    ReverseComputeInline,
    ScheduleError,
    Split,
    Unroll,
    Vectorize,
    apply,
)
from compiler_core.target import host_target, parse_target
from tests.loop.test_schedule import BASE, _random_schedule

TARGET = host_target()


def compile_funcs(funcs: list[PrimFunc], tmp_path) -> KernelLibrary:
    obj = emit_object(build_module(funcs, TARGET), TARGET)
    return KernelLibrary(link_shared([obj], tmp_path / "kernels.so"))


def random_args(func: PrimFunc, seed=0):
    rng = np.random.default_rng(seed)
    args = {}
    for buf in func.params:
        if buf.dtype == "bool":
            args[buf.name] = rng.integers(0, 2, buf.shape).astype(bool)
        elif np.dtype(buf.dtype).kind in "iu":
            args[buf.name] = rng.integers(-20, 20, buf.shape).astype(buf.dtype)
        else:
            args[buf.name] = rng.standard_normal(buf.shape).astype(buf.dtype)
    return args


def assert_native_matches_interpreter(funcs, tmp_path, rtol=1e-5, atol=1e-5, lib=None):
    lib = lib or compile_funcs(funcs, tmp_path)
    for func in funcs:
        expected = random_args(func)
        actual = {k: v.copy() for k, v in expected.items()}
        interpreter.run(func, expected)
        lib.call(func.name, [actual[b.name] for b in func.params])
        for buf in func.params:
            np.testing.assert_allclose(
                actual[buf.name], expected[buf.name], rtol=rtol, atol=atol, err_msg=func.name
            )


SCHEDULES = {
    "naive": [],
    "tail_split": [Split("c_i0", 4)],
    "vector": [Split("c_i1", 4), Reorder(("c_kk", "c_i1_i")), Vectorize("c_i1_i")],
    "fused_parallel": [Fuse("d_i0", "d_i1"), Parallel("d_i0_d_i1_f")],
    "unrolled": [Unroll("c_kk")],
    "inline_at": [ComputeInline("e"), ComputeAt("c", "d_i0"), Split("c_i1_at", 4)],
    "register_tile": [
        Split("c_i0", 2),
        Split("c_i1", 8),
        Reorder(("c_i0_o", "c_i1_o", "c_kk", "c_i0_i", "c_i1_i")),
        CacheWrite("c", "c_kk"),
        Vectorize("c_i1_i"),
        Unroll("c_i0_i"),
        ComputeInline("e"),
        Parallel("c_i0_o"),
    ],
}


def test_every_primitive_compiles_to_matching_native_code(tmp_path):
    funcs = [
        PrimFunc(f"gemm_{name}", BASE.params, apply(BASE, schedule).body)
        for name, schedule in SCHEDULES.items()
    ]
    set_num_threads(2)
    assert_native_matches_interpreter(funcs, tmp_path)


def test_random_schedules_compile_to_matching_native_code(tmp_path):
    funcs = []
    for seed in range(8):
        scheduled = apply(BASE, _random_schedule(random.Random(100 + seed)))
        funcs.append(PrimFunc(f"gemm_random{seed}", BASE.params, scheduled.body))
    assert_native_matches_interpreter(funcs, tmp_path)


def elementwise_kernels():
    x = te.placeholder((4, 16), "float32", "x")
    n = te.placeholder((4, 16), "int64", "n")
    kernels = {
        "math": lambda i, j: (
            Unary("exp", x[i, j] * 0.5)
            + Unary("tanh", x[i, j])
            + Unary("erf", x[i, j])
            + Unary("sigmoid", x[i, j])
            + Unary("sqrt", Unary("abs", x[i, j]))
        ),
        "select": lambda i, j: Select(x[i, j] > 0.0, x[i, j], x[i, j] * 0.1),
        "minmax": lambda i, j: maximum(x[i, j], Const(-0.5, "float32")),
        "cast": lambda i, j: Cast("float32", n[i, j]) + x[i, j],
        "transpose_read": lambda i, j: x[(i + j) % 4, 15 - j],
        "floordiv": lambda i, j: Cast(
            "float32", Binary("floordiv", n[i, j], Const(3, "int64")) + n[i, j] % 5
        ),
        # An address that is the same in every lane but reads memory (a sequence length):
        # it must stay one scalar address, not a vector of splat ones.
        "lane_invariant_indirect": lambda i, j: x[n[i, 0] % 4, i] + x[i, j],
    }
    funcs = []
    for name, body in kernels.items():
        out = te.compute((4, 16), body, "out")
        func = te.lower([x, n], [out], name)
        funcs.append(apply(func, [Vectorize("out_i1")]))
        funcs.append(PrimFunc(f"{name}_scalar", func.params, func.body))
    return funcs


def test_math_casts_and_gathers_in_vector_and_scalar_form(tmp_path):
    assert_native_matches_interpreter(elementwise_kernels(), tmp_path, rtol=2e-5, atol=1e-5)


def test_kernels_built_by_helper_processes_match_the_interpreter(tmp_path):
    """compile_kernels hands every other kernel to a helper process: the objects it returns
    come back in order and link into one library that computes what the interpreter does."""
    funcs = elementwise_kernels()
    assert len(funcs) >= native.PARALLEL_MIN_KERNELS
    objects = native.compile_kernels(funcs, TARGET, workers=2)
    assert len(objects) == len(funcs) and all(objects)
    library = KernelLibrary(link_shared(objects, tmp_path / "parallel.so"))
    assert_native_matches_interpreter(funcs, tmp_path, rtol=2e-5, atol=1e-5, lib=library)


def test_vector_loop_emits_512_bit_fma_on_avx512_hosts():
    if TARGET.vector_bits < 512:
        pytest.skip("host has no AVX-512")
    scheduled = apply(
        BASE,
        [Split("c_i1", 8), Reorder(("c_kk", "c_i1_i")), Vectorize("c_i1_i")],
    )
    assembly = emit_assembly(build_module([scheduled], TARGET), TARGET)
    assert "vfmadd" in assembly


def unary_kernel(size: int, lanes: int, op: str = "exp", dtype: str = "float32") -> PrimFunc:
    x = te.placeholder((size,), dtype, "x")
    out = te.compute((size,), lambda i: Unary(op, x[i]), "out")
    func = te.lower([x], [out], f"vector_{op}")
    return apply(func, [Split("out_i0", lanes), Vectorize("out_i0_i")])


def run_unary(op: str, x: np.ndarray, tmp_path, target=TARGET) -> np.ndarray:
    """`op` over x (float32, a multiple of 16 long) as vector code for `target`, run here."""
    func = unary_kernel(x.size, target.vector_lanes, op)
    obj = emit_object(build_module([func], target), target)
    library = KernelLibrary(link_shared([obj], tmp_path / f"{op}.so"))
    y = np.empty_like(x)
    library.call(f"vector_{op}", [x, y])
    return y


@pytest.mark.parametrize("op", ["sin", "cos"])
def test_vector_sine_is_within_2e7_inline_and_exact_past_its_limit(op, tmp_path):
    """sin and cos inline against float64 up to |x| = 2^21 (densely near 0, where sin is
    small, relative there), and vectors with a lane past the limit, an inf or a NaN, which
    take libm's sinf / cosf: the same values as numpy's float32 ones."""
    limit = 2.0**21
    inline = np.concatenate(
        [np.linspace(-limit, limit, 1 << 20), np.linspace(-7.0, 7.0, 1 << 16), [0.0, -0.0]]
    ).astype(np.float32)
    inline = np.resize(inline, -(-inline.size // 16) * 16)
    far = np.float32([3e6, -1e9, 3e38, np.inf, -np.inf, np.nan, 1.0, 2.0] * 2)
    x = np.concatenate([inline, far])
    y = run_unary(op, x, tmp_path)
    with np.errstate(invalid="ignore"):  # sin and cos of inf are NaN
        exact = getattr(np, op)(x.astype(np.float64))
        libm = getattr(np, op)(x[inline.size :])
    n = inline.size
    assert np.abs(y[:n] - exact[:n]).max() <= 2e-7
    small = np.abs(x[:n]) < 0.5
    relative = np.abs(y[:n][small] - exact[:n][small]) / np.maximum(np.abs(exact[:n][small]), 1e-30)
    assert relative.max() <= 3e-7
    if op == "sin":
        assert np.all(np.signbit(y[:n][x[:n] == 0]) == np.signbit(x[:n][x[:n] == 0]))
    np.testing.assert_allclose(y[n:], libm, rtol=1e-6, atol=1e-7)


def test_vector_tanh_is_relatively_exact_near_zero_and_within_an_ulp_of_one_beyond(tmp_path):
    """Near 0 tanh x ~ x must hold to a few ulps (1 - 2/(e^2x + 1) alone was hundreds off
    there); further out, within 2e-7 of float64; tanh(+-0) = +-0, +-inf -> +-1, NaN kept."""
    near = np.concatenate([np.geomspace(1e-30, 0.6, 1 << 16), -np.geomspace(1e-30, 0.6, 1 << 16)])
    far = np.linspace(-20.0, 20.0, 1 << 18)
    specials = [0.0, -0.0, np.inf, -np.inf, np.nan, 0.55, -0.55, 1.0]
    x = np.concatenate([near, far, specials]).astype(np.float32)
    x = np.resize(x, -(-x.size // 16) * 16)
    y = run_unary("tanh", x, tmp_path)
    expected = np.tanh(x.astype(np.float64))
    small = np.abs(x) < 0.6
    ulps = np.abs(y - expected)[small] / np.spacing(np.abs(expected[small]).astype(np.float32))
    assert ulps.max() <= 4, x[small][ulps.argmax()]
    finite = np.isfinite(x)
    assert np.abs(y - expected)[finite].max() <= 2e-7
    zeros = x == 0
    assert np.all(y[zeros] == 0) and np.all(np.signbit(y[zeros]) == np.signbit(x[zeros]))
    assert np.all(y[np.isinf(x)] == np.sign(x[np.isinf(x)])) and np.all(np.isnan(y[np.isnan(x)]))


def test_vector_erf_is_relatively_exact_near_zero_and_within_2e7_beyond(tmp_path):
    """Near 0 erf x ~ 1.13 x must hold to a few ulps (Abramowitz & Stegun's absolute 1.5e-7
    was thousands of ulps there); beyond, its 1.5e-7 and float32 rounding; erf(+-0) = +-0."""
    import scipy.special

    near = np.concatenate([np.geomspace(1e-30, 0.6, 1 << 16), -np.geomspace(1e-30, 0.6, 1 << 16)])
    far = np.linspace(-8.0, 8.0, 1 << 18)
    x = np.concatenate([near, far, [0.0, -0.0, np.inf, -np.inf, 0.5, -0.5, 1.0, 2.0]])
    x = np.resize(x.astype(np.float32), -(-x.size // 16) * 16)
    y = run_unary("erf", x, tmp_path)
    expected = scipy.special.erf(x.astype(np.float64))
    small = np.abs(x) < 0.5
    ulps = np.abs(y - expected)[small] / np.spacing(np.abs(expected[small]).astype(np.float32))
    assert ulps.max() <= 3, x[small][ulps.argmax()]
    assert np.abs(y - expected).max() <= 4e-7
    zeros = x == 0
    assert np.all(y[zeros] == 0) and np.all(np.signbit(y[zeros]) == np.signbit(x[zeros]))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("op", ["exp", "log", "sin", "tanh", "erf", "sigmoid"])
def test_16_bit_math_renders_inline_with_no_call(op, dtype):
    """16-bit lanes take the float32 expansions (widened and rounded back), not a libm call
    per lane; sin's far-lane branch is the one call it keeps."""
    func = unary_kernel(64, TARGET.vector_lanes, op, dtype)
    assembly = emit_assembly(build_module([func], TARGET), TARGET)
    calls = [line for line in assembly.splitlines() if "call" in line and "sin" not in line]
    assert not calls


def test_vector_log_is_within_two_ulps_and_keeps_ieee_specials(tmp_path):
    """The inline log against float64 from the smallest subnormal to FLT_MAX (and densely
    around 1, where ln x is small), and ln of 0, inf, negatives and NaN as IEEE has them."""
    tiny = np.finfo(np.float32).smallest_subnormal
    spread = np.geomspace(tiny, np.finfo(np.float32).max, 1 << 20).astype(np.float32)
    near_one = np.linspace(0.5, 2.0, 1 << 18, dtype=np.float32)
    specials = np.float32([0.0, -0.0, np.inf, -1.0, -np.inf, np.nan, 1.0, tiny])
    x = np.concatenate([spread, near_one, specials])
    x = np.resize(x, -(-x.size // 16) * 16)
    y = run_unary("log", x, tmp_path)
    positive = np.isfinite(x) & (x > 0)
    expected = np.log(x[positive].astype(np.float64))
    ulps = np.abs(y[positive] - expected) / np.spacing(np.abs(expected).astype(np.float32))
    assert ulps.max() <= 2, x[positive][ulps.argmax()]
    assert np.all(y[x == 0] == -np.inf) and np.all(y[x == np.inf] == np.inf)
    assert np.all(np.isnan(y[(x < 0) | np.isnan(x)]))
    assert np.all(y[x == 1] == 0)


@pytest.mark.parametrize("isa", ["host", "avx2"])
def test_vector_exp_is_within_four_ulps_from_flt_min_to_flt_max(isa, tmp_path):
    """The inline exp against float64 over every float32 exponent it returns a normal number
    for: the host's form (vscalefps with AVX-512) and the bit-built one (AVX2, which every
    x86 host here runs), which returns 0 below -86.99 instead of -87.34."""
    target = TARGET if isa == "host" else parse_target("llvm -mattr=+avx2,+fma")
    low = -87.33 if target.scales_exponents else -86.98
    whole = np.linspace(low, 88.72, 1 << 20, dtype=np.float32)
    near_zero = np.linspace(-1.0, 1.0, 1 << 16, dtype=np.float32)
    x = np.concatenate([whole, near_zero, np.float32([0.0, -0.0, 88.7228, low])])
    x = np.resize(x, -(-x.size // 16) * 16)
    y = run_unary("exp", x, tmp_path, target)
    expected = np.exp(x.astype(np.float64))
    ulps = np.abs(y - expected) / np.spacing(expected.astype(np.float32))
    assert ulps.max() <= 4, x[ulps.argmax()]
    assert np.all(y[x == 0] == 1.0)


@pytest.mark.parametrize(
    ("features", "lanes", "scales"),
    [("+avx2,+fma,+avx512f", 16, True), ("+avx2,+fma,+avx512f", 8, True), ("+avx2,+fma", 8, False)],
)
def test_vector_exp_scales_by_2_to_the_n_in_one_instruction_on_avx512(features, lanes, scales):
    """With AVX-512, 2^n is applied by vscalefps (its own intrinsic for a zmm vector,
    `llvm.ldexp` for others); without it, by building the exponent's bits (LLVM would call
    libm's ldexpf for every lane). Neither calls out."""
    target = parse_target(f"llvm -mattr={features}")
    assert target.scales_exponents is scales
    func = unary_kernel(64, lanes)
    assembly = emit_assembly(build_module([func], target), target)
    assert ("vscalefps" in assembly) is scales
    assert "call" not in assembly


def test_bfloat16_rounds_to_nearest_even_when_stored(tmp_path):
    """bfloat16 is carried as float32 in registers: loads widen exactly, stores round to the
    nearest bfloat16 (ties to even) and keep NaN and infinities, as ml_dtypes does."""
    import ml_dtypes

    x = te.placeholder((4, 16), "float32", "x")
    h = te.placeholder((4, 16), "bfloat16", "h")
    narrow = te.compute((4, 16), lambda i, j: Cast("bfloat16", x[i, j]), "narrow")
    wide = te.compute((4, 16), lambda i, j: Cast("float32", h[i, j]) * 2.0, "wide")
    summed = te.compute((4, 16), lambda i, j: h[i, j] + h[i, j], "summed")
    funcs = [
        apply(te.lower([x], [narrow], "narrow"), [Vectorize("narrow_i1")]),
        te.lower([h], [wide], "wide"),
        apply(te.lower([h], [summed], "summed"), [Vectorize("summed_i1")]),
    ]
    library = compile_funcs(funcs, tmp_path)
    rng = np.random.default_rng(3)
    values = rng.standard_normal((4, 16)).astype(np.float32)
    # Exact ties between two bfloat16 values, both parities, and the special values.
    values[0, :6] = [1.00390625, 1.01171875, -1.00390625, np.nan, np.inf, -np.inf]
    out = np.empty((4, 16), ml_dtypes.bfloat16)
    library.call("narrow", [values, out])
    expected = values.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(out.view(np.uint16)[:, 3:], expected.view(np.uint16)[:, 3:])
    assert np.isnan(out[0, 3].astype(np.float32))
    np.testing.assert_array_equal(out[0, :3].astype(np.float32), [1.0, 1.015625, -1.0])
    doubled = np.empty((4, 16), np.float32)
    library.call("wide", [expected, doubled])
    np.testing.assert_array_equal(doubled, expected.astype(np.float32) * 2)
    library.call("summed", [expected, out])
    np.testing.assert_array_equal(out.astype(np.float32), (expected + expected).astype(np.float32))


def test_a_cropped_register_tile_stores_its_partial_lanes_masked(tmp_path):
    """A product over whole tiles (6 x 24) cropped to 5 x 21 with an epilogue reading another
    input: the crop folds into the tile's store, the last column tile stores (and reads the
    residual) under a lane mask, every other tile plainly; native matches the interpreter."""
    a = te.placeholder((5, 7), "float32", "a")
    b = te.placeholder((7, 24), "float32", "b")
    r = te.placeholder((5, 21), "float32", "r")
    kk = te.reduce_axis(7, "kk")
    row = lambda i: Binary("min", i, Const(4, "int64"))  # noqa: E731 - the padded row reads row 4
    c = te.compute((6, 24), lambda i, j: te.reduce_sum(a[row(i), kk] * b[kk, j], kk), "c")
    y = te.compute((5, 21), lambda i, j: maximum(c[i, j] + r[i, j], Const(0.0, "float32")), "y")
    func = apply(
        te.lower([a, b, r], [y], "cropped_tile"),
        [
            Split("c_i0", 3),
            Split("c_i1", 8),
            Reorder(("c_i0_o", "c_i1_o", "c_kk", "c_i0_i", "c_i1_i")),
            CacheWrite("c", "c_kk"),
            Vectorize("c_i1_i"),
            Vectorize("c_wb1"),
            Unroll("c_i0_i"),
            ReverseComputeInline("y"),
        ],
    )
    module = str(build_module([func], TARGET))
    assert "llvm.masked.store" in module and "llvm.masked.load" in module
    assert_native_matches_interpreter([func], tmp_path)


@pytest.mark.parametrize("stride", [2, 3, 4, 5])
def test_strided_lanes_load_as_one_masked_span_and_a_shuffle(stride, tmp_path):
    """A vector of lanes `stride` apart (a stride-2 window, an im2col column) is one masked
    load of their span, never past the last lane's element (the input ends right there), and
    a shuffle; wider strides are one gather."""
    lanes = TARGET.vector_lanes
    x = te.placeholder((stride * (lanes - 1) + 1,), "float32", "x")
    y = te.compute((lanes,), lambda i: x[i * Const(stride, "int64")] * 2.0, "y")
    func = apply(te.lower([x], [y], f"strided{stride}"), [Vectorize("y_i0")])
    assert_native_matches_interpreter([func], tmp_path)
    text = str(build_module([func], TARGET))
    assert ("llvm.masked.load" in text) == (stride <= 4)
    assert ("llvm.masked.gather" in text) == (stride > 4)


def _padded_row(name: str, guard_both_ends: bool):
    """y[i] = x[clamp(i - 3)] where 0 <= i - 3 < 20 (both ends guarded, the form of a padded
    read), else 0; without `guard_both_ends` only the lower end is guarded, so the clamp
    does clamp lanes past the end: they must read x's last element."""
    x = te.placeholder((20,), "float32", "x")
    last = Const(19, "int64")

    def body(i):
        s = i - Const(3, "int64")
        inside = Binary("ge", s, Const(0, "int64"))
        if guard_both_ends:
            inside = Binary("and", inside, Binary("lt", s, Const(20, "int64")))
        clamped = Binary("max", Binary("min", s, last), Const(0, "int64"))
        return Select(inside, x[clamped], Const(0.0, "float32"))

    y = te.compute((32,), body, "y")
    return apply(te.lower([x], [y], name), [Split("y_i0", 16), Vectorize("y_i0_i")])


@pytest.mark.parametrize("guard_both_ends", [True, False])
def test_a_padded_read_loads_its_live_lanes_with_one_masked_load(guard_both_ends, tmp_path):
    """Where the guard proves the clamp idle, the vector reads x at the unclamped index with
    one masked load (the lanes outside touch no memory: x ends at its 20th element); where
    it does not, each lane loads its clamped element."""
    func = _padded_row(f"padded_row_{int(guard_both_ends)}", guard_both_ends)
    text = str(build_module([func], TARGET))
    assert ("llvm.masked.load" in text) == guard_both_ends
    assert_native_matches_interpreter([func], tmp_path)


@pytest.mark.parametrize("columns", [16, 21])
def test_a_transposed_read_gathers_its_lanes_and_masks_the_tail(columns, tmp_path):
    """y = x^T, vectorized along y's rows: each vector reads a column of x (lanes a row
    apart), one gather; a last partial vector gathers only its live lanes."""
    x = te.placeholder((columns, 24), "float32", "x")
    y = te.compute((24, columns), lambda i, j: x[j, i], "y")
    split = Split("y_i1", TARGET.vector_lanes)
    func = apply(te.lower([x], [y], f"transposed{columns}"), [split, Vectorize("y_i1_i")])
    assert "llvm.masked.gather" in str(build_module([func], TARGET))
    assert_native_matches_interpreter([func], tmp_path)


def _row_fold(name: str, lanes: int, dtype: str, combine):
    """y[i] = the fold of x[i, :lanes] by `combine`, its lanes one vectorized loop (the
    initial value stored before it by CacheWrite)."""
    x = te.placeholder((3, lanes), dtype, "x")
    k = te.reduce_axis(lanes, "k")
    y = te.compute((3,), lambda i: combine(x[i, k], k), "y")
    return apply(te.lower([x], [y], name), [CacheWrite("y", "y_k"), Vectorize("y_k")])


@pytest.mark.parametrize("lanes", [16, 12, 7])
def test_a_vectorized_reduction_folds_its_lanes_as_a_tree(lanes, tmp_path):
    """A store to one element for every lane, combining it with a term of the lane (a row
    fold), means the serial loop; sums, products, maxima written as a compare-and-select
    and integer sums fold their lanes pairwise (the halves of the vector, then the odd lanes
    left over one at a time), and native code matches the interpreter."""
    funcs = [
        _row_fold(f"sum{lanes}", lanes, "float32", lambda v, k: te.reduce_sum(v * 0.5, k)),
        _row_fold(f"max{lanes}", lanes, "float32", te.reduce_max),
        _row_fold(f"min{lanes}", lanes, "float32", te.reduce_min),
        _row_fold(f"isum{lanes}", lanes, "int32", te.reduce_sum),
        _row_fold(f"prod{lanes}", lanes, "float64", lambda v, k: te.reduce_prod(v * 0.5 + 1.0, k)),
    ]
    assert_native_matches_interpreter(funcs, tmp_path)
    text = str(build_module(funcs[:1], TARGET))
    if lanes % 2 == 0:  # halved at least once: a shuffle of the term's vector
        assert "shufflevector" in text


def test_a_lane_fold_whose_combiner_does_not_reassociate_is_refused(tmp_path):
    """y = y * 0.5 + x[k]: folding the lanes in another order changes the result, so the
    loop cannot be vectorized; the same fold as a sum can, and adds to what y held."""
    x, y = Buffer("x", (8,), "float32"), Buffer("y", (1,), "float32")
    k, zero = Var("k"), (Const(0, "int64"),)
    decay = Store(y, zero, Load(y, zero) * 0.5 + Load(x, (k,)))
    with pytest.raises(ScheduleError, match="reduction loop"):
        apply(PrimFunc("decay", (x, y), For(k, 8, decay)), [Vectorize("k")])
    total = Store(y, zero, Load(y, zero) + Load(x, (k,)))
    func = apply(PrimFunc("total", (x, y), For(k, 8, total)), [Vectorize("k")])
    assert_native_matches_interpreter([func], tmp_path)
