"""Execute loop IR with numpy scalars: the oracle every schedule is tested against.

The IR is first turned into a tree of Python closures (one per node), then run. Parallel,
vectorized and unrolled loops run serially: their meaning is the serial loop's. Float math
happens in the buffers' dtypes (numpy scalars), so float32 kernels round as float32 code does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np

from compiler_core.loop.ir import (
    COMPARE,
    Allocate,
    Barrier,
    Binary,
    Block,
    Call,
    Cast,
    Const,
    Expr,
    For,
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

Env = dict
_erf = np.vectorize(math.erf)

_BINARY: dict[str, Callable] = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b if isinstance(a, np.floating) else _truncating_div(a, b),
    "floordiv": lambda a, b: a // b,
    "mod": lambda a, b: a % b,
    "min": lambda a, b: min(a, b),
    "max": lambda a, b: max(a, b),
    "pow": lambda a, b: a**b,
    "fmod": lambda a, b: np.fmod(a, b),
    "shl": lambda a, b: a << b,
    "shr": lambda a, b: a >> b,
    "xor": lambda a, b: a ^ b,
    "bitand": lambda a, b: a & b,
    "bitor": lambda a, b: a | b,
    **COMPARE,
    "and": lambda a, b: bool(a) and bool(b),
    "or": lambda a, b: bool(a) or bool(b),
}


def _truncating_div(a, b):
    """Integer division rounding toward zero (C's and ONNX's); // rounds down."""
    quotient = abs(int(a)) // abs(int(b))
    return quotient if (a < 0) == (b < 0) else -quotient


def _unary(op: str, dtype: str) -> Callable:
    t = np.dtype(dtype).type
    table = {
        "neg": lambda a: -a,
        "not": lambda a: not a,
        "abs": abs,
        "exp": lambda a: t(np.exp(a)),
        "log": lambda a: t(np.log(a)),
        "sqrt": lambda a: t(np.sqrt(a)),
        "rsqrt": lambda a: t(1.0 / np.sqrt(a)),
        "tanh": lambda a: t(np.tanh(a)),
        "erf": lambda a: t(math.erf(float(a))),
        "sigmoid": lambda a: t(1.0 / (1.0 + np.exp(-np.float64(a)))),
        "floor": lambda a: t(np.floor(a)),
        "ceil": lambda a: t(np.ceil(a)),
        "round": lambda a: t(np.round(a)),
        "sin": lambda a: t(np.sin(a)),
        "cos": lambda a: t(np.cos(a)),
        "sign": lambda a: t(np.sign(a)),
        "tan": lambda a: t(np.tan(a)),
        "asin": lambda a: t(np.arcsin(a)),
        "acos": lambda a: t(np.arccos(a)),
        "atan": lambda a: t(np.arctan(a)),
        "sinh": lambda a: t(np.sinh(a)),
        "cosh": lambda a: t(np.cosh(a)),
        "asinh": lambda a: t(np.arcsinh(a)),
        "acosh": lambda a: t(np.arccosh(a)),
        "atanh": lambda a: t(np.arctanh(a)),
    }
    return table[op]


def _compile_expr(e: Expr) -> Callable[[Env], object]:
    if isinstance(e, Var):
        name = e.name
        return lambda env: env[name]
    if isinstance(e, Const):
        value = e.value if e.dtype in ("int64", "bool") else np.dtype(e.dtype).type(e.value)
        return lambda env: value
    if isinstance(e, Binary):
        fa, fb, fn = _compile_expr(e.a), _compile_expr(e.b), _BINARY[e.op]
        return lambda env: fn(fa(env), fb(env))
    if isinstance(e, Unary):
        fa, fn = _compile_expr(e.a), _unary(e.op, e.dtype)
        return lambda env: fn(fa(env))
    if isinstance(e, Select):
        fc, fa, fb = _compile_expr(e.cond), _compile_expr(e.a), _compile_expr(e.b)
        return lambda env: fa(env) if fc(env) else fb(env)
    if isinstance(e, Cast):
        fa = _compile_expr(e.a)
        if e.dtype == "int64":
            return lambda env: int(fa(env))
        t = np.dtype(e.dtype).type
        return lambda env: t(fa(env))
    if isinstance(e, Load):
        name, index = e.buffer.name, [_compile_expr(i) for i in e.indices]
        return lambda env: env[name][tuple(f(env) for f in index)]
    if isinstance(e, Call):
        raise TypeError(f"the interpreter runs one thread at a time: no warp intrinsic {e.name!r}")
    raise TypeError(f"the interpreter cannot evaluate {type(e).__name__}")


def _compile_stmt(s: Stmt) -> Callable[[Env], None]:
    if isinstance(s, Block):
        parts = [_compile_stmt(x) for x in s.stmts]

        def run_block(env):
            for part in parts:
                part(env)

        return run_block
    if isinstance(s, For):
        name, extent, body = s.var.name, s.extent, _compile_stmt(s.body)

        def run_for(env):
            for i in range(extent):
                env[name] = i
                body(env)
            env.pop(name, None)

        return run_for
    if isinstance(s, Store):
        name, index = s.buffer.name, [_compile_expr(i) for i in s.indices]
        value, t = _compile_expr(s.value), np.dtype(s.buffer.dtype).type

        def run_store(env):
            env[name][tuple(f(env) for f in index)] = t(value(env))

        return run_store
    if isinstance(s, Prefetch):  # a cache hint: nothing to compute
        return lambda env: None
    if isinstance(s, Allocate):
        buffer, body = s.buffer, _compile_stmt(s.body)

        def run_allocate(env):
            # Fresh memory is filled with NaN (floats) so that reading before writing shows.
            fill = np.nan if np.dtype(buffer.dtype).kind == "f" else 0
            env[buffer.name] = np.full(buffer.shape, fill, buffer.dtype)
            body(env)
            env.pop(buffer.name)

        return run_allocate
    if isinstance(s, IfThenElse):
        cond, then = _compile_expr(s.cond), _compile_stmt(s.then)
        otherwise = _compile_stmt(s.otherwise) if s.otherwise is not None else None

        def run_if(env):
            if cond(env):
                then(env)
            elif otherwise is not None:
                otherwise(env)

        return run_if
    if isinstance(s, Barrier):
        # Threads run one after another here, so a barrier cannot be honoured: GPU schedules
        # that synchronise are checked through their OpenCL twin instead.
        raise TypeError("the interpreter runs one thread at a time: it cannot run a barrier")
    raise TypeError(f"the interpreter cannot run {type(s).__name__}")


def run(func: PrimFunc, args: Mapping[str, np.ndarray]) -> None:
    """Run `func` in place on `args` (buffer name -> array; outputs are written into)."""
    env: Env = {}
    for buffer in func.params:
        if buffer.name not in args:
            raise ValueError(f"{func.name}: no array for parameter {buffer.name!r}")
        array = args[buffer.name]
        if tuple(array.shape) != buffer.shape or array.dtype != np.dtype(buffer.dtype):
            raise ValueError(
                f"{func.name}: parameter {buffer.name!r} wants {buffer.dtype}{list(buffer.shape)},"
                f" got {array.dtype}{list(array.shape)}"
            )
        env[buffer.name] = array
    _compile_stmt(func.body)(env)
