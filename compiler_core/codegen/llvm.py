"""Loop IR -> LLVM IR (llvmlite), for x86 CPUs.

Every `PrimFunc` becomes `void name(ptr p0, ptr p1, ...)` over its buffers (row-major, dense).
The renderer follows the loop kinds the schedule chose and decides nothing itself:

- serial loops become counted loops; unrolled loops are emitted once per iteration;
- a vectorized loop of L iterations is emitted once, on <L x T> values: an access whose flat
  index moves by one per lane becomes a vector load/store, one that does not move becomes a
  scalar broadcast, anything else is assembled lane by lane (or gathered);
- an unrolled loop of L iterations around such a vector loop that only copies across (its
  load contiguous along the unrolled loop, its store along the vector loop: a layout
  transform's tile of pixels x channels) is emitted as L vector loads, an L x L transpose in
  registers and L vector stores (`_transposed_tile`);
- a parallel loop is outlined into a worker that Kiln's thread pool (`kiln_parallel`,
  codegen/kiln_pool.c) runs on the caller and its threads; they claim contiguous chunks (a
  few per thread, `kiln_claim`), each thread first from its own home range of the loop, so
  consecutive loops over the same rows keep each row on one core, and a thread the OS
  preempts on a busy machine holds up one chunk, not half the loop, since the others take
  over its home;
- local buffers are stack arrays (LLVM promotes fully unrolled tiles to registers), workspace
  buffers are heap blocks from the process's cache of them (codegen/kiln_workspace.c).

Float arithmetic carries the `contract` fast-math flag, so multiply-adds fuse into FMAs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import llvmlite.ir as ir
import ml_dtypes
import numpy as np

from compiler_core.loop.combiner import (
    ACC,
    TERM,
    folds_over_lanes,
    lane_reduction,
    reduces_over,
)
from compiler_core.loop.ir import (
    INDEX,
    Allocate,
    Binary,
    Block,
    Buffer,
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
from compiler_core.loop.simplify import simplify_expr
from compiler_core.loop.transform import (
    flat_index,
    lane_stride,
    mentions,
    stmt_exprs,
    substitute,
    walk_exprs,
    walk_stmts,
)
from compiler_core.target import Target

# Home ranges a parallel loop's closure has counters for (kiln_pool.c's KILN_HOMES): one a
# thread, up to this many threads; more threads share homes.
POOL_HOMES = 8
# `llvm.prefetch`'s locality for a `Prefetch`: 2 is x86's prefetcht1 (into L2, not L1: the
# lines are a later iteration's, and L1 holds the current one's).
PREFETCH_LOCALITY = 2


class CodegenError(ValueError):
    """A loop-IR construct the LLVM renderer has no rule for (names it)."""


PTR = ir.PointerType()
I1, I8, I32, I64 = ir.IntType(1), ir.IntType(8), ir.IntType(32), ir.IntType(64)
SCALAR_TYPES = {
    "float16": ir.HalfType(),
    "float32": ir.FloatType(),
    "float64": ir.DoubleType(),
    "int64": I64,
    "int32": I32,
    "int16": ir.IntType(16),
    "int8": I8,
    "uint64": I64,
    "uint32": I32,
    "uint16": ir.IntType(16),
    "uint8": I8,
    "bool": I8,  # in memory; i1 in registers
    "bfloat16": ir.IntType(16),  # in memory; float32 rounded to bfloat16 in registers
}
FAST_MATH = ("contract",)
# ln(FLT_MIN): the fast exp returns 0 below it (its bit-built form from -86.99: see
# FunctionEmitter._bit_built_exp).
EXP_FLUSH_BELOW = -87.33654475
# Just past ln(FLT_MAX) (88.7228): the fast exp of anything at or above it overflows to inf.
EXP_CLAMP_ABOVE = 88.75
LOG2_E = 1.4426950408889634
# ln2 in two parts for x - n ln2 (Cody-Waite): the first has 9 significant bits, so n times it
# is exact for every n an exp or a log meets.
LN2_PARTS = (0.693359375, -2.12194440e-4)
# 1.5 * 2^23 + 126: added to x log2 e, rounds it to a whole n and leaves n + 126 in the low
# mantissa bits (see FunctionEmitter._bit_built_exp).
EXP_ROUNDER = 12583038.0
# e^r ~ 1 + c1 r + ... + c5 r^5 on |r| <= ln2 / 2: the coefficients c1..c5 that minimise the
# largest relative error (7.1e-8, a linear program over 6001 Chebyshev points), float32.
EXP_MINIMAX = (
    1.0000001192092896,
    0.499990314245224,
    0.16666938364505768,
    0.04190947115421295,
    0.008324443362653255,
)
# ln x inline (FunctionEmitter._fast_log): below FLT_MIN x is scaled up first; the mantissa
# is taken about sqrt(1/2) (its float32 bits).
FLT_MIN = float(np.finfo(np.float32).tiny)
SQRT_HALF_BITS = 0x3F3504F3
# ln(1 + f) ~ f - f^2/2 + f^3 (p0 + p1 f + ... + p6 f^6) on sqrt(1/2) - 1 <= f < sqrt(2) - 1:
# the p that minimise the largest relative error (2.2e-8; a linear program over 8001
# Chebyshev points), float32.
LOG1P_MINIMAX = (
    0.3333391547203064,
    -0.2500079274177551,
    0.19962149858474731,
    -0.1659555435180664,
    0.14946341514587402,
    -0.14124904572963715,
    0.08409716188907623,
)
# sin and cos inline (FunctionEmitter._sine): 1.5 * 2^23, to round x 2/pi; pi/2 as three
# float32 parts whose sum is pi/2 to 70 bits; and where the inline form gives way to libm
# (j past 2^21, where the rounder and the parts still hold with room to spare).
SINE_ROUNDER = 12582912.0
HALF_PI_PARTS = (1.5707963705062866, -4.371138828673793e-08, -1.7151245100058819e-15)
SINE_INLINE_LIMIT = 2.0**21
# sin r ~ r + r^3 (s0 + s1 r^2 + s2 r^4), cos r ~ 1 - r^2/2 + r^4 (c0 + c1 r^2 + c2 r^4) on
# |r| <= 0.86 (pi/4, and the j one off that float32 2/pi can give near the limit): minimax
# (relative error, a linear program over 6001 Chebyshev points), float32; 2.9e-8 and 3.6e-8.
SIN_MINIMAX = (-0.1666666716337204, 0.008332556113600731, -0.00019533901649992913)
COS_MINIMAX = (0.04166756942868233, -0.0013921060599386692, 2.729845800786279e-05)
# tanh x ~ x + x^3 (p0 + p1 x^2 + ... + p4 x^8) below |x| = 0.55 (FunctionEmitter._fast_tanh):
# minimax for relative error (a linear program over 6001 Chebyshev points), float32, 4.8e-9.
TANH_SERIES_BELOW = 0.55
TANH_MINIMAX = (
    -0.3333333432674408,
    0.13332925736904144,
    -0.05387686565518379,
    0.021143678575754166,
    -0.0063476283103227615,
)
# erf x ~ x (p0 + p1 x^2 + ... + p4 x^8) below |x| = 0.5 (FunctionEmitter._fast_erf): minimax for
# relative error, float32, 5.5e-8.
ERF_SERIES_BELOW = 0.5
ERF_MINIMAX = (
    1.128379225730896,
    -0.37612637877464294,
    0.11283491551876068,
    -0.02680441364645958,
    0.004817485343664885,
)
LLVM_INTRINSICS = {
    "exp": "llvm.exp",
    "log": "llvm.log",
    "sqrt": "llvm.sqrt",
    "abs": "llvm.fabs",
    "floor": "llvm.floor",
    "ceil": "llvm.ceil",
    "round": "llvm.roundeven",
    "sin": "llvm.sin",
    "cos": "llvm.cos",
}
LIBM = {
    name: {"float32": f"{name}f", "bfloat16": f"{name}f", "float64": name}
    for name in (
        "tanh",
        "erf",
        "tan",
        "asin",
        "acos",
        "atan",
        "sinh",
        "cosh",
        "asinh",
        "acosh",
        "atanh",
    )
}


def _is_float(dtype: str) -> bool:
    return dtype in ("float16", "bfloat16", "float32", "float64")


def memory_type(dtype: str) -> ir.Type:
    try:
        return SCALAR_TYPES[dtype]
    except KeyError:
        raise CodegenError(f"no LLVM type for element type {dtype}") from None


UNSIGNED = frozenset({"bool", "uint8", "uint16", "uint32", "uint64"})


def _align(dtype: str) -> int:
    """Vector accesses are only element-aligned: buffers carry no stronger promise."""
    return np.dtype(dtype).itemsize


def _register_type(dtype: str) -> ir.Type:
    if dtype == "bfloat16":
        return ir.FloatType()
    return I1 if dtype == "bool" else memory_type(dtype)


def _like(ty: ir.Type, element: ir.Type) -> ir.Type:
    """`element`, or a vector of it as wide as `ty` is."""
    return ir.VectorType(element, ty.count) if isinstance(ty, ir.VectorType) else element


def _suffix(ty: ir.Type) -> str:
    if isinstance(ty, ir.VectorType):
        return f"v{ty.count}{_suffix(ty.element)}"
    if isinstance(ty, ir.IntType):
        return f"i{ty.width}"
    return {"half": "f16", "float": "f32", "double": "f64"}[str(ty)]


# Element types a masked vector load or store can move (llvm.masked.* on float vectors).
MASKABLE = ("float16", "float32", "float64")
# Lane strides loaded as one masked load of their span and a shuffle (wider strides waste
# more of the span than the scalar loads they replace cost).
STRIDED_LOAD_STRIDES = (2, 3, 4)


def one_vector_load(stride: int, dtype: str) -> bool:
    """Whether lanes `stride` elements apart load as one vector operation: a contiguous load,
    or for a maskable type a masked load and a shuffle (`_strided_load`), not a gather."""
    return stride == 1 or (stride in STRIDED_LOAD_STRIDES and dtype in MASKABLE)


@dataclasses.dataclass
class _Scope:
    values: dict[str, ir.Value]  # loop variables (i64 or <L x i64>)
    buffers: dict[Buffer, ir.Value]  # base pointers
    lanes: int = 1
    vector_var: str | None = None
    mask: ir.Value | None = None  # lanes a lane-dependent guard lets through (<L x i1>)


class FunctionEmitter:
    """Renders one PrimFunc into an llvmlite module."""

    def __init__(self, module: ir.Module, func: PrimFunc, scales_exponents: bool = False):
        self.module = module
        self.func = func
        # Whether `llvm.ldexp` on float32 vectors is one instruction here (AVX-512's vscalefps);
        # elsewhere LLVM calls libm's ldexpf lane by lane, and exp builds 2^n from its bits.
        self.scales_exponents = scales_exponents
        self._worker_count = 0

    # --- module-level helpers -------------------------------------------------------------

    def _declare(self, name: str, ret: ir.Type, args: Sequence[ir.Type]) -> ir.Function:
        existing = self.module.globals.get(name)
        if existing is not None:
            return existing
        return ir.Function(self.module, ir.FunctionType(ret, list(args)), name=name)

    def _intrinsic(self, name: str, ty: ir.Type) -> ir.Function:
        return self._declare(f"{name}.{_suffix(ty)}", ty, [ty])

    # --- entry ----------------------------------------------------------------------------

    def emit(self) -> ir.Function:
        fn_type = ir.FunctionType(ir.VoidType(), [PTR] * len(self.func.params))
        fn = ir.Function(self.module, fn_type, name=self.func.name)
        for arg in fn.args:
            arg.add_attribute("noalias")
        scope = _Scope({}, dict(zip(self.func.params, fn.args, strict=True)))
        self._body(fn, scope, self.func.body, finish=True)
        return fn

    def _body(self, fn: ir.Function, scope: _Scope, body: Stmt, finish: bool) -> ir.IRBuilder:
        entry = fn.append_basic_block("entry")
        self.entry_builder = ir.IRBuilder(entry)
        start = fn.append_basic_block("start")
        builder = ir.IRBuilder(start)
        self._stmt(builder, scope, body)
        if finish:
            builder.ret_void()
        self.entry_builder.branch(start)
        return builder

    # --- statements -----------------------------------------------------------------------

    def _stmt(self, b: ir.IRBuilder, scope: _Scope, s: Stmt) -> None:
        if isinstance(s, Block):
            for child in s.stmts:
                self._stmt(b, scope, child)
        elif isinstance(s, For):
            self._for(b, scope, s)
        elif isinstance(s, Store):
            self._store(b, scope, s)
        elif isinstance(s, Allocate):
            self._allocate(b, scope, s)
        elif isinstance(s, IfThenElse):
            self._if(b, scope, s)
        elif isinstance(s, Prefetch):
            self._prefetch(b, scope, s)
        else:
            raise CodegenError(f"no LLVM rule for statement {type(s).__name__}")

    def _for(self, b: ir.IRBuilder, scope: _Scope, loop: For) -> None:
        if loop.kind == ForKind.PARALLEL:
            self._parallel(b, scope, loop)
        elif loop.kind == ForKind.UNROLLED and scope.lanes == 1 and _transposed_copy(loop):
            self._transposed_tile(b, scope, loop)
        elif loop.kind == ForKind.UNROLLED or (
            loop.kind == ForKind.VECTORIZED and loop.extent == 1
        ):
            for i in range(loop.extent):
                inner = dataclasses.replace(scope, values={**scope.values, loop.var.name: I64(i)})
                self._stmt(b, inner, loop.body)
        elif loop.kind == ForKind.VECTORIZED and self._vectorizable(loop):
            lanes = ir.Constant(ir.VectorType(I64, loop.extent), list(range(loop.extent)))
            inner = dataclasses.replace(
                scope,
                values={**scope.values, loop.var.name: lanes},
                lanes=loop.extent,
                vector_var=loop.var.name,
            )
            self._stmt(b, inner, loop.body)
        elif loop.kind == ForKind.VECTORIZED:  # lane-dependent control flow: one lane at a time
            for i in range(loop.extent):
                inner = dataclasses.replace(scope, values={**scope.values, loop.var.name: I64(i)})
                self._stmt(b, inner, loop.body)
        else:
            self._counted_loop(b, scope, loop, I64(0), I64(loop.extent))

    def _transposed_tile(self, b: ir.IRBuilder, scope: _Scope, loop: For) -> None:
        """An L x L tile copied across (see `_transposed_copy`): L vector loads along the
        unrolled loop (one per lane of the vector loop), transposed in registers, L vector
        stores along the vector loop; not L gathers of L elements each a row apart."""
        vector = loop.body
        (guard, store), lanes = _guarded_store(vector.body), loop.extent
        u, v = loop.var.name, vector.var.name
        indices = ir.Constant(ir.VectorType(I64, lanes), list(range(lanes)))

        def along(vector_var: str, fixed: str, at: int) -> _Scope:
            """`vector_var` across the lanes, `fixed` at one of its iterations."""
            values = {**scope.values, vector_var: indices, fixed: I64(at)}
            return dataclasses.replace(scope, values=values, lanes=lanes, vector_var=vector_var)

        rows = [self._expr(b, along(u, v, j), store.value) for j in range(lanes)]
        for i, column in enumerate(_transpose(b, rows)):
            kind, where = self._access(b, along(v, u, i), store.buffer, store.indices)
            if kind != "contiguous":  # `_transposed_copy` checked the store's lane stride
                raise CodegenError(f"{store.buffer.name}: a tile's store is not contiguous")
            value = self._to_memory(b, column, store.buffer.dtype)
            if guard is None:
                b.store(value, where, align=_align(store.buffer.dtype))
                continue
            column_scope = dataclasses.replace(scope, values={**scope.values, u: I64(i)})
            with b.if_then(self._expr(b, column_scope, guard)):
                b.store(value, where, align=_align(store.buffer.dtype))

    def _counted_loop(self, b, scope, loop: For, start, stop) -> None:
        fn = b.function
        header = fn.append_basic_block(f"{loop.var.name}.header")
        body = fn.append_basic_block(f"{loop.var.name}.body")
        exit_ = fn.append_basic_block(f"{loop.var.name}.exit")
        before = b.block
        b.branch(header)
        b.position_at_end(header)
        index = b.phi(I64, name=loop.var.name)
        index.add_incoming(start, before)
        b.cbranch(b.icmp_signed("<", index, stop), body, exit_)
        b.position_at_end(body)
        inner = dataclasses.replace(scope, values={**scope.values, loop.var.name: index})
        self._stmt(b, inner, loop.body)
        index.add_incoming(b.add(index, I64(1), flags=("nsw",)), b.block)
        b.branch(header)
        b.position_at_end(exit_)

    def _vectorizable(self, loop: For) -> bool:
        for s in walk_stmts(loop.body):
            if (
                isinstance(s, IfThenElse)
                and mentions(s.cond, loop.var.name)
                and not self._maskable(s, loop.var.name)
            ):
                return False
            if (
                isinstance(s, Store)
                and reduces_over(s, loop.var.name)
                and not folds_over_lanes(loop, s)
            ):
                return False
        return True

    def _maskable(self, s: IfThenElse, var: str) -> bool:
        """A lane-dependent guard around one store of consecutive floats whose loads touch
        floats a constant stride apart: it becomes a masked store (and masked loads or
        gathers), as the partial last tile of a GEMM's writeback needs, instead of a loop
        over the lanes."""
        if s.otherwise is not None or not isinstance(s.then, Store):
            return False
        if any(isinstance(x, Load) for x in walk_exprs(s.cond)):
            return False
        store = s.then
        flat = self._flat_index(store.buffer, store.indices)
        if lane_stride(flat, var) != 1 or store.buffer.dtype not in MASKABLE:
            return False
        for load in (x for x in walk_exprs(store.value) if isinstance(x, Load)):
            flat = self._flat_index(load.buffer, load.indices)
            if mentions(flat, var) and (
                lane_stride(flat, var) is None or load.buffer.dtype not in MASKABLE
            ):
                return False
        return True

    def _if(self, b: ir.IRBuilder, scope: _Scope, s: IfThenElse) -> None:
        cond = self._expr(b, scope, s.cond)
        if isinstance(cond.type, ir.VectorType):
            if not self._maskable(s, scope.vector_var):
                raise CodegenError("a lane-dependent condition reached the vector emitter")
            # Masked stores are slow on some CPUs (AMD's vmaskmovps): when every lane passes
            # (all but the last tile of a padded GEMM), store plainly.
            bits = ir.IntType(scope.lanes)
            every = b.icmp_unsigned("==", b.bitcast(cond, bits), ir.Constant(bits, -1))
            with b.if_else(every) as (whole, partial):
                with whole:
                    self._store(b, dataclasses.replace(scope, mask=None), s.then)
                with partial:
                    self._store(b, dataclasses.replace(scope, mask=cond), s.then)
            return
        if s.otherwise is None:
            with b.if_then(cond):
                self._stmt(b, scope, s.then)
        else:
            with b.if_else(cond) as (then, otherwise):
                with then:
                    self._stmt(b, scope, s.then)
                with otherwise:
                    self._stmt(b, scope, s.otherwise)

    def _stack_array(self, element: ir.Type, count: int, name: str) -> ir.Value:
        """An entry-block alloca, as an opaque pointer (every pointer here is opaque, so
        llvmlite's typed-pointer checks never see mixed kinds)."""
        pointer = self.entry_builder.alloca(element, size=I64(count), name=name)
        # llvmlite still types alloca results (`float*`); the printed IR is `ptr` either way,
        # and a bitcast between pointers is folded away by llvmlite, so retype the value.
        pointer.type = PTR
        return pointer

    def _allocate(self, b: ir.IRBuilder, scope: _Scope, s: Allocate) -> None:
        element = memory_type(s.buffer.dtype)
        if s.buffer.scope == "local":
            # Stack arrays live in the entry block so that LLVM can promote them to registers.
            pointer = self._stack_array(element, s.buffer.size, s.buffer.name)
            inner = dataclasses.replace(scope, buffers={**scope.buffers, s.buffer: pointer})
            self._stmt(b, inner, s.body)
            return
        # From the process's cache of workspace blocks (codegen/kiln_workspace.c), not malloc:
        # a block of megabytes freed to malloc goes back to the OS, and the next call would
        # fault its pages in again.
        take = self._declare("kiln_workspace_take", PTR, [I64])
        give = self._declare("kiln_workspace_give", ir.VoidType(), [PTR])
        pointer = b.call(take, [I64(max(s.buffer.nbytes, 1))], name=s.buffer.name)
        inner = dataclasses.replace(scope, buffers={**scope.buffers, s.buffer: pointer})
        self._stmt(b, inner, s.body)
        b.call(give, [pointer])

    # --- memory ---------------------------------------------------------------------------

    def _flat_index(self, buffer: Buffer, indices: Sequence[Expr]) -> Expr:
        return flat_index(buffer, indices)

    def _access(
        self, b, scope: _Scope, buffer: Buffer, indices, strided: bool = False, load: bool = False
    ):
        """(kind, pointer or per-lane pointers): 'scalar', 'contiguous' or 'lanes', or with
        `strided` (a load outside a masked context) 'stride2'..'stride4' (see
        `_strided_load`), or for a `load` of lanes a constant stride apart 'gather' (a vector
        of pointers)."""
        flat = self._flat_index(buffer, indices)
        base = scope.buffers.get(buffer)
        if base is None:
            raise CodegenError(f"buffer {buffer.name!r} is not in scope")
        element = memory_type(buffer.dtype)
        if scope.lanes == 1 or not mentions(flat, scope.vector_var):
            # Evaluated as a scalar: a load inside the index (a length read from memory, say)
            # would otherwise come back splat across the lanes and make the address a vector.
            scalar = dataclasses.replace(scope, lanes=1, vector_var=None, mask=None)
            return "scalar", b.gep(base, [self._expr(b, scalar, flat)], source_etype=element)
        stride = lane_stride(flat, scope.vector_var)

        def first_lane():  # the address of lane 0's element
            lane0 = dataclasses.replace(scope, values={**scope.values, scope.vector_var: I64(0)})
            lane0 = dataclasses.replace(lane0, lanes=1, vector_var=None)
            return b.gep(base, [self._expr(b, lane0, flat)], source_etype=element)

        if stride == 1 or (strided and stride in STRIDED_LOAD_STRIDES and buffer.dtype in MASKABLE):
            return ("contiguous" if stride == 1 else f"stride{stride}"), first_lane()
        if load and stride is not None and buffer.dtype in MASKABLE:
            # Lanes a constant stride apart: one gather (AVX-512's vgather; LLVM splits it
            # into scalar loads where gathers are slow), not a load and an insert per lane
            # (a transposed read: keys laid out for Q K^T, say).
            start = first_lane()
            offsets = ir.Constant(
                ir.VectorType(I64, scope.lanes), [k * stride for k in range(scope.lanes)]
            )
            lanes = b.gep(start, [offsets], source_etype=element)
            lanes.type = ir.VectorType(PTR, scope.lanes)  # llvmlite types a vector GEP as ptr
            return "gather", lanes
        pointers = []
        for lane in range(scope.lanes):
            one = dataclasses.replace(
                scope,
                values={**scope.values, scope.vector_var: I64(lane)},
                lanes=1,
                vector_var=None,
            )
            pointers.append(b.gep(base, [self._expr(b, one, flat)], source_etype=element))
        return "lanes", pointers

    def _load(self, b, scope: _Scope, e: Load) -> ir.Value:
        kind, where = self._access(
            b, scope, e.buffer, e.indices, strided=scope.mask is None, load=True
        )
        element = memory_type(e.buffer.dtype)
        if kind == "scalar":
            value = self._from_memory(b, b.load(where, typ=element), e.dtype)
            return self._splat(b, value, scope.lanes) if scope.lanes > 1 else value
        vector_type = ir.VectorType(element, scope.lanes)
        if kind == "contiguous" and scope.mask is not None and e.buffer.scope != "local":
            masked_load = self._declare(
                f"llvm.masked.load.{_suffix(vector_type)}.p0",
                vector_type,
                [PTR, I32, scope.mask.type, vector_type],
            )
            zero = ir.Constant(vector_type, None)
            align = I32(_align(e.buffer.dtype))
            loaded = b.call(masked_load, [where, align, scope.mask, zero])
            return self._from_memory(b, loaded, e.dtype)
        if kind == "contiguous":
            loaded = b.load(where, typ=vector_type, align=_align(e.buffer.dtype))
            return self._from_memory(b, loaded, e.dtype)
        if kind.startswith("stride"):
            return self._from_memory(b, self._strided_load(b, scope, e, where, kind), e.dtype)
        if kind == "gather":
            mask_type = ir.VectorType(ir.IntType(1), scope.lanes)
            gather = self._declare(
                f"llvm.masked.gather.{_suffix(vector_type)}.v{scope.lanes}p0",
                vector_type,
                [where.type, I32, mask_type, vector_type],
            )
            everywhere = ir.Constant(mask_type, [True] * scope.lanes)
            mask = everywhere if scope.mask is None else scope.mask
            align = I32(_align(e.buffer.dtype))
            loaded = b.call(gather, [where, align, mask, ir.Constant(vector_type, None)])
            return self._from_memory(b, loaded, e.dtype)
        result = ir.Constant(vector_type, ir.Undefined)
        for lane, pointer in enumerate(where):
            result = b.insert_element(result, b.load(pointer, typ=element), I32(lane))
        return self._from_memory(b, result, e.dtype)

    def _strided_load(self, b, scope: _Scope, e: Load, where, kind: str) -> ir.Value:
        """Lanes `stride` elements apart (a stride-2 conv's or pool's window, an im2col
        column): one masked load of the span they cover and a shuffle that keeps every
        stride-th element, instead of a scalar load and an insert per lane. The mask stops at
        the last lane's element, so nothing past it is read."""
        stride, lanes = int(kind.removeprefix("stride")), scope.lanes
        element = memory_type(e.buffer.dtype)
        wide = ir.VectorType(element, stride * lanes)
        last = stride * (lanes - 1)
        mask = ir.Constant(
            ir.VectorType(ir.IntType(1), stride * lanes), [k <= last for k in range(stride * lanes)]
        )
        masked_load = self._declare(
            f"llvm.masked.load.{_suffix(wide)}.p0", wide, [PTR, I32, mask.type, wide]
        )
        loaded = b.call(
            masked_load, [where, I32(_align(e.buffer.dtype)), mask, ir.Constant(wide, None)]
        )
        picks = ir.Constant(ir.VectorType(I32, lanes), [k * stride for k in range(lanes)])
        return b.shuffle_vector(loaded, ir.Constant(wide, ir.Undefined), picks)

    def _store(self, b, scope: _Scope, s: Store) -> None:
        if scope.lanes > 1 and reduces_over(s, scope.vector_var):
            self._lane_fold(b, scope, s)
            return
        value = self._expr(b, scope, s.value)
        kind, where = self._access(b, scope, s.buffer, s.indices)
        value = self._to_memory(b, value, s.buffer.dtype)
        vector = isinstance(value.type, ir.VectorType)
        if kind == "scalar":
            if vector:  # every lane writes the same element: the last lane wins
                value = b.extract_element(value, I32(scope.lanes - 1))
            b.store(value, where)
        elif kind == "contiguous":
            if not vector:
                value = self._splat(b, value, scope.lanes)
            if scope.mask is not None:
                masked_store = self._declare(
                    f"llvm.masked.store.{_suffix(value.type)}.p0",
                    ir.VoidType(),
                    [value.type, PTR, I32, scope.mask.type],
                )
                b.call(masked_store, [value, where, I32(_align(s.buffer.dtype)), scope.mask])
                return
            b.store(value, where, align=_align(s.buffer.dtype))
        else:
            for lane, pointer in enumerate(where):
                lane_value = b.extract_element(value, I32(lane)) if vector else value
                b.store(lane_value, pointer)

    def _prefetch(self, b, scope: _Scope, s: Prefetch) -> None:
        """`prefetcht1` on x86: the line into L2, where a kernel's weights are reused from."""
        if scope.vector_var is not None:  # one line for all lanes: the first lane's
            scope = dataclasses.replace(
                scope, values={**scope.values, scope.vector_var: I64(0)}, lanes=1, vector_var=None
            )
        base = scope.buffers.get(s.buffer)
        if base is None:
            raise CodegenError(f"buffer {s.buffer.name!r} is not in scope")
        element = memory_type(s.buffer.dtype)
        where = b.gep(base, [self._expr(b, scope, s.offset)], source_etype=element)
        prefetch = self._declare("llvm.prefetch.p0", ir.VoidType(), [PTR, I32, I32, I32])
        read, data = I32(0), I32(1)
        b.call(prefetch, [where, read, I32(PREFETCH_LOCALITY), data])

    def _lane_fold(self, b, scope: _Scope, s: Store) -> None:
        """acc = combine(acc, term(lane)) over a vectorized loop's lanes (`folds_over_lanes`
        checked the combiner): the term as one vector, halved log2(lanes) times by combining its two
        halves (a tree, not a chain of one lane at a time), then into the element once."""
        fold = lane_reduction(s, scope.vector_var)
        values = self._expr(b, scope, fold.term)
        if not isinstance(values.type, ir.VectorType):
            values = self._splat(b, values, scope.lanes)
        width = scope.lanes
        while width % 2 == 0:
            half = width // 2
            undefined = ir.Constant(values.type, ir.Undefined)
            low, high = (
                b.shuffle_vector(
                    values,
                    undefined,
                    ir.Constant(ir.VectorType(I32, half), list(range(k, k + half))),
                )
                for k in (0, half)
            )
            values = self._combine(b, scope, fold.combine, low, high)
            width = half
        scalar = dataclasses.replace(scope, lanes=1, vector_var=None, mask=None)
        total = b.extract_element(values, I32(0))
        for lane in range(1, width):  # an odd lane count: the last few one at a time
            total = self._combine(
                b, scalar, fold.combine, total, b.extract_element(values, I32(lane))
            )
        acc = self._expr(b, scalar, Load(s.buffer, s.indices))
        value = self._combine(b, scalar, fold.combine, acc, total)
        _, where = self._access(b, scalar, s.buffer, s.indices)
        b.store(self._to_memory(b, value, s.buffer.dtype), where)

    def _combine(self, b, scope: _Scope, combine: Expr, acc, term) -> ir.Value:
        values = {**scope.values, ACC: acc, TERM: term}
        return self._expr(b, dataclasses.replace(scope, values=values), combine)

    def _from_memory(self, b, value, dtype):
        if dtype == "bool":
            return b.icmp_unsigned("!=", value, ir.Constant(value.type, 0))
        if dtype == "bfloat16":  # the high half of a float32
            wide = b.shl(
                b.zext(value, _like(value.type, I32)), self._splat_const(_like(value.type, I32), 16)
            )
            return b.bitcast(wide, _like(value.type, ir.FloatType()))
        return value

    def _to_memory(self, b, value, dtype):
        if dtype == "bool":
            return b.zext(value, _like(value.type, I8))
        if dtype == "bfloat16":
            bits = b.bitcast(self._round_bfloat16(b, value), _like(value.type, I32))
            high = b.lshr(bits, self._splat_const(bits.type, 16))
            return b.trunc(high, _like(value.type, ir.IntType(16)))
        return value

    def _round_bfloat16(self, b, value):
        """float32 -> the nearest bfloat16 (ties to even), still as float32. NaN stays NaN."""
        int_type = _like(value.type, I32)
        bits = b.bitcast(value, int_type)
        c = functools.partial(self._splat_const, int_type)
        odd = b.and_(b.lshr(bits, c(16)), c(1))
        rounded = b.and_(b.add(bits, b.add(c(0x7FFF), odd)), c(0xFFFF0000 - (1 << 32)))
        is_nan = b.fcmp_unordered("uno", value, value)
        return b.select(is_nan, value, b.bitcast(rounded, value.type))

    # --- expressions ----------------------------------------------------------------------

    def _splat(self, b, value: ir.Value, lanes: int) -> ir.Value:
        vector_type = ir.VectorType(value.type, lanes)
        single = b.insert_element(ir.Constant(vector_type, ir.Undefined), value, I32(0))
        return b.shuffle_vector(
            single,
            ir.Constant(vector_type, ir.Undefined),
            ir.Constant(ir.VectorType(I32, lanes), [0] * lanes),
        )

    def _match(self, b, x: ir.Value, y: ir.Value):
        xv, yv = isinstance(x.type, ir.VectorType), isinstance(y.type, ir.VectorType)
        if xv and not yv:
            y = self._splat(b, y, x.type.count)
        elif yv and not xv:
            x = self._splat(b, x, y.type.count)
        return x, y

    def _const(self, e: Const) -> ir.Value:
        ty = _register_type(e.dtype)
        if e.dtype == "bfloat16":
            return ir.Constant(ty, float(np.float32(ml_dtypes.bfloat16(e.value))))
        return ir.Constant(ty, int(e.value) if e.dtype == "bool" else e.value)

    def _expr(self, b: ir.IRBuilder, scope: _Scope, e: Expr) -> ir.Value:
        if isinstance(e, Var):
            if e.name not in scope.values:
                raise CodegenError(f"variable {e.name!r} is not bound")
            return scope.values[e.name]
        if isinstance(e, Const):
            return self._const(e)
        if isinstance(e, Load):
            return self._load(b, scope, e)
        if isinstance(e, Binary):
            x, y = self._match(b, self._expr(b, scope, e.a), self._expr(b, scope, e.b))
            return self._binary(b, e.op, e.a.dtype, x, y)
        if isinstance(e, Unary):
            return self._unary(b, e.op, e.dtype, self._expr(b, scope, e.a))
        if isinstance(e, Select):
            known = _static_truth(scope, e.cond)
            if known is not None:  # a select on an unrolled loop's index: emit one branch
                return self._expr(b, scope, e.a if known else e.b)
            guarded = self._guarded_load(b, scope, e)
            if guarded is not None:
                return guarded
            cond = self._expr(b, scope, e.cond)
            x, y = self._match(b, self._expr(b, scope, e.a), self._expr(b, scope, e.b))
            if isinstance(x.type, ir.VectorType) and not isinstance(cond.type, ir.VectorType):
                cond = self._splat(b, cond, x.type.count)
            elif isinstance(cond.type, ir.VectorType) and not isinstance(x.type, ir.VectorType):
                x, y = self._splat(b, x, cond.type.count), self._splat(b, y, cond.type.count)
            return b.select(cond, x, y)
        if isinstance(e, Cast):
            return self._cast(b, e.a.dtype, e.dtype, self._expr(b, scope, e.a))
        raise CodegenError(f"no LLVM rule for expression {type(e).__name__}")

    def _guarded_load(self, b, scope: _Scope, e: Select) -> ir.Value | None:
        """A padded read, select(inside, x[clamp(s)], fill), vectorized along s: the lanes the
        condition lets through load x[s] itself as one masked load (the others touch no
        memory), where the clamps would make every lane a load of its own. None where the
        select is not of that form."""
        if scope.lanes == 1 or not isinstance(e.a, Load) or e.a.buffer.scope == "local":
            return None
        if not mentions(e.cond, scope.vector_var) or e.a.buffer.dtype not in MASKABLE:
            return None
        load = _unclamped(e.a, e.cond)
        flat = self._flat_index(load.buffer, load.indices)
        if load is e.a or lane_stride(flat, scope.vector_var) != 1:
            return None
        cond = self._expr(b, scope, e.cond)
        loaded = self._load(b, dataclasses.replace(scope, mask=cond), load)
        fill = self._expr(b, scope, e.b)
        if not isinstance(fill.type, ir.VectorType):
            fill = self._splat(b, fill, scope.lanes)
        return b.select(cond, loaded, fill)

    def _binary(self, b, op: str, dtype: str, x, y) -> ir.Value:
        def compare_ints(kind: str, predicate: str, lhs, rhs):
            # Booleans and unsigned types order as unsigned (in i1, true is -1 when signed).
            if kind in UNSIGNED:
                return b.icmp_unsigned(predicate, lhs, rhs)
            return b.icmp_signed(predicate, lhs, rhs)

        if _is_float(dtype):
            table = {"add": b.fadd, "sub": b.fsub, "mul": b.fmul, "div": b.fdiv}
            if op in table:
                return table[op](x, y, flags=FAST_MATH)
            if op in ("min", "max"):
                name = "llvm.minnum" if op == "min" else "llvm.maxnum"
                fn = self._declare(f"{name}.{_suffix(x.type)}", x.type, [x.type, x.type])
                return b.call(fn, [x, y])
            compare = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
            if op in compare:
                if op == "ne":  # NaN != anything is true, as in IEEE and numpy
                    return b.fcmp_unordered("!=", x, y)
                return b.fcmp_ordered(compare[op], x, y)
            if op == "pow":
                fn = self._declare(f"llvm.pow.{_suffix(x.type)}", x.type, [x.type, x.type])
                return b.call(fn, [x, y])
            if op == "fmod":  # C's fmod: the sign of the dividend
                return b.frem(x, y)
            if op == "mod":  # Python's mod: the sign of the divisor
                r = b.frem(x, y)
                zero = (
                    ir.Constant(x.type, 0.0)
                    if not isinstance(x.type, ir.VectorType)
                    else ir.Constant(x.type, [0.0] * x.type.count)
                )
                fix = b.and_(
                    b.fcmp_ordered("!=", r, zero),
                    b.xor(b.fcmp_ordered("<", r, zero), b.fcmp_ordered("<", y, zero)),
                )
                return b.select(fix, b.fadd(r, y), r)
        else:
            if op == "add":
                return b.add(x, y)
            if op == "sub":
                return b.sub(x, y)
            if op == "mul":
                return b.mul(x, y)
            if op == "div":  # integer division truncates toward zero
                return b.udiv(x, y) if dtype in UNSIGNED else b.sdiv(x, y)
            if op == "fmod":
                return b.urem(x, y) if dtype in UNSIGNED else b.srem(x, y)
            if op in ("shl", "shr"):
                return self._shift(b, op, dtype, x, y)
            if op == "xor":
                return b.xor(x, y)
            if op == "bitand":
                return b.and_(x, y)
            if op == "bitor":
                return b.or_(x, y)
            if op in ("floordiv", "mod"):
                return self._floor_divmod(b, op, x, y)
            if op == "pow":  # integer powers through double: exact for the values that fit
                wide = (
                    ir.DoubleType()
                    if not isinstance(x.type, ir.VectorType)
                    else ir.VectorType(ir.DoubleType(), x.type.count)
                )
                base = b.uitofp(x, wide) if dtype in UNSIGNED else b.sitofp(x, wide)
                exponent = b.sitofp(y, wide)
                fn = self._declare(f"llvm.pow.{_suffix(wide)}", wide, [wide, wide])
                return b.fptosi(b.call(fn, [base, exponent]), x.type)
            if op in ("min", "max"):
                pick = compare_ints(dtype, "<" if op == "min" else ">", x, y)
                return b.select(pick, x, y)
            compare = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
            if op in compare:
                return compare_ints(dtype, compare[op], x, y)
            if op == "and":
                return b.and_(x, y)
            if op == "or":
                return b.or_(x, y)
        raise CodegenError(f"no LLVM rule for {op} on {dtype}")

    def _shift(self, b, op, dtype, x, y):
        """Shifts defined for every amount (LLVM leaves out-of-range amounts undefined):
        a negative or too-large amount shifts everything out (a signed right shift leaves the
        sign)."""
        scalar = x.type.element if isinstance(x.type, ir.VectorType) else x.type
        width = scalar.width

        def const(value):
            if isinstance(x.type, ir.VectorType):
                return ir.Constant(x.type, [value] * x.type.count)
            return ir.Constant(x.type, value)

        # Unsigned comparison: a negative amount reads as a huge one.
        too_far = b.icmp_unsigned(">=", y, const(width))
        if op == "shl":
            return b.select(too_far, const(0), b.shl(x, b.select(too_far, const(0), y)))
        if dtype in UNSIGNED:
            return b.select(too_far, const(0), b.lshr(x, b.select(too_far, const(0), y)))
        return b.ashr(x, b.select(too_far, const(width - 1), y))

    def _floor_divmod(self, b, op, x, y):
        # Python (floor) semantics; index arithmetic is non-negative in practice, but the
        # meaning must not depend on that.
        quotient, remainder = b.sdiv(x, y), b.srem(x, y)
        zero = ir.Constant(x.type, 0)
        adjust = b.and_(
            b.icmp_signed("!=", remainder, zero),
            b.icmp_signed("!=", b.icmp_signed("<", remainder, zero), b.icmp_signed("<", y, zero)),
        )
        if op == "mod":
            return b.select(adjust, b.add(remainder, y), remainder)
        return b.select(adjust, b.sub(quotient, ir.Constant(x.type, 1)), quotient)

    def _unary(self, b, op: str, dtype: str, x) -> ir.Value:
        if op == "neg":
            return b.fneg(x, flags=FAST_MATH) if _is_float(dtype) else b.neg(x)
        if op == "not":
            return b.not_(x)
        if not _is_float(dtype):
            raise CodegenError(f"no LLVM rule for {op} on {dtype}")
        if dtype == "float16" and (op in VECTOR_MATH or op in LIBM):
            # In float32 and rounded back (within half an ulp of float16): the inline forms
            # are float32's, libm has no half functions, and LLVM would widen each lane for a
            # call (Exp over [64, 4096] float16 ran 10x float32's).
            wide = b.fpext(x, _like(x.type, ir.FloatType()))
            return b.fptrunc(self._unary(b, op, "float32", wide), x.type)
        if op in VECTOR_MATH and dtype in ("float32", "bfloat16"):  # float32 registers
            return VECTOR_MATH[op](self, b, x)
        if op in LLVM_INTRINSICS:
            return b.call(self._intrinsic(LLVM_INTRINSICS[op], x.type), [x], fastmath=FAST_MATH)
        if op == "sign":
            zero = self._splat_const(x.type, 0.0)
            positive = b.uitofp(b.fcmp_ordered(">", x, zero), x.type)
            negative = b.uitofp(b.fcmp_ordered("<", x, zero), x.type)
            return b.fsub(positive, negative)
        if op == "rsqrt":
            root = b.call(self._intrinsic("llvm.sqrt", x.type), [x])
            return b.fdiv(ir.Constant(x.type, 1.0), root, flags=FAST_MATH)
        if op == "sigmoid":
            exp = b.call(self._intrinsic("llvm.exp", x.type), [b.fneg(x)])
            one = ir.Constant(x.type, 1.0)
            return b.fdiv(one, b.fadd(one, exp, flags=FAST_MATH), flags=FAST_MATH)
        if op in LIBM:
            scalar = _register_type(dtype)  # bfloat16 lanes are float32 registers
            fn = self._declare(LIBM[op][dtype], scalar, [scalar])
            if not isinstance(x.type, ir.VectorType):
                return b.call(fn, [x])
            result = ir.Constant(x.type, ir.Undefined)
            for lane in range(x.type.count):
                value = b.call(fn, [b.extract_element(x, I32(lane))])
                result = b.insert_element(result, value, I32(lane))
            return result
        raise CodegenError(f"no LLVM rule for unary {op}")

    def _cast(self, b, src: str, dst: str, x) -> ir.Value:
        if src == dst:
            return x
        # bfloat16 values are float32 in registers (arithmetic runs in float32 and rounds
        # when stored, as ONNX Runtime's bfloat16 kernels do): cast as float32, then round.
        if src == "bfloat16":
            return self._cast(b, "float32", dst, x)
        if dst == "bfloat16":
            return self._round_bfloat16(b, self._cast(b, src, "float32", x))
        lanes = x.type.count if isinstance(x.type, ir.VectorType) else None

        def ty(dtype):
            scalar = _register_type(dtype)
            return ir.VectorType(scalar, lanes) if lanes else scalar

        if _is_float(src) and _is_float(dst):
            wider = np.dtype(dst).itemsize > np.dtype(src).itemsize
            return b.fpext(x, ty(dst)) if wider else b.fptrunc(x, ty(dst))
        if _is_float(src):
            if dst == "bool":
                return b.fcmp_unordered("!=", x, ir.Constant(x.type, 0.0))
            return b.fptoui(x, ty(dst)) if dst in UNSIGNED else b.fptosi(x, ty(dst))
        if _is_float(dst):
            return b.uitofp(x, ty(dst)) if src in UNSIGNED else b.sitofp(x, ty(dst))
        if dst == "bool":
            return b.icmp_signed("!=", x, ir.Constant(x.type, 0))
        src_bits, dst_bits = x.type.width if not lanes else x.type.element.width, ty(dst)
        dst_width = dst_bits.width if not lanes else dst_bits.element.width
        if dst_width > src_bits:
            unsigned = src in UNSIGNED
            return b.zext(x, ty(dst)) if unsigned else b.sext(x, ty(dst))
        return b.trunc(x, ty(dst)) if dst_width < src_bits else x

    # --- float32 math in registers ---------------------------------------------------------
    # exp, log, sin, cos, erf, tanh and sigmoid are expanded inline (range reduction +
    # minimax polynomials), so they vectorize: LLVM would otherwise call libm once per lane.
    # Accurate to a few float32 ulps (sin and cos to 2e-7 absolute, erf past 0.5 to 3e-7).

    def _splat_const(self, ty: ir.Type, value: float) -> ir.Value:
        if isinstance(ty, ir.VectorType):
            return ir.Constant(ty, [value] * ty.count)
        return ir.Constant(ty, value)

    def _fast_exp(self, b, x):
        if self.scales_exponents and isinstance(x.type, ir.VectorType):
            return self._scaled_exp(b, x)
        return self._bit_built_exp(b, x)

    def _bit_built_exp(self, b, x):
        """e^x as 2 p(r) 2^(n-1), with n = round(x log2 e), |r| <= ln2 / 2 and 2^(n-1) built
        from its bits: x log2 e + EXP_ROUNDER rounds to a whole number whose low mantissa
        bits are n + 126, and shifted by 23 they are 2^(n-1)'s exponent field. The halved
        scale stays a float for the n = 128 of x up to ln(FLT_MAX) (the doubled polynomial
        carries the 2, exactly), and the product overflows to inf past it. 14 instructions a
        vector (the floor, a clamp of n, a conversion and a NaN blend fewer than before).
        Below ln(2^-125.5) (-86.99) the field is 0 and so is the result (the AVX-512 form
        keeps e^x down to FLT_MIN, -87.34)."""
        c = functools.partial(self._splat_const, x.type)
        # Subnormal operands cost a microcode assist per FMA on x86 (~70x on the GEMM after a
        # masked softmax: P V of a causal attention, 36 ms against 0.5): far below, the
        # exponent field wraps, and the result is set to 0 (exp(-inf) included).
        underflow = b.fcmp_ordered("<", x, c(EXP_FLUSH_BELOW))
        # +inf must not reach r (inf - inf); NaN passes the compare and stays NaN throughout
        # (no float-to-int conversion, which would make it poison).
        x = b.select(b.fcmp_ordered(">", x, c(EXP_CLAMP_ABOVE)), c(EXP_CLAMP_ABOVE), x)
        rounded = b.fadd(b.fmul(x, c(LOG2_E), flags=FAST_MATH), c(EXP_ROUNDER), flags=FAST_MATH)
        n = b.fsub(rounded, c(EXP_ROUNDER))
        r = self._reduce(b, x, n, LN2_PARTS)
        poly = self._horner(b, r, [2 * k for k in (*EXP_MINIMAX[::-1], 1.0)])
        int_type = _like(x.type, I32)
        bits = b.shl(b.bitcast(rounded, int_type), self._int_splat(int_type, 23))
        scaled = b.fmul(poly, b.bitcast(bits, x.type), flags=FAST_MATH)
        return b.select(underflow, c(0.0), scaled)

    def _scaled_exp(self, b, x):
        """e^x as p(r) 2^n with n = round(x log2 e), |r| <= ln2 / 2 (the minimax polynomial,
        within 3.1 float32 ulps, exp(0) exactly 1), and 2^n applied by vscalefps, which
        overflows to inf and scales down to FLT_MIN exactly: 13 vector instructions (the
        earlier form with a bit-built 2^n, a floor, two clamps and a NaN blend took 21 and
        was 136 ulps off just under ln(FLT_MAX), where its r reached 0.72). 0 below
        ln(FLT_MIN), inf past ln(FLT_MAX), NaN kept."""
        c = functools.partial(self._splat_const, x.type)
        underflow = b.fcmp_ordered("<", x, c(EXP_FLUSH_BELOW))
        # +inf must not reach r (inf - inf); NaN passes the compare and stays NaN.
        above = b.fcmp_ordered(">", x, c(EXP_CLAMP_ABOVE))
        x = b.select(above, c(EXP_CLAMP_ABOVE), x)
        scaled = b.fmul(x, c(LOG2_E), flags=FAST_MATH)
        n = b.call(self._intrinsic("llvm.roundeven", x.type), [scaled])
        r = self._reduce(b, x, n, LN2_PARTS)
        poly = self._horner(b, r, (*EXP_MINIMAX[::-1], 1.0))
        return b.select(underflow, c(0.0), self._scale_by_power_of_2(b, poly, n))

    def _scale_by_power_of_2(self, b, x, n):
        """x 2^n for a whole float n. A zmm vector takes vscalefps's own intrinsic, which
        reads n as a float; `llvm.ldexp` (any width) wants it as an int, and LLVM then
        converts it there and back (two more instructions a vector)."""
        if x.type.count == 16:
            scalef = self._declare(
                "llvm.x86.avx512.mask.scalef.ps.512", x.type, [x.type] * 3 + [ir.IntType(16), I32]
            )
            return b.call(scalef, [x, n, x, ir.IntType(16)(-1), I32(4)])  # 4: MXCSR rounding
        int_type = ir.VectorType(I32, x.type.count)
        name = f"llvm.ldexp.{_suffix(x.type)}.{_suffix(int_type)}"
        ldexp = self._declare(name, x.type, [x.type, int_type])
        # n is whole and within +-2^31 (x is clamped above; far below, the select drops it).
        return b.call(ldexp, [x, b.fptosi(n, int_type)])

    def _reduce(self, b, x, n, parts):
        """x - n (sum of `parts`), one FMA a part, the largest first (Cody-Waite): a constant
        such as ln2 or pi/2 split so that n times each leading part is exact."""
        c = functools.partial(self._splat_const, x.type)
        for part in parts:
            x = b.fsub(x, b.fmul(n, c(part), flags=FAST_MATH), flags=FAST_MATH)
        return x

    def _horner(self, b, x, coefficients):
        """The polynomial with `coefficients` (the highest power's first) at x, an FMA a
        coefficient after the first."""
        c = functools.partial(self._splat_const, x.type)
        value = c(coefficients[0])
        for coefficient in coefficients[1:]:
            value = b.fadd(b.fmul(value, x, flags=FAST_MATH), c(coefficient), flags=FAST_MATH)
        return value

    @staticmethod
    def _int_splat(ty: ir.Type, value: int) -> ir.Value:
        if isinstance(ty, ir.VectorType):
            return ir.Constant(ty, [value] * ty.count)
        return ir.Constant(ty, value)

    def _fast_log(self, b, x):
        """ln x = e ln2 + ln(1 + f), x = (1 + f) 2^e with 1 + f in [sqrt(1/2), sqrt(2)),
        taken from x's bits; ln(1 + f) = f - f^2/2 + f^3 P(f), P the minimax LOG1P_MINIMAX:
        within 1.8 float32 ulps, about 28 vector instructions where libm's logf is called
        once per lane (Mish and Softplus ran 10x a Sigmoid of the same size so). Subnormal
        x are scaled up first; ln 0 = -inf, ln inf = inf, NaN for x < 0 and NaN."""
        c = functools.partial(self._splat_const, x.type)
        int_type = _like(x.type, I32)
        i = functools.partial(self._int_splat, int_type)
        tiny = b.fcmp_ordered("<", x, c(FLT_MIN))
        normal = b.select(tiny, b.fmul(x, c(2.0**23)), x)
        # Less the bits of sqrt(1/2), the exponent field counts from there: the mantissa
        # bits put back over sqrt(1/2)'s give 1 + f in [sqrt(1/2), sqrt(2)).
        shifted = b.sub(b.bitcast(normal, int_type), i(SQRT_HALF_BITS))
        exponent = b.sitofp(b.ashr(shifted, i(23)), x.type)
        exponent = b.fsub(exponent, b.select(tiny, c(23.0), c(0.0)))
        mantissa = b.add(b.and_(shifted, i(0x7FFFFF)), i(SQRT_HALF_BITS))
        f = b.fsub(b.bitcast(mantissa, x.type), c(1.0))
        poly = self._horner(b, f, LOG1P_MINIMAX[::-1])
        square = b.fmul(f, f)
        head = b.fadd(b.fmul(square, c(-0.5), flags=FAST_MATH), f, flags=FAST_MATH)
        y = b.fadd(b.fmul(poly, b.fmul(square, f), flags=FAST_MATH), head, flags=FAST_MATH)
        # + e ln2 in its two parts, the larger last (e times its 9 bits is exact)
        for part in LN2_PARTS[::-1]:
            y = b.fadd(b.fmul(exponent, c(part), flags=FAST_MATH), y, flags=FAST_MATH)
        y = b.select(b.fcmp_ordered("==", x, c(math.inf)), c(math.inf), y)
        y = b.select(b.fcmp_ordered("==", x, c(0.0)), c(-math.inf), y)
        return b.select(b.fcmp_unordered("<", x, c(0.0)), c(math.nan), y)

    def _fast_sin(self, b, x):
        return self._sine(b, x, quarter_turns=0, libm="llvm.sin")

    def _fast_cos(self, b, x):
        return self._sine(b, x, quarter_turns=1, libm="llvm.cos")

    def _sine(self, b, x, quarter_turns: int, libm: str):
        """sin(x + quarter_turns pi/2) from r = x - j pi/2, j = round(x 2/pi), |r| <= pi/4
        (pi/2 in three float32 parts, each step an FMA): sin r or cos r by j's parity (the
        minimax SIN_MINIMAX / COS_MINIMAX, 4e-8 relative), negated for j's second bit. Within
        2e-7 absolute up to |x| = SINE_INLINE_LIMIT; a vector with a lane past it takes
        libm's sinf / cosf lane by lane (exact reduction), as every vector did before (Sin
        at [2048, 64] ran 1.9x ORT so)."""
        c = functools.partial(self._splat_const, x.type)
        int_type = _like(x.type, I32)
        i = functools.partial(self._int_splat, int_type)
        # x 2/pi + 1.5 * 2^23 rounds to a whole j and holds it in the low mantissa bits.
        rounded = b.fadd(
            b.fmul(x, c(2 / math.pi), flags=FAST_MATH), c(SINE_ROUNDER), flags=FAST_MATH
        )
        j = b.fsub(rounded, c(SINE_ROUNDER))
        r = self._reduce(b, x, j, HALF_PI_PARTS)
        square = b.fmul(r, r)
        sine = self._horner(b, square, SIN_MINIMAX[::-1])
        sine = b.fadd(b.fmul(sine, b.fmul(square, r), flags=FAST_MATH), r, flags=FAST_MATH)
        cosine = self._horner(b, square, COS_MINIMAX[::-1])
        head = b.fadd(b.fmul(square, c(-0.5), flags=FAST_MATH), c(1.0), flags=FAST_MATH)
        square2 = b.fmul(square, square)
        cosine = b.fadd(b.fmul(cosine, square2, flags=FAST_MATH), head, flags=FAST_MATH)
        quadrant = b.add(b.bitcast(rounded, int_type), i(quarter_turns))
        odd = b.icmp_unsigned("!=", b.and_(quadrant, i(1)), i(0))
        value = b.select(odd, cosine, sine)
        sign = b.shl(b.and_(quadrant, i(2)), i(30))
        fast = b.bitcast(b.xor(b.bitcast(value, int_type), sign), x.type)
        if quarter_turns == 0:  # -0 - j pi/2's negative parts makes +0: sin(-0) is -0
            fast = b.select(b.fcmp_ordered("==", x, c(0.0)), x, fast)
        # Past the limit j no longer fits the rounder's mantissa, nor r the three parts.
        magnitude = b.call(self._intrinsic("llvm.fabs", x.type), [x])
        far = b.fcmp_unordered(">", magnitude, c(SINE_INLINE_LIMIT))  # inf and NaN too
        if isinstance(x.type, ir.VectorType):
            far = b.icmp_unsigned(
                "!=",
                b.bitcast(far, ir.IntType(x.type.count)),
                ir.Constant(ir.IntType(x.type.count), 0),
            )
        before = b.block
        with b.if_then(far, likely=False):
            exact = b.call(self._intrinsic(libm, x.type), [x])
            exact_block = b.block
        merged = b.phi(x.type)
        merged.add_incoming(fast, before)
        merged.add_incoming(exact, exact_block)
        return merged

    def _fast_erf(self, b, x):
        """Abramowitz & Stegun 7.1.26 with an odd extension: 1.5e-7 absolute, which near 0
        (erf x ~ 1.13 x) is thousands of ulps; below |x| = ERF_SERIES_BELOW, x P(x^2) with
        the minimax ERF_MINIMAX (6e-8 relative)."""
        c = functools.partial(self._splat_const, x.type)
        ax = b.call(self._intrinsic("llvm.fabs", x.type), [x])
        t = b.fdiv(c(1.0), b.fadd(c(1.0), b.fmul(c(0.3275911), ax)))
        poly = self._horner(
            b, t, (1.061405429, -1.453152027, 1.421413741, -0.284496736, 0.254829592)
        )
        poly = b.fmul(poly, t)
        decay = self._fast_exp(b, b.fneg(b.fmul(ax, ax)))
        magnitude = b.fsub(c(1.0), b.fmul(poly, decay))
        copysign = self._declare(f"llvm.copysign.{_suffix(x.type)}", x.type, [x.type, x.type])
        far = b.call(copysign, [magnitude, x])
        square = b.fmul(x, x)
        near = b.fmul(x, self._horner(b, square, ERF_MINIMAX[::-1]))
        return b.select(b.fcmp_ordered("<", ax, c(ERF_SERIES_BELOW)), near, far)

    def _fast_tanh(self, b, x):
        """1 - 2 / (e^2x + 1), which is off by about an ulp of 1 (1.2e-7): relatively good
        from |x| = TANH_SERIES_BELOW on, but near 0, where tanh x ~ x, hundreds of ulps
        (tanh(1e-3) 6e-5 off). There x (1 + x^2 P(x^2)) (TANH_MINIMAX, 5e-9 relative) is taken."""
        c = functools.partial(self._splat_const, x.type)
        e = self._fast_exp(b, b.fmul(x, c(2.0)))
        far = b.fsub(c(1.0), b.fdiv(c(2.0), b.fadd(e, c(1.0))))
        square = b.fmul(x, x)
        # x (1 + x^2 P), not x + x^3 P, so that tanh(-0) stays -0 (-0 + 0 would be +0).
        near = b.fmul(x, self._horner(b, square, (*TANH_MINIMAX[::-1], 1.0)))
        magnitude = b.call(self._intrinsic("llvm.fabs", x.type), [x])
        return b.select(b.fcmp_ordered("<", magnitude, c(TANH_SERIES_BELOW)), near, far)

    def _fast_sigmoid(self, b, x):
        c = functools.partial(self._splat_const, x.type)
        return b.fdiv(c(1.0), b.fadd(c(1.0), self._fast_exp(b, b.fneg(x))))

    # --- parallel loops -------------------------------------------------------------------

    def _parallel(self, b: ir.IRBuilder, scope: _Scope, loop: For) -> None:
        """Outline the loop into `worker(ptr closure)` and run it on Kiln's thread pool
        (`kiln_parallel`, codegen/kiln_pool.c, linked into every kernel library)."""
        free_vars = sorted(
            {
                x.name
                for s in walk_stmts(loop.body)
                for e in stmt_exprs(s)
                for x in walk_exprs(e)
                if isinstance(x, Var) and x.name in scope.values
            }
        )
        buffers = [buf for buf in scope.buffers if self._uses_buffer(loop.body, buf)]
        # The last field is the loop's claim counters (kiln_pool.c's kiln_claims).
        claims_type = ir.LiteralStructType([I64, I64, ir.ArrayType(I64, POOL_HOMES)])
        fields = [PTR] * len(buffers) + [I64] * len(free_vars) + [claims_type]
        closure_type = ir.LiteralStructType(fields)
        claims_field = I32(len(fields) - 1)

        self._worker_count += 1
        worker = ir.Function(
            self.module,
            ir.FunctionType(ir.VoidType(), [PTR, I64]),
            name=f"{self.func.name}.parallel{self._worker_count}",
        )
        worker.linkage = "internal"
        saved_entry = self.entry_builder
        wb = self._worker_prologue(worker)
        data, index = worker.args
        values, worker_buffers = {}, {}
        for i, buf in enumerate(buffers):
            slot = wb.gep(data, [I32(0), I32(i)], source_etype=closure_type)
            worker_buffers[buf] = wb.load(slot, typ=PTR)
        for j, name in enumerate(free_vars):
            slot = wb.gep(data, [I32(0), I32(len(buffers) + j)], source_etype=closure_type)
            values[name] = wb.load(slot, typ=I64)
        claims = wb.gep(data, [I32(0), claims_field], source_etype=closure_type)
        # {home, homes visited}: the thread's own home first (kiln_claim).
        cursor = self.entry_builder.alloca(I64, 2, name="cursor")
        wb.store(index, cursor)
        wb.store(I64(0), wb.gep(cursor, [I32(1)], source_etype=I64))
        stop_slot = self.entry_builder.alloca(I64, name="stop")
        claim_fn = self._declare("kiln_claim", I64, [PTR, PTR, PTR])
        claim = worker.append_basic_block("claim")
        work = worker.append_basic_block("work")
        done = worker.append_basic_block("done")
        wb.branch(claim)
        wb.position_at_end(claim)
        start = wb.call(claim_fn, [claims, cursor, stop_slot])
        wb.cbranch(wb.icmp_signed(">=", start, I64(0)), work, done)
        wb.position_at_end(work)
        stop = wb.load(stop_slot, typ=I64)
        inner_scope = _Scope(values, worker_buffers)
        serial = dataclasses.replace(loop, kind=ForKind.SERIAL)
        self._counted_loop(wb, inner_scope, serial, start, stop)
        wb.branch(claim)
        wb.position_at_end(done)
        wb.ret_void()
        self.entry_builder.branch(self._worker_start)
        self.entry_builder = saved_entry

        closure = self._stack_array(closure_type, 1, "closure")
        for i, buf in enumerate(buffers):
            slot = b.gep(closure, [I32(0), I32(i)], source_etype=closure_type)
            b.store(scope.buffers[buf], slot)
        for j, name in enumerate(free_vars):
            slot = b.gep(closure, [I32(0), I32(len(buffers) + j)], source_etype=closure_type)
            b.store(scope.values[name], slot)
        claims = b.gep(closure, [I32(0), claims_field], source_etype=closure_type)
        init = self._declare("kiln_claims_init", ir.VoidType(), [PTR, I64])
        b.call(init, [claims, I64(loop.extent)])
        pool = self._declare("kiln_parallel", ir.VoidType(), [PTR, PTR])
        b.call(pool, [worker, closure])

    def _worker_prologue(self, worker: ir.Function) -> ir.IRBuilder:
        entry = worker.append_basic_block("entry")
        self.entry_builder = ir.IRBuilder(entry)
        self._worker_start = worker.append_basic_block("start")
        return ir.IRBuilder(self._worker_start)

    @staticmethod
    def _uses_buffer(s: Stmt, buffer: Buffer) -> bool:
        for stmt in walk_stmts(s):
            if isinstance(stmt, (Store, Prefetch)) and stmt.buffer == buffer:
                return True
            for e in stmt_exprs(stmt):
                if any(isinstance(x, Load) and x.buffer == buffer for x in walk_exprs(e)):
                    return True
        return False


VECTOR_MATH = {
    "exp": FunctionEmitter._fast_exp,
    "log": FunctionEmitter._fast_log,
    "sin": FunctionEmitter._fast_sin,
    "cos": FunctionEmitter._fast_cos,
    "erf": FunctionEmitter._fast_erf,
    "tanh": FunctionEmitter._fast_tanh,
    "sigmoid": FunctionEmitter._fast_sigmoid,
}


def build_module(funcs: Sequence[PrimFunc], target: Target, name: str = "kiln") -> ir.Module:
    module = ir.Module(name=name)
    module.triple = target.triple
    for func in funcs:
        FunctionEmitter(module, func, scales_exponents=target.scales_exponents).emit()
    return module


def _transposed_copy(loop: For) -> bool:
    """Whether `loop` (unrolled, L iterations) holds only a vector loop of L lanes (L a power of
    two) whose one statement copies across: its store moves by one element per lane of the
    vector loop, and what it stores reads memory along the unrolled loop instead (each load
    that moves moves by one element per iteration of it; one load, at least, not by one per
    lane). NCHW -> NCHW16c tiles 16 pixels x 16 channels so, and back, and a head's keys
    transposed (and scaled) for Q K^T. Computed along the unrolled loop, the stored value is
    the same arithmetic on the same elements: only the lanes it is computed in differ."""
    vector, lanes = loop.body, loop.extent
    if not (isinstance(vector, For) and vector.kind == ForKind.VECTORIZED):
        return False
    if vector.extent != lanes or lanes < 4 or lanes & (lanes - 1):
        return False
    guard, store = _guarded_store(vector.body)
    if store is None or (guard is not None and mentions(guard, vector.var.name)):
        return False
    u, v = loop.var.name, vector.var.name
    if lane_stride(flat_index(store.buffer, store.indices), v) != 1:
        return False
    loads = [x for x in walk_exprs(store.value) if isinstance(x, Load)]
    if any(x.buffer == store.buffer for x in loads):
        return False  # every load is emitted before any store: none may read what one writes
    reads = [flat_index(x.buffer, x.indices) for x in loads]
    moving = [r for r in reads if mentions(r, u) or mentions(r, v)]
    return (
        bool(moving)
        and all(lane_stride(r, u) == 1 for r in moving)
        and any(lane_stride(r, v) != 1 for r in moving)
        and not any(isinstance(x, Load) for r in reads for x in walk_exprs(r))
    )


def _guarded_store(s: Stmt) -> tuple[Expr | None, Store | None]:
    """(condition or None, the store) of a store, or of a store under a one-armed condition
    (the channels of a partial last block: `_transposed_copy` lets it depend on the unrolled
    loop, whose iterations are the tile's columns, not on the lanes); (None, None) else."""
    if isinstance(s, Store):
        return None, s
    if isinstance(s, IfThenElse) and s.otherwise is None and isinstance(s.then, Store):
        return s.cond, s.then
    return None, None


def _transpose(b: ir.IRBuilder, rows: list[ir.Value]) -> list[ir.Value]:
    """The L x L transpose of L vectors (L a power of two): log2(L) rounds of two-input
    shuffles, round k swapping bit k of the row index with bit k of the lane index."""
    lanes, rows = len(rows), list(rows)
    bit = 1
    while bit < lanes:
        low_mask = [c if not c & bit else lanes + (c & ~bit) for c in range(lanes)]
        high_mask = [c | bit if not c & bit else lanes + c for c in range(lanes)]
        for i in (i for i in range(lanes) if not i & bit):
            a, c = rows[i], rows[i | bit]
            rows[i] = b.shuffle_vector(a, c, ir.Constant(ir.VectorType(I32, lanes), low_mask))
            rows[i | bit] = b.shuffle_vector(
                a, c, ir.Constant(ir.VectorType(I32, lanes), high_mask)
            )
        bit <<= 1
    return rows


def _conjuncts(cond: Expr) -> list[Expr]:
    if isinstance(cond, Binary) and cond.op == "and":
        return _conjuncts(cond.a) + _conjuncts(cond.b)
    return [cond]


def _unclamped(load: Load, cond: Expr) -> Load:
    """`load` with each index clamp(s) = max(min(s, n - 1), 0) replaced by s where `cond`
    requires s >= 0 and s < n (so the clamp changes nothing where the condition holds): the
    form of a padded read (`kernels/nn.py:_padded`)."""
    facts = set(_conjuncts(cond))
    indices = []
    for index in load.indices:
        if (
            isinstance(index, Binary)
            and index.op == "max"
            and index.b == Const(0, INDEX)
            and isinstance(index.a, Binary)
            and index.a.op == "min"
            and isinstance(index.a.b, Const)
        ):
            s, last = index.a.a, index.a.b.value
            if {Binary("ge", s, Const(0, INDEX)), Binary("lt", s, Const(last + 1, INDEX))} <= facts:
                index = s
        indices.append(index)
    if indices == list(load.indices):
        return load
    return dataclasses.replace(load, indices=tuple(indices))


def _static_truth(scope: _Scope, cond: Expr) -> bool | None:
    """Whether a condition holds, when it depends only on constants and unrolled loops'
    indices (bound to integer constants): the loop IR's own constant folding decides it."""
    known = {
        name: Const(int(value.constant), INDEX)
        for name, value in scope.values.items()
        if isinstance(value, ir.Constant) and isinstance(value.type, ir.IntType)
    }
    folded = simplify_expr(substitute(cond, known))
    return bool(folded.value) if isinstance(folded, Const) else None
