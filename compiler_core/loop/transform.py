"""Generic rewriting of loop IR: expression/statement mapping, substitution, queries."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping

from compiler_core.loop.ir import (
    Allocate,
    Binary,
    Block,
    Buffer,
    Cast,
    Const,
    Expr,
    For,
    IfThenElse,
    Load,
    Select,
    Stmt,
    Store,
    Unary,
    Var,
)

ExprFn = Callable[[Expr], Expr | None]


def map_expr(e: Expr, fn: ExprFn) -> Expr:
    """Rebuild `e` bottom-up; `fn` may return a replacement for any node (None: keep)."""
    if isinstance(e, (Var, Const)):
        pass
    elif isinstance(e, Binary):
        e = Binary(e.op, map_expr(e.a, fn), map_expr(e.b, fn))
    elif isinstance(e, Unary):
        e = Unary(e.op, map_expr(e.a, fn))
    elif isinstance(e, Select):
        e = Select(map_expr(e.cond, fn), map_expr(e.a, fn), map_expr(e.b, fn))
    elif isinstance(e, Cast):
        e = Cast(e.dtype, map_expr(e.a, fn))
    elif isinstance(e, Load):
        e = Load(e.buffer, tuple(map_expr(i, fn) for i in e.indices))
    elif dataclasses.is_dataclass(e) and hasattr(e, "indices") and hasattr(e, "tensor"):
        e = dataclasses.replace(e, indices=tuple(map_expr(i, fn) for i in e.indices))
    else:
        raise TypeError(f"cannot rewrite expression {type(e).__name__}")
    replacement = fn(e)
    return e if replacement is None else replacement


def map_stmt(
    s: Stmt, expr_fn: ExprFn | None = None, stmt_fn: Callable[[Stmt], Stmt | None] | None = None
) -> Stmt:
    """Rebuild `s` bottom-up, applying `expr_fn` to every expression and `stmt_fn` to every
    statement (after its children are rebuilt)."""

    def ex(e: Expr) -> Expr:
        return map_expr(e, expr_fn) if expr_fn else e

    if isinstance(s, Block):
        s = Block(tuple(map_stmt(x, expr_fn, stmt_fn) for x in s.stmts))
    elif isinstance(s, For):
        s = dataclasses.replace(s, body=map_stmt(s.body, expr_fn, stmt_fn))
    elif isinstance(s, Store):
        s = Store(s.buffer, tuple(ex(i) for i in s.indices), ex(s.value))
    elif isinstance(s, Allocate):
        s = Allocate(s.buffer, map_stmt(s.body, expr_fn, stmt_fn))
    elif isinstance(s, IfThenElse):
        otherwise = map_stmt(s.otherwise, expr_fn, stmt_fn) if s.otherwise else None
        s = IfThenElse(ex(s.cond), map_stmt(s.then, expr_fn, stmt_fn), otherwise)
    else:
        raise TypeError(f"cannot rewrite statement {type(s).__name__}")
    if stmt_fn is not None:
        replacement = stmt_fn(s)
        if replacement is not None:
            return replacement
    return s


def substitute(node, mapping: Mapping[str, Expr]):
    """Replace variables (by name) in an expression or statement."""

    def fn(e):
        return mapping.get(e.name) if isinstance(e, Var) else None

    if isinstance(node, Expr):
        return map_expr(node, fn)
    return map_stmt(node, fn)


def walk_stmts(s: Stmt) -> Iterator[Stmt]:
    yield s
    if isinstance(s, Block):
        for x in s.stmts:
            yield from walk_stmts(x)
    elif isinstance(s, (For, Allocate)):
        yield from walk_stmts(s.body)
    elif isinstance(s, IfThenElse):
        yield from walk_stmts(s.then)
        if s.otherwise is not None:
            yield from walk_stmts(s.otherwise)


def walk_exprs(e: Expr) -> Iterator[Expr]:
    yield e
    for child in _expr_children(e):
        yield from walk_exprs(child)


def _expr_children(e: Expr) -> tuple[Expr, ...]:
    if isinstance(e, Binary):
        return (e.a, e.b)
    if isinstance(e, (Unary, Cast)):
        return (e.a,)
    if isinstance(e, Select):
        return (e.cond, e.a, e.b)
    if isinstance(e, Load):
        return e.indices
    return ()


def stmt_exprs(s: Stmt) -> Iterator[Expr]:
    """The expressions directly held by one statement (not its children statements)."""
    if isinstance(s, Store):
        yield from s.indices
        yield s.value
    elif isinstance(s, IfThenElse):
        yield s.cond


def loads_of(s: Stmt, buffer: Buffer) -> list[Load]:
    found = []
    for stmt in walk_stmts(s):
        for e in stmt_exprs(stmt):
            found += [x for x in walk_exprs(e) if isinstance(x, Load) and x.buffer == buffer]
    return found


def find_loop(s: Stmt, name: str) -> For | None:
    for stmt in walk_stmts(s):
        if isinstance(stmt, For) and stmt.var.name == name:
            return stmt
    return None


def replace_stmt(root: Stmt, target: Stmt, replacement: Stmt) -> Stmt:
    """Replace the statement `target` (by identity) inside `root`."""

    # Unchanged subtrees are returned as they are, so other statements keep their identity.
    def rebuild(s: Stmt) -> Stmt:
        if s is target:
            return replacement
        if isinstance(s, Block):
            stmts = tuple(rebuild(x) for x in s.stmts)
            changed = any(a is not b for a, b in zip(stmts, s.stmts, strict=True))
            return Block(stmts) if changed else s
        if isinstance(s, (For, Allocate)):
            body = rebuild(s.body)
            return s if body is s.body else dataclasses.replace(s, body=body)
        if isinstance(s, IfThenElse):
            then = rebuild(s.then)
            otherwise = rebuild(s.otherwise) if s.otherwise is not None else None
            if then is s.then and otherwise is s.otherwise:
                return s
            return IfThenElse(s.cond, then, otherwise)
        return s

    return rebuild(root)
