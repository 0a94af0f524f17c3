"""Loop IR: lowering from tensor expressions, the interpreter against numpy, the verifier, the
simplifier."""

from __future__ import annotations

import numpy as np
import pytest

from compiler_core import te
from compiler_core.loop import interpreter
from compiler_core.loop.ir import INDEX, Buffer, Const, For, PrimFunc, Store, Var, maximum
from compiler_core.loop.printer import format_func
from compiler_core.loop.simplify import affine, bounds, simplify_expr
from compiler_core.loop.verify import LoopVerificationError, verify

RNG = np.random.default_rng(11)


def matmul_bias_relu(m=4, k=5, n=6):
    a = te.placeholder((m, k), "float32", "a")
    b = te.placeholder((k, n), "float32", "b")
    bias = te.placeholder((n,), "float32", "bias")
    kk = te.reduce_axis(k, "kk")
    c = te.compute((m, n), lambda i, j: te.reduce_sum(a[i, kk] * b[kk, j], kk), "c")
    d = te.compute((m, n), lambda i, j: _relu(c[i, j] + bias[j]), "d")
    return te.lower([a, b, bias], [d], "matmul_bias_relu")


def _relu(x):
    return maximum(x, Const(0.0, "float32"))


def run_matmul(func, m=4, k=5, n=6):
    a = RNG.standard_normal((m, k)).astype(np.float32)
    b = RNG.standard_normal((k, n)).astype(np.float32)
    bias = RNG.standard_normal(n).astype(np.float32)
    out = np.zeros((m, n), np.float32)
    interpreter.run(func, {"a": a, "b": b, "bias": bias, "d": out})
    return out, np.maximum(a @ b + bias, 0)


def test_lowered_matmul_matches_numpy():
    func = verify(matmul_bias_relu())
    out, expected = run_matmul(func)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_printer_shows_loops_and_stores():
    text = format_func(matmul_bias_relu())
    assert "func matmul_bias_relu(float32 a[4, 5], float32 b[5, 6], float32 bias[6]" in text
    assert "alloc workspace float32 c[4, 6]" in text
    assert "for c_kk in 0..5:" in text


def test_reduction_max_and_elementwise_chain():
    x = te.placeholder((3, 8), "float32", "x")
    k = te.reduce_axis(8, "k")
    row_max = te.compute((3,), lambda i: te.reduce_max(x[i, k], k), "row_max")
    func = verify(te.lower([x], [row_max], "row_max"))
    data = RNG.standard_normal((3, 8)).astype(np.float32)
    out = np.zeros(3, np.float32)
    interpreter.run(func, {"x": data, "row_max": out})
    np.testing.assert_array_equal(out, data.max(axis=1))


def test_interpreter_refuses_wrong_arguments():
    func = matmul_bias_relu()
    with pytest.raises(ValueError, match="no array for parameter 'b'"):
        interpreter.run(func, {"a": np.zeros((4, 5), np.float32)})
    args = {
        "a": np.zeros((4, 5), np.float32),
        "b": np.zeros((5, 6), np.float32),
        "bias": np.zeros(6, np.float64),
        "d": np.zeros((4, 6), np.float32),
    }
    with pytest.raises(ValueError, match="float64"):
        interpreter.run(func, args)


def test_verifier_catches_unbound_variable():
    out = Buffer("out", (4,), "float32")
    body = For(Var("i"), 4, Store(out, (Var("j"),), Const(1.0, "float32")))
    with pytest.raises(LoopVerificationError) as info:
        verify(PrimFunc("bad", (out,), body))
    assert info.value.check == "vars_bound"


def test_verifier_catches_wrong_rank_and_type():
    out = Buffer("out", (4, 4), "float32")
    body = For(Var("i"), 4, Store(out, (Var("i"),), Const(1.0, "float32")))
    with pytest.raises(LoopVerificationError) as info:
        verify(PrimFunc("bad", (out,), body))
    assert info.value.check == "index_ranks"
    body = For(Var("i"), 4, Store(out, (Var("i"), Var("i")), Const(1, "int64")))
    with pytest.raises(LoopVerificationError) as info:
        verify(PrimFunc("bad", (out,), body))
    assert info.value.check == "store_types"


def test_verifier_catches_unallocated_buffer():
    out = Buffer("out", (4,), "float32")
    tmp = Buffer("tmp", (4,), "float32", "local")
    body = For(Var("i"), 4, Store(out, (Var("i"),), tmp[Var("i")]))
    with pytest.raises(LoopVerificationError) as info:
        verify(PrimFunc("bad", (out,), body))
    assert info.value.check == "buffers_in_scope"


