"""Index-arithmetic simplification and affine analysis for loop IR.

`simplify` folds constants (index arithmetic and comparisons) and removes neutral terms
(x*1, x+0, x*0, min/max of equal operands, floordiv/mod by 1); `affine` reads an integer
expression as sum(c_v * v) + c0, which is what bound inference for compute_at and cache_write
needs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from compiler_core.loop.ir import (
    COMPARE,
    INDEX,
    Binary,
    Const,
    Expr,
    For,
    PrimFunc,
    Stmt,
    Var,
)
from compiler_core.loop.transform import map_expr

_FOLD = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "floordiv": lambda a, b: a // b,
    "mod": lambda a, b: a % b,
    "min": min,
    "max": max,
}


def _is_const(e: Expr, value=None) -> bool:
    return isinstance(e, Const) and (value is None or e.value == value)


def _is_index_const(e: Expr) -> bool:
    return isinstance(e, Const) and e.dtype == INDEX


def canonical(coeffs: Mapping[str, int], constant: int) -> Expr:
    """sum(c_v * v) + c0 with variables in name order: equal forms print equally."""
    result: Expr | None = None
    for name in sorted(coeffs):
        c = coeffs[name]
        term = Var(name) if c == 1 else Binary("mul", Var(name), Const(c, INDEX))
        result = term if result is None else Binary("add", result, term)
    if result is None:
        return Const(constant, INDEX)
    return result if constant == 0 else Binary("add", result, Const(constant, INDEX))


def _simplify_node(e: Expr) -> Expr | None:
    # Comparisons of two index constants fold to a bool constant (a guard or a select on an
    # unrolled loop's index, once the index is known).
    if isinstance(e, Binary) and e.op in COMPARE and _is_index_const(e.a) and _is_index_const(e.b):
        return Const(COMPARE[e.op](e.a.value, e.b.value), "bool")
    if not isinstance(e, Binary) or e.dtype != INDEX:
        return None
    if e.op in ("add", "sub", "mul"):
        form = affine(e)
        if form is not None:
            return canonical(*form)
        if e.op in ("add", "sub"):
            joined = _joined_divmod(e)
            if joined is not None:
                return joined  # else the identities below (0 + x) may still apply
    a, b, op = e.a, e.b, e.op
    if _is_const(a) and _is_const(b) and op in _FOLD:
        if op in ("floordiv", "mod") and b.value == 0:
            return None
        return Const(_FOLD[op](a.value, b.value), INDEX)
    if op == "add":
        if _is_const(a, 0):
            return b
        if _is_const(b, 0):
            return a
    if op == "sub" and _is_const(b, 0):
        return a
    if op == "mul":
        if _is_const(a, 0) or _is_const(b, 0):
            return Const(0, INDEX)
        if _is_const(a, 1):
            return b
        if _is_const(b, 1):
            return a
    if op in ("floordiv",) and _is_const(b, 1):
        return a
    if op == "mod" and _is_const(b, 1):
        return Const(0, INDEX)
    if op in ("min", "max") and a == b:
        return a
    return None


def _terms(e: Expr) -> tuple[dict[Expr, int], int]:
    """`e` as sum(c_t * t) + c0 over terms that are not sums, differences or products by a
    constant (variables, floor divisions, modulos, products of variables)."""
    if isinstance(e, Const) and e.dtype == INDEX:
        return {}, int(e.value)
    if isinstance(e, Binary) and e.dtype == INDEX and e.op in ("add", "sub"):
        (ta, ka), (tb, kb) = _terms(e.a), _terms(e.b)
        sign = 1 if e.op == "add" else -1
        terms = dict(ta)
        for t, c in tb.items():
            terms[t] = terms.get(t, 0) + sign * c
        return {t: c for t, c in terms.items() if c}, ka + sign * kb
    if isinstance(e, Binary) and e.dtype == INDEX and e.op == "mul":
        left, right = _terms(e.a), _terms(e.b)
        for (scale_terms, c), (terms, constant) in ((left, right), (right, left)):
            if not scale_terms:  # a constant factor, literal or not
                return {t: c * k for t, k in terms.items() if c * k}, c * constant
    return {e: 1}, 0


def _joined_divmod(e: Expr) -> Expr | None:
    """k*d*(x // d) + k*(x % d) -> k*x: an index split into a panel and a lane and joined again
    (a packing stage inlined into the GEMM that reads it), when no range rewrote it first."""
    terms, constant = _terms(e)
    joined = False
    for t in list(terms):
        if not (isinstance(t, Binary) and t.op == "floordiv" and _is_index_const(t.b)):
            continue
        divisor = int(t.b.value)
        lane = Binary("mod", t.a, t.b)
        k = terms.get(lane, 0)
        if divisor <= 0 or t not in terms or not k or terms[t] != k * divisor:
            continue
        del terms[t], terms[lane]
        inner, inner_constant = _terms(t.a)
        for u, c in inner.items():
            terms[u] = terms.get(u, 0) + k * c
        constant += k * inner_constant
        joined = True
    if not joined:
        return None
    return map_expr(_sum_of_terms(terms, constant), _simplify_node)


def _divmod_by_ranges(e: Expr, ranges: Mapping[str, int]) -> Expr | None:
    """(d*A + B) // d -> A + B // d and (d*A + B) % d -> B % d for any index terms A (floor
    division and modulo ignore whole multiples of the divisor whatever the sign), and further
    B // d -> 0, B % d -> B where the loop ranges hold B in [0, d), B a sum of loop variables
    and their floor divisions and modulos by constants (`value_range`); else a lane beside a
    block index (`_divmod_by_common_factor`). What split, fuse and reshape leave behind: a
    packed layout's (c*A + B) // c is A; [1, 136, 28, 28] read as [4, 34, 784] reads row
    (952*g + 28*c + p // 28) % 28, which is p // 28 for p < 784 (left as it was, the address
    moved with the lane as far as codegen could tell, and every lane of that Reshape's copy
    loaded on its own: 80 us for 426 KB)."""
    if not isinstance(e, Binary) or e.op not in ("floordiv", "mod") or e.dtype != INDEX:
        return None
    if not isinstance(e.b, Const) or e.b.value <= 0:
        return None
    divisor = int(e.b.value)
    terms, constant = _terms(e.a)
    whole = {t: c // divisor for t, c in terms.items() if c % divisor == 0}
    rest = {t: c for t, c in terms.items() if c % divisor}
    q0, r0 = divmod(constant, divisor)
    remainder = _sum_of_terms(rest, r0)
    span = value_range(remainder, ranges)
    if span is not None and span[0] >= 0 and span[1] < divisor:
        return remainder if e.op == "mod" else _sum_of_terms(whole, q0)
    common = _divmod_by_common_factor(e, ranges)
    if common is not None:
        return common
    if not whole and not q0:
        return None
    # Dropping the multiples leaves the small remainder expression (the lane part of a fused
    # or reshaped index), not the whole index.
    reduced = Binary(e.op, remainder, e.b)
    return reduced if e.op == "mod" else Binary("add", _sum_of_terms(whole, q0), reduced)


def _divmod_by_common_factor(e: Binary, ranges: Mapping[str, int]) -> Expr | None:
    """(g*A + B) // d -> A // (d/g) and (g*A + B) % d -> g*(A % (d/g)) + B when g divides d
    and 0 <= B < g for every loop value, A any index expression (a fused loop's floordiv, say):
    a vector lane B beside a block index A, where d/g blocks make a group. Without it a
    grouped conv's input channel, (lane + 16*block) // 80 * 68 + c, moves with the lane as far
    as codegen can tell, and every lane loads on its own (ShuffleNet's groups of 68 channels,
    padded to 80: 16 loads and inserts where one broadcast does)."""
    divisor = int(e.b.value)
    terms, constant = _terms(e.a)
    # A term without a range must lie in A: the factor divides its coefficient.
    unbounded = [c for t, c in terms.items() if not (isinstance(t, Var) and t.name in ranges)]
    for factor in _divisors_descending(math.gcd(divisor, *unbounded)):
        # The terms left over are loop variables: the factor divides every other coefficient.
        whole = {t: c // factor for t, c in terms.items() if c % factor == 0}
        lane = {t: c for t, c in terms.items() if c % factor}
        if not whole:
            continue
        lane_constant = constant % factor
        low = lane_constant + sum(min(0, c * (ranges[t.name] - 1)) for t, c in lane.items())
        high = lane_constant + sum(max(0, c * (ranges[t.name] - 1)) for t, c in lane.items())
        if low < 0 or high >= factor:
            continue
        blocks = _sum_of_terms(whole, constant // factor)
        groups = Const(divisor // factor, INDEX)
        if e.op == "floordiv":
            return Binary("floordiv", blocks, groups)
        rest = canonical({t.name: c for t, c in lane.items()}, lane_constant)
        scaled = Binary("mul", Binary("mod", blocks, groups), Const(factor, INDEX))
        return Binary("add", scaled, rest)
    return None


def _term_range(t: Expr, ranges: Mapping[str, int]) -> tuple[int, int] | None:
    if isinstance(t, Var):
        return (0, ranges[t.name] - 1) if t.name in ranges else None
    if not (isinstance(t, Binary) and t.op in ("floordiv", "mod") and _is_index_const(t.b)):
        return None
    divisor = int(t.b.value)
    inner = value_range(t.a, ranges) if divisor > 0 else None
    if inner is None:
        return None
    if t.op == "floordiv":
        return inner[0] // divisor, inner[1] // divisor
    return inner if inner[0] >= 0 and inner[1] < divisor else (0, divisor - 1)


def _divisors_descending(n: int) -> list[int]:
    """The divisors of n above 1, largest first."""
    small = [k for k in range(2, math.isqrt(n) + 1) if n % k == 0]
    return sorted({n, *small, *(n // k for k in small)} - {1}, reverse=True)


def _sum_of_terms(terms: Mapping[Expr, int], constant: int) -> Expr:
    """sum(c_t * t) + constant, terms of coefficient 0 and a constant of 0 left out."""
    parts = [t if c == 1 else Binary("mul", t, Const(c, INDEX)) for t, c in terms.items() if c]
    if constant or not parts:
        parts.append(Const(constant, INDEX))
    result = parts[0]
    for part in parts[1:]:
        result = Binary("add", result, part)
    return result


def value_range(e: Expr, ranges: Mapping[str, int]) -> tuple[int, int] | None:
    """(least, greatest) value of `e` when every variable runs over 0..extent-1, for a sum of
    loop variables and their floor divisions and modulos by positive constants (nested: a
    fused or reshaped index); None for any other term (a product of variables) or a variable
    without a range."""
    terms, constant = _terms(e)
    low = high = constant
    for t, c in terms.items():
        span = _term_range(t, ranges)
        if span is None:
            return None
        ends = (c * span[0], c * span[1])
        low, high = low + min(ends), high + max(ends)
    return low, high


def _decided_by_ranges(e: Expr, ranges: Mapping[str, int]) -> Expr | None:
    """A min or max of index values, or a comparison of them, that the loop ranges decide:
    what a tile leaves behind where it never reaches an edge (the clamp of a padded column, the
    guard of a crop, in every whole tile of a GEMM)."""
    if not isinstance(e, Binary) or e.a.dtype != INDEX or e.b.dtype != INDEX:
        return None
    if e.op in ("min", "max"):
        a, b = value_range(e.a, ranges), value_range(e.b, ranges)
        if a is None or b is None:
            return None
        if a[1] <= b[0]:
            return e.a if e.op == "min" else e.b
        if b[1] <= a[0]:
            return e.b if e.op == "min" else e.a
        return None
    if e.op not in COMPARE:
        return None
    difference = value_range(Binary("sub", e.a, e.b), ranges)
    if difference is None:
        return None
    low, high = difference
    if e.op in ("eq", "ne"):
        if low < 0 < high or (low != high and 0 in (low, high)):
            return None  # the difference may be zero or not
        return Const(COMPARE[e.op](low, 0), "bool")
    # The other comparisons are monotonic in the difference: its ends decide them.
    outcomes = {COMPARE[e.op](low, 0), COMPARE[e.op](high, 0)}
    return Const(outcomes.pop(), "bool") if len(outcomes) == 1 else None


def simplify_expr(e: Expr, ranges: Mapping[str, int] | None = None) -> Expr:
    if not ranges:
        return map_expr(e, _simplify_node)

    def node(x: Expr) -> Expr | None:
        reduced = _divmod_by_ranges(x, ranges)
        if reduced is not None:
            return map_expr(reduced, _simplify_node)
        decided = _decided_by_ranges(x, ranges)
        if decided is not None:
            return decided
        return _simplify_node(x)

    return map_expr(e, node)


def simplify_stmt(
    s: Stmt, ranges: Mapping[str, int] | None = None, cache: dict | None = None
) -> Stmt:
    """Simplify every expression, knowing each loop variable's range where it is bound.

    `cache`: results by (statement, the ranges around it), for a caller that simplifies one
    function again and again as it changes (a schedule's records): a subtree a record left
    alone, under the same loops, is not walked again. It holds each statement it keys by
    identity, so no key outlives its statement."""
    ranges = dict(ranges or {})
    if isinstance(s, For):
        ranges[s.var.name] = s.extent
    if cache is None:
        return _simplify_children(s, ranges, None)
    scope = frozenset(ranges.items())
    hit = cache.get((id(s), scope))
    if hit is None or hit[0] is not s:
        simplified = _simplify_children(s, ranges, cache)
        hit = cache[(id(s), scope)] = (s, simplified)
        # The result is simplified as it stands: the next pass over it finds it so.
        cache[(id(simplified), scope)] = (simplified, simplified)
    return hit[1]


def _simplify_children(s: Stmt, ranges: dict[str, int], cache: dict | None) -> Stmt:
    return s.with_children(
        simplify_stmt(c, ranges, cache) if isinstance(c, Stmt) else simplify_expr(c, ranges)
        for c in s.children()
    )


def simplify(func: PrimFunc) -> PrimFunc:
    return PrimFunc(func.name, func.params, simplify_stmt(func.body))


def affine(e: Expr) -> tuple[dict[str, int], int] | None:
    """(coefficients by variable name, constant) when `e` is affine in integer variables."""
    if isinstance(e, Const) and e.dtype == INDEX:
        return {}, int(e.value)
    if isinstance(e, Var):
        return {e.name: 1}, 0
    if not isinstance(e, Binary) or e.op not in ("add", "sub", "mul"):
        return None
    left, right = affine(e.a), affine(e.b)
    if left is None or right is None:
        return None
    (ca, ka), (cb, kb) = left, right
    if e.op in ("add", "sub"):
        sign = 1 if e.op == "add" else -1
        coeffs = dict(ca)
        for name, c in cb.items():
            coeffs[name] = coeffs.get(name, 0) + sign * c
        return {k: v for k, v in coeffs.items() if v}, ka + sign * kb
    if not ca:  # constant * affine
        return {k: ka * v for k, v in cb.items() if ka * v}, ka * kb
    if not cb:
        return {k: kb * v for k, v in ca.items() if kb * v}, ka * kb
    return None  # a product of variables is not affine


def bounds(e: Expr, ranges: Mapping[str, int]) -> tuple[Expr, int] | None:
    """For an affine `e`, the smallest value over the variables in `ranges` (each running over
    0..extent-1) as an expression of the other variables, and the (constant) span width.
    None when `e` is not affine."""
    form = affine(e)
    if form is None:
        return None
    coeffs, constant = form
    low, width = constant, 1
    outer: Expr = Const(0, INDEX)
    for name, c in sorted(coeffs.items()):
        if name in ranges:
            span = c * (ranges[name] - 1)
            low += min(0, span)
            width += abs(span)
        else:
            term = Var(name) if c == 1 else Binary("mul", Const(c, INDEX), Var(name))
            outer = Binary("add", outer, term)
    start = simplify_expr(Binary("add", outer, Const(low, INDEX)))
    return start, width


def max_value(e: Expr, ranges: Mapping[str, int]) -> int | None:
    """The largest value of `e` when every variable runs over 0..extent-1 (`value_range`)."""
    span = value_range(e, ranges)
    return None if span is None else span[1]
