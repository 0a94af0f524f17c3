"""Reductions across a loop's iterations, recognized in a store: `acc = combine(acc, term(i))`.

A vectorized loop whose body stores to one element for every lane and reads that element
back (a row fold: the lanes of a partial sum or maximum added up) means the serial loop, one
lane after another. When `combine` is associative and commutative, a renderer may fold the
lanes in any order instead, a tree of log2(lanes) vector steps rather than a chain of one
scalar step per lane; `lane_reduction` finds the combiner and the term for it.
"""

from __future__ import annotations

import dataclasses

from compiler_core.loop.ir import Binary, Expr, For, Load, Select, Store, Var
from compiler_core.loop.transform import map_expr, mentions, stmt_exprs, walk_exprs, walk_stmts

# The names of a combiner's two operands: the running value and the next term.
ACC = "lane.acc"
TERM = "lane.term"

# Binary operators that are associative and commutative (floats up to rounding, which the
# fast-math contract of the renderer accepts).
ASSOCIATIVE = frozenset({"add", "mul", "max", "min", "and", "or"})
# select(x > y, x, y) and its kin: a maximum or minimum written as a comparison.
ORDERING = frozenset({"gt", "ge", "lt", "le"})


@dataclasses.dataclass(frozen=True)
class LaneReduction:
    """`store`'s value is combine(acc, term): `combine` over ACC and TERM, `term` the part
    that depends on the loop variable."""

    combine: Expr
    term: Expr


def _terms(e: Expr, var: str) -> list[Expr]:
    """The largest subexpressions of `e` that depend on `var` and do not contain ACC."""
    if not mentions(e, ACC):
        return [e] if mentions(e, var) else []
    return [t for child in e.children() for t in _terms(child, var)]


def _is_associative(combine: Expr) -> bool:
    operands = {Var(ACC, combine.dtype), Var(TERM, combine.dtype)}
    if isinstance(combine, Binary):
        return combine.op in ASSOCIATIVE and {combine.a, combine.b} == operands
    if isinstance(combine, Select) and isinstance(combine.cond, Binary):
        cond = combine.cond
        return (
            cond.op in ORDERING
            and {cond.a, cond.b} == operands
            and {combine.a, combine.b} == operands
        )
    return False


def lane_reduction(store: Store, var: str) -> LaneReduction | None:
    """The combiner of a store that reduces over loop `var` (its element does not move with
    `var`, its value reads that element and combines it with one term of `var`, which may
    appear more than once: select(t > acc, t, acc)), when the combiner is associative and
    commutative; None otherwise."""
    if not reduces_over(store, var):
        return None
    accumulator = Load(store.buffer, store.indices)
    acc = Var(ACC, store.buffer.dtype)
    template = map_expr(store.value, lambda e: acc if e == accumulator else None)
    terms = _terms(template, var)
    if not terms or any(t != terms[0] for t in terms):
        return None
    term = terms[0]
    if any(isinstance(x, Load) and x.buffer == store.buffer for x in walk_exprs(term)):
        return None
    if term.dtype != acc.dtype:
        return None
    combine = map_expr(template, lambda e: Var(TERM, term.dtype) if e == term else None)
    return LaneReduction(combine, term) if _is_associative(combine) else None


def reduces_over(store: Store, var: str) -> bool:
    """Whether `store` writes one element for every iteration of `var` and reads it back:
    a reduction over `var`, whatever its combiner."""
    if any(mentions(index, var) for index in store.indices):
        return False
    return any(
        isinstance(x, Load) and x.buffer == store.buffer and x.indices == store.indices
        for x in walk_exprs(store.value)
    )


def folds_over_lanes(loop: For, store: Store) -> bool:
    """Whether `store` (inside `loop`) is a reduction over `loop` that may fold its lanes in
    any order: an associative combiner, and nothing else in the loop reads or writes its
    element (no statement sees a running value)."""
    if lane_reduction(store, loop.var.name) is None:
        return False
    for s in walk_stmts(loop.body):
        if s is store:
            continue
        if isinstance(s, Store) and s.buffer == store.buffer:
            return False
        if any(
            isinstance(x, Load) and x.buffer == store.buffer
            for e in stmt_exprs(s)
            for x in walk_exprs(e)
        ):
            return False
    return True
