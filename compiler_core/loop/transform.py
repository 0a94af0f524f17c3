"""Generic rewriting of loop IR: expression/statement mapping, substitution, queries."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

from compiler_core.loop.ir import (
    INDEX,
    Allocate,
    Binary,
    Block,
    Buffer,
    Const,
    Expr,
    For,
    IfThenElse,
    Load,
    Stmt,
    Var,
)

ExprFn = Callable[[Expr], Expr | None]


def map_expr(e: Expr, fn: ExprFn) -> Expr:
    """Rebuild `e` bottom-up; `fn` may return a replacement for any node (None: keep)."""
    if not isinstance(e, Expr):
        raise TypeError(f"cannot rewrite expression {type(e).__name__}")
    children = e.children()
    if children:
        e = e.with_children(map_expr(c, fn) for c in children)
    replacement = fn(e)
    return e if replacement is None else replacement


def map_stmt(
    s: Stmt, expr_fn: ExprFn | None = None, stmt_fn: Callable[[Stmt], Stmt | None] | None = None
) -> Stmt:
    """Rebuild `s` bottom-up, applying `expr_fn` to every expression and `stmt_fn` to every
    statement (after its children are rebuilt)."""
    if not isinstance(s, Stmt):
        raise TypeError(f"cannot rewrite statement {type(s).__name__}")

    def child(c):
        if isinstance(c, Stmt):
            return map_stmt(c, expr_fn, stmt_fn)
        return map_expr(c, expr_fn) if expr_fn else c

    children = s.children()
    if children:
        s = s.with_children(child(c) for c in children)
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
    for child in s.children():
        if isinstance(child, Stmt):
            yield from walk_stmts(child)


def walk_exprs(e: Expr) -> Iterator[Expr]:
    yield e
    for child in e.children():
        yield from walk_exprs(child)


def mentions(e: Expr, name: str) -> bool:
    """Whether variable `name` occurs in `e`."""
    return any(isinstance(x, Var) and x.name == name for x in walk_exprs(e))


def stmt_exprs(s: Stmt) -> Iterator[Expr]:
    """The expressions directly held by one statement (not its children statements)."""
    for child in s.children():
        if isinstance(child, Expr):
            yield child


def flat_index(buffer: Buffer, indices: Sequence[Expr]) -> Expr:
    """The row-major element offset of `buffer[indices]`."""
    flat: Expr = Const(0, INDEX)
    stride = 1
    for index, size in reversed(list(zip(indices, buffer.shape, strict=True))):
        flat = Binary("add", flat, Binary("mul", index, Const(stride, INDEX)))
        stride *= size
    return flat


def lane_stride(e: Expr, var: str) -> int | None:
    """c when `e` is c * var plus terms that do not depend on var (those may be anything:
    a fused loop's floordiv and mod, say), else None."""
    if not mentions(e, var):
        return 0
    if isinstance(e, Var):
        return 1
    if isinstance(e, Binary) and e.op in ("add", "sub"):
        a, b = lane_stride(e.a, var), lane_stride(e.b, var)
        if a is None or b is None:
            return None
        return a + b if e.op == "add" else a - b
    if isinstance(e, Binary) and e.op == "mul":
        for side, other in ((e.a, e.b), (e.b, e.a)):
            if isinstance(other, Const) and other.dtype == INDEX:
                inner = lane_stride(side, var)
                return None if inner is None else inner * int(other.value)
    return None


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


def loops_above(root: Stmt, target: Stmt) -> list[For] | None:
    """The loops from `root` down to `target` (outermost first, `target` excluded); None when
    `target` is not inside `root`."""
    if root is target:
        return []
    children: tuple[Stmt, ...] = ()
    if isinstance(root, Block):
        children = root.stmts
    elif isinstance(root, (For, Allocate)):
        children = (root.body,)
    elif isinstance(root, IfThenElse):
        children = tuple(c for c in (root.then, root.otherwise) if c is not None)
    for child in children:
        path = loops_above(child, target)
        if path is not None:
            return ([root] if isinstance(root, For) else []) + path
    return None


def replace_stmt(root: Stmt, target: Stmt, replacement: Stmt) -> Stmt:
    """Replace the statement `target` (by identity) inside `root`."""

    # Unchanged subtrees are returned as they are, so other statements keep their identity.
    def rebuild(s: Stmt) -> Stmt:
        if s is target:
            return replacement
        children = s.children()
        if not any(isinstance(c, Stmt) for c in children):
            return s
        return s.with_children(rebuild(c) if isinstance(c, Stmt) else c for c in children)

    return rebuild(root)
