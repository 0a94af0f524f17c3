"""Readable text for loop IR: C-like, one statement per line."""

from __future__ import annotations

from compiler_core.loop.ir import (
    Allocate,
    Barrier,
    Binary,
    Block,
    Buffer,
    Call,
    Cast,
    Const,
    Expr,
    For,
    ForKind,
    IfThenElse,
    Load,
    Prefetch,
    PrimFunc,
    Select,
    Stmt,
    Store,
    Unary,
    Var,
)

_INFIX = {
    "add": "+",
    "sub": "-",
    "mul": "*",
    "div": "/",
    "floordiv": "//",
    "mod": "%",
    "lt": "<",
    "le": "<=",
    "gt": ">",
    "ge": ">=",
    "eq": "==",
    "ne": "!=",
    "and": "&&",
    "or": "||",
    "shl": "<<",
    "shr": ">>",
    "xor": "^",
    "bitand": "&",
    "bitor": "|",
}


def format_expr(e: Expr) -> str:
    if isinstance(e, Var):
        return e.name
    if isinstance(e, Const):
        if e.dtype in ("int64", "bool"):
            return str(e.value).lower() if e.dtype == "bool" else str(e.value)
        return f"{e.value!r}{'f' if e.dtype == 'float32' else ''}"
    if isinstance(e, Binary):
        if e.op in _INFIX:
            return f"({format_expr(e.a)} {_INFIX[e.op]} {format_expr(e.b)})"
        return f"{e.op}({format_expr(e.a)}, {format_expr(e.b)})"
    if isinstance(e, Unary):
        return f"{e.op}({format_expr(e.a)})"
    if isinstance(e, Select):
        return f"select({format_expr(e.cond)}, {format_expr(e.a)}, {format_expr(e.b)})"
    if isinstance(e, Cast):
        return f"{e.dtype}({format_expr(e.a)})"
    if isinstance(e, Load):
        return f"{e.buffer.name}[{', '.join(format_expr(i) for i in e.indices)}]"
    if isinstance(e, Call):
        return f"{e.name}({', '.join(format_expr(a) for a in e.args)})"
    raise TypeError(f"cannot print {type(e).__name__}")


def _buffer_decl(b: Buffer) -> str:
    return f"{b.dtype} {b.name}[{', '.join(map(str, b.shape))}]"


def format_stmt(s: Stmt, indent: int = 0) -> list[str]:
    pad = "  " * indent
    if isinstance(s, Block):
        return [line for stmt in s.stmts for line in format_stmt(stmt, indent)]
    if isinstance(s, For):
        kind = "" if s.kind == ForKind.SERIAL else f" {s.kind.value}"
        if s.binding:
            kind += f"({s.binding})"
        head = f"{pad}for {s.var.name} in 0..{s.extent}{kind}:"
        return [head, *format_stmt(s.body, indent + 1)]
    if isinstance(s, Store):
        index = ", ".join(format_expr(i) for i in s.indices)
        return [f"{pad}{s.buffer.name}[{index}] = {format_expr(s.value)}"]
    if isinstance(s, Prefetch):
        return [f"{pad}prefetch {s.buffer.name}.flat[{format_expr(s.offset)}]"]
    if isinstance(s, Allocate):
        return [
            f"{pad}alloc {s.buffer.scope} {_buffer_decl(s.buffer)}",
            *format_stmt(s.body, indent),
        ]
    if isinstance(s, IfThenElse):
        lines = [f"{pad}if {format_expr(s.cond)}:", *format_stmt(s.then, indent + 1)]
        if s.otherwise is not None:
            lines += [f"{pad}else:", *format_stmt(s.otherwise, indent + 1)]
        return lines
    if isinstance(s, Barrier):
        return [f"{pad}barrier()"]
    raise TypeError(f"cannot print {type(s).__name__}")


def format_func(f: PrimFunc) -> str:
    params = ", ".join(_buffer_decl(b) for b in f.params)
    return "\n".join([f"func {f.name}({params}):", *format_stmt(f.body, 1)])