def test_simplifier_cancels_affine_terms():
    i, o = Var("i"), Var("o")
    e = (o * 2 + i) - o * 2
    assert simplify_expr(e) == i
    assert simplify_expr(i * 1 + 0) == i
    assert simplify_expr(Const(3, INDEX) * Const(4, INDEX)) == Const(12, INDEX)
    assert affine(o * 4 + i * 2 + 3) == ({"o": 4, "i": 2}, 3)
    assert affine(o * i) is None
    # Around a term that is not affine, the identities still apply.
    zero = Const(0, INDEX)
    assert simplify_expr(zero + o * i) == o * i and simplify_expr(o * i - zero) == o * i


def test_bounds_of_an_affine_index():
    o, i = Var("o"), Var("i")
    start, width = bounds(o * 4 + i, {"i": 4})
    assert width == 4 and simplify_expr(start) == simplify_expr(o * 4)


def test_floordiv_and_mod_resolve_when_ranges_allow():
    from compiler_core.loop.ir import Binary

    o, i = Var("o"), Var("i")
    index = o * 32 + i
    ranges = {"o": 8, "i": 32}
    assert simplify_expr(Binary("floordiv", index, Const(32, INDEX)), ranges) == o
    assert simplify_expr(Binary("mod", index, Const(32, INDEX)), ranges) == i
    # i may reach 32 here: nothing can be concluded.
    wide = Binary("floordiv", o * 32 + i, Const(32, INDEX))
    assert simplify_expr(wide, {"o": 8, "i": 33}) != o


@pytest.mark.parametrize("op", ["floordiv", "mod"])
@pytest.mark.parametrize("offset", [0, 3, 16])
def test_a_lane_beside_a_block_index_drops_out_of_a_group_division(op, offset):
    """(lane + 16 * (f // 14) + offset) // 80: a grouped conv's input channel group, read in
    16-lane blocks of groups padded to 80 channels. The lane stays below the common factor 16,
    so the quotient is the block's group, (f // 14 + offset // 16) // 5, the same for every
    lane; a remainder keeps the lane. Checked against direct evaluation over every value."""
    from compiler_core.loop.ir import Binary
    from compiler_core.loop.transform import mentions

    lane, f = Var("lane"), Var("f")
    block = Binary("floordiv", f, Const(14, INDEX))
    index = Binary(op, lane + block * 16 + Const(offset, INDEX), Const(80, INDEX))
    ranges = {"lane": 16, "f": 280}
    simplified = simplify_expr(index, ranges)
    assert mentions(simplified, "lane") is (op == "mod" or offset % 16 != 0)
    for f_value in range(280):
        for lane_value in range(16):
            values = {"lane": lane_value, "f": f_value}
            assert _evaluate(simplified, values) == _evaluate(index, values)


def test_a_lane_beside_a_block_loop_drops_out_too():
    """The block index a loop variable of its own (affine, but its range no help): the same."""
    from compiler_core.loop.ir import Binary
    from compiler_core.loop.transform import mentions

    lane, block = Var("lane"), Var("block")
    index = Binary("floordiv", lane + block * 16, Const(80, INDEX))
    ranges = {"lane": 16, "block": 20}
    simplified = simplify_expr(index, ranges)
    assert not mentions(simplified, "lane")
    for values in ({"lane": k % 16, "block": k // 16} for k in range(320)):
        assert _evaluate(simplified, values) == _evaluate(index, values)


def test_a_group_division_keeps_the_lane_where_it_may_cross_a_group():
    from compiler_core.loop.ir import Binary
    from compiler_core.loop.transform import mentions

    lane, f = Var("lane"), Var("f")
    # 16 lanes of blocks of 8: a vector spans two blocks, which may lie in two groups.
    index = Binary("floordiv", lane + Binary("floordiv", f, Const(14, INDEX)) * 8, Const(72, INDEX))
    assert mentions(simplify_expr(index, {"lane": 16, "f": 504}), "lane")


def test_a_reshaped_row_index_drops_whole_multiples_and_decided_remainders():
    """[1, 136, 28, 28] read as [4, 34, 784]: row (952*g + 28*c + p // 28) % 28 is p // 28
    (p < 784), column p % 28; the flat address is then unit-stride in the lane."""
    from compiler_core.loop.ir import Binary
    from compiler_core.loop.transform import lane_stride

    g, c, lane, o = Var("g"), Var("c"), Var("lane"), Var("o")
    p = lane + o * 16
    d = Const(28, INDEX)
    row = Binary("mod", g * 952 + c * 28 + Binary("floordiv", p, d), d)
    ranges = {"g": 4, "c": 34, "lane": 16, "o": 49}
    simplified = simplify_expr(row, ranges)
    assert simplified == simplify_expr(Binary("floordiv", p, d))
    flat = (g * 34 + c) * 784 + simplified * 28 + Binary("mod", p, d)
    assert lane_stride(simplify_expr(flat), "lane") == 1
    for values in (
        {"g": k % 4, "c": k % 34, "lane": k % 16, "o": k % 49} for k in range(0, 4 * 34 * 49, 7)
    ):
        assert _evaluate(simplified, values) == _evaluate(row, values)


@pytest.mark.parametrize("op", ["floordiv", "mod"])
@pytest.mark.parametrize("offset", [0, 5, 30, -3])
def test_whole_multiples_leave_a_division_of_terms_exactly(op, offset):
    """(d*A + B) // d = A + B // d and (d*A + B) % d = B % d, A and B holding divisions of
    loop variables, B's range undecided (offset 30 or -3) or decided (0, 5): checked over
    every value."""
    from compiler_core.loop.ir import Binary

    x, y = Var("x"), Var("y")
    a = Binary("floordiv", x, Const(3, INDEX)) * 24 + y * 8
    b = Binary("mod", x * 5 + y, Const(6, INDEX)) + Const(offset, INDEX)
    index = Binary(op, a + b, Const(8, INDEX))
    ranges = {"x": 11, "y": 5}
    simplified = simplify_expr(index, ranges)
    for values in ({"x": k % 11, "y": k // 11} for k in range(55)):
        assert _evaluate(simplified, values) == _evaluate(index, values), values
    assert len(str(simplified)) < len(str(index))


def _evaluate(e, values):
    from compiler_core.loop.ir import Binary

    if isinstance(e, Const):
        return int(e.value)
    if isinstance(e, Var):
        return values[e.name]
    assert isinstance(e, Binary), e
    a, b = _evaluate(e.a, values), _evaluate(e.b, values)
    return {
        "add": a + b,
        "sub": a - b,
        "mul": a * b,
        "floordiv": a // b if b else None,
        "mod": a % b if b else None,
    }[e.op]


def test_loop_ranges_decide_clamps_and_comparisons():
    from compiler_core.loop.ir import Binary

    o, i = Var("o"), Var("i")
    column = o * 32 + i  # whole tiles: o < 6, so column <= 191
    ranges = {"o": 6, "i": 32}
    clamped = Binary("min", column, Const(196, INDEX))
    assert simplify_expr(clamped, ranges) == simplify_expr(column)
    assert simplify_expr(Binary("lt", column, Const(197, INDEX)), ranges) == Const(True, "bool")
    assert simplify_expr(Binary("ge", column, Const(192, INDEX)), ranges) == Const(False, "bool")
    assert simplify_expr(Binary("eq", column, Const(-1, INDEX)), ranges) == Const(False, "bool")
    # The last column is reached for some values and not others: undecided.
    edge = Binary("lt", column, Const(100, INDEX))
    assert simplify_expr(edge, ranges).op == "lt"
    assert simplify_expr(Binary("eq", i, Const(0, INDEX)), ranges) == Binary(
        "eq", i, Const(0, INDEX)
    )


def test_value_range_bounds_fused_indices_and_decides_their_clamps():
    """One range for every index the simplifier reads: affine sums, and the floor divisions
    and modulos that fuse and reshape leave (a fused loop f over 6 x 32 read back as its
    row f // 32 and column f % 32), nested; nothing for a product of variables."""
    from compiler_core.loop.ir import Binary
    from compiler_core.loop.simplify import value_range

    f, o = Var("f"), Var("o")
    ranges = {"f": 192, "o": 4}
    row, column = Binary("floordiv", f, Const(32, INDEX)), Binary("mod", f, Const(32, INDEX))
    assert value_range(o * 32 + Const(5, INDEX), ranges) == (5, 101)
    assert value_range(o * -2, ranges) == (-6, 0)
    assert value_range(row * 64 + column, ranges) == (0, 351)
    assert value_range(Binary("floordiv", row, Const(2, INDEX)), ranges) == (0, 2)
    assert value_range(Binary("mul", Const(2, INDEX) + Const(1, INDEX), o), ranges) == (0, 9)
    assert value_range(o * f, ranges) is None
    assert value_range(Var("n") + o, ranges) is None
    # The row of a fused index never reaches 6: the clamp a tile left goes.
    assert simplify_expr(Binary("min", row, Const(6, INDEX)), ranges) == row
    exact = [Binary("lt", column, Const(32, INDEX)), Binary("lt", row, Const(5, INDEX))]
    assert simplify_expr(exact[0], ranges) == Const(True, "bool")
    assert simplify_expr(exact[1], ranges).op == "lt"  # row 5 is reached: undecided


def test_a_split_index_joined_again_simplifies_to_itself():
    """(x // 32) * 32 + x % 32 == x: a packing stage's panel and lane, inlined into the tail
    tile of the GEMM that reads it, whose range does not resolve them."""
    from compiler_core.loop.ir import Binary

    t = Var("t")
    x = t + Const(61, INDEX)
    thirty_two = Const(32, INDEX)
    joined = Binary("floordiv", x, thirty_two) * thirty_two + Binary("mod", x, thirty_two)
    assert simplify_expr(joined) == simplify_expr(x)
    assert simplify_expr(joined, {"t": 16}) == simplify_expr(x)
    unequal = Binary("floordiv", x, thirty_two) * Const(16, INDEX) + Binary("mod", x, thirty_two)
    assert simplify_expr(unequal) != simplify_expr(x)
