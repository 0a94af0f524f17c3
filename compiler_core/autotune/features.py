"""Fixed-width features of a scheduled loop program, the input of the tuner's cost model.

The vector has the same layout for every workload and every template (it never mentions a
knob), so a model trained on the measurements of one workload ranks the candidates of another.
It describes the program the schedule produced, in the spirit of AutoTVM's itervar/curve
features and Ansor's per-store features:

- `count_*`: operation counts over the whole function, each statement's counts multiplied by
  how often it runs (the product of its enclosing loop extents);
- `heavy_*`, `loop<k>_*`, `acc<k>_*`: the heaviest store (the one doing most of the work,
  normally the accumulation of a GEMM or conv) described in detail: its enclosing loops,
  innermost first, and its buffer accesses, largest footprint first;
- `func_*`: parallelism, vectorization, unrolling, arithmetic intensity, allocations.

Counts, extents and byte sizes enter as log2(1 + x): the cost model splits on thresholds, and
a log scale makes one threshold mean the same thing for a small and a large workload.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections.abc import Iterable, Sequence

import numpy as np

from compiler_core.loop.ir import (
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
    PrimFunc,
    Select,
    Stmt,
    Store,
    Unary,
    Var,
)
from compiler_core.loop.simplify import affine

MAX_LOOPS = 8  # enclosing loops described per store (innermost first); deeper ones are dropped
MAX_ACCESSES = 4  # buffer accesses described per store (largest footprint first)
L1_BYTES = 32 * 1024
L2_BYTES = 1024 * 1024
THREAD_COUNTS = (2, 4, 8, 16, 32)

# --- the layout --------------------------------------------------------------------------------

# Per-expression operation counters (one slot each, in this order).
_OPS = (
    "float_add",  # float add/sub
    "float_mul",
    "float_fma",  # float add/sub with a float mul operand: what LLVM contracts into an FMA
    "float_div",
    "float_other",  # float min/max/pow/fmod/neg/abs/floor...: cheap non-arithmetic float ops
    "math",  # transcendental intrinsics (exp, log, sqrt, tanh, erf, sigmoid, sin...)
    "int_arith",  # index add/sub/mul/min/max/shifts
    "int_divmod",  # index floordiv/mod (left by fuse and split; expensive unless hoisted)
    "compare_logic",  # comparisons and &&/|| (bounds tests of guards and padding)
    "select",
    "cast",
    "global_load",  # loads from global or workspace buffers (memory)
    "local_load",  # loads from local buffers (registers)
)
_N_OPS = len(_OPS)
(F_ADD, F_MUL, F_FMA, F_DIV, F_OTHER, MATH, I_ARITH, I_DIVMOD, LOGIC, SELECT, CAST) = range(11)
G_LOAD, L_LOAD = 11, 12
_FLOAT_OPS = (F_ADD, F_MUL, F_DIV, F_OTHER, MATH)

_COUNT_NAMES = tuple(f"count_{op}" for op in _OPS) + (
    "count_global_store",
    "count_local_store",
    "count_store_exec",  # executed stores of any kind
)

_HEAVY_NAMES = (
    "heavy_log_exec",  # executions of the heaviest store
    "heavy_exec_share",  # its share of all executed stores (0..1)
    "heavy_flops_per_exec",  # float ops (fma = 2) per execution
    "heavy_int_ops_per_exec",  # index ops per execution
    "heavy_loads_per_exec",
    "heavy_accesses",  # distinct buffer accesses (a read-modify-write counts once)
    "heavy_depth",  # enclosing loops
    "heavy_guarded",  # 1 when it sits under an if (a split that does not divide, padding)
    "heavy_log_touched_bytes",  # bytes all its accesses touch over the whole nest
)

# Per enclosing loop of the heaviest store, innermost first (loop0 = innermost).
_LOOP_FIELDS = (
    "log_extent",
    "serial",
    "parallel",  # parallel or GPU-bound
    "vectorized",
    "unrolled",
    "log_inner_iters",  # product of the extents of this loop and the loops inside it
    "reduction",  # the store's indices do not use this loop: it accumulates over it
    "log_inner_bytes",  # bytes all accesses touch inside one iteration of the next outer loop
)

# Per buffer access of the heaviest store, largest footprint first.
_ACCESS_FIELDS = (
    "write",  # the store's own target
    "read",  # loaded (a write and a read: read-modify-write of an accumulator)
    "local",  # a local (register) buffer
    "stride_inner",  # log2(1+|element stride|) along the innermost loop: 0 reuse, 1 unit
    "stride_vec",  # the same along the innermost vectorized loop; -1 when there is none
    "log_bytes",  # bytes touched over the whole nest
    "log_reuse",  # accesses per distinct element touched
    "l1_level",  # inner loops that fit in L1: the first whose footprint exceeds it (depth+1: never)
    "l2_level",  # the same for L2
    "log_buffer_bytes",  # the whole buffer's size
)

_FUNC_NAMES = (
    "func_log_stores",
    "func_log_loops",
    "func_max_depth",
    "func_guarded_exec_share",  # executed stores under an if
    "func_par_log_extent",  # the parallel loop around the heaviest store (0: none)
    *(f"func_par_div{t}" for t in THREAD_COUNTS),  # that extent splits evenly over t threads
    "func_par_exec_share",  # executed stores inside a parallel loop
    "func_parallel_loops",
    "func_vec_width",  # lanes of the heaviest store's vectorized loop (0: none)
    "func_vec_width_max",  # widest vectorized loop anywhere
    "func_vec_exec_share",  # executed stores inside a vectorized loop
    "func_unroll_log_product",  # product of unrolled extents around the heaviest store
    "func_unroll_log_code",  # stores after unrolling (a code-size proxy)
    "func_log_flops",
    "func_log_global_bytes",  # the parameters' bytes: compulsory memory traffic
    "func_log_flops_per_byte",  # arithmetic intensity over the compulsory traffic
    "func_log_touched_bytes",  # bytes touched, summed over stores
    "func_log_accessed_bytes",  # bytes loaded and stored, every execution counted
    "func_log_flops_per_touched_byte",
    "func_local_buffers",
    "func_log_local_bytes",  # register tiles: too large and they spill
    "func_log_workspace_bytes",
)


def _feature_names() -> tuple[str, ...]:
    loops = tuple(f"loop{k}_{f}" for k in range(MAX_LOOPS) for f in _LOOP_FIELDS)
    accesses = tuple(f"acc{k}_{f}" for k in range(MAX_ACCESSES) for f in _ACCESS_FIELDS)
    return _COUNT_NAMES + _HEAVY_NAMES + loops + accesses + _FUNC_NAMES


FEATURE_NAMES: tuple[str, ...] = _feature_names()
FEATURE_COUNT = len(FEATURE_NAMES)
# Names this layout of the vector: records carry it with their features, and a cost model
# learns only from records of the layout it extracts.
FEATURE_SET = hashlib.sha256(",".join(FEATURE_NAMES).encode()).hexdigest()[:12]

# --- expressions -------------------------------------------------------------------------------

_ZERO = (0,) * _N_OPS
_INT_DIVMOD = frozenset(("floordiv", "mod", "div", "fmod"))
_COMPARE = frozenset(("lt", "le", "gt", "ge", "eq", "ne", "and", "or"))
_CHEAP_FLOAT_UNARY = frozenset(("neg", "abs", "floor", "ceil", "round", "sign"))


@functools.lru_cache(maxsize=64)
def _is_float(dtype: str) -> bool:
    return dtype != "bool" and np.dtype(dtype).kind == "f"


@functools.lru_cache(maxsize=64)
def _itemsize(dtype: str) -> int:
    return 1 if dtype == "bool" else np.dtype(dtype).itemsize


def _is_float_mul(e: Expr) -> bool:
    return isinstance(e, Binary) and e.op == "mul" and _is_float(e.a.dtype)


def _binary_slot(e: Binary) -> int:
    if e.op in _COMPARE:
        return LOGIC
    if not _is_float(e.a.dtype):
        return I_DIVMOD if e.op in _INT_DIVMOD else I_ARITH
    return {"add": F_ADD, "sub": F_ADD, "mul": F_MUL, "div": F_DIV}.get(e.op, F_OTHER)


def _own_ops(e: Expr) -> list[tuple[int, int]]:
    """(counter slot, count) for the node itself, not its operands."""
    if isinstance(e, Binary):
        slot = _binary_slot(e)
        if slot == F_ADD and (_is_float_mul(e.a) or _is_float_mul(e.b)):
            return [(F_ADD, 1), (F_FMA, 1)]
        return [(slot, 1)]
    if isinstance(e, Unary):
        if e.op == "not":
            return [(LOGIC, 1)]
        if not _is_float(e.dtype):
            return [(I_ARITH, 1)]
        return [(F_OTHER if e.op in _CHEAP_FLOAT_UNARY else MATH, 1)]
    if isinstance(e, Select):
        return [(SELECT, 1)]
    if isinstance(e, Cast):
        return [(CAST, 1)]
    if isinstance(e, Load):
        return [(L_LOAD if e.buffer.scope == "local" else G_LOAD, 1)]
    return []


def _children(e: Expr) -> tuple[Expr, ...]:
    if isinstance(e, Binary):
        return (e.a, e.b)
    if isinstance(e, (Unary, Cast)):
        return (e.a,)
    if isinstance(e, Select):
        return (e.cond, e.a, e.b)
    if isinstance(e, Load):
        return e.indices
    return ()


def _evaluate(e: Expr, env: dict[str, int]) -> int | None:
    """An index expression's value with loop variables from `env` (absent ones are 0); None
    when it reads data (a gather's index)."""
    if isinstance(e, Const):
        return int(e.value)
    if isinstance(e, Var):
        return env.get(e.name, 0)
    if isinstance(e, Binary):
        a, b = _evaluate(e.a, env), _evaluate(e.b, env)
        if a is None or b is None:
            return None
        return _int_op(e.op, a, b)
    if isinstance(e, Cast):
        return _evaluate(e.a, env)
    if isinstance(e, Select):
        cond = _evaluate(e.cond, env)
        return None if cond is None else _evaluate(e.a if cond else e.b, env)
    return None


def _int_op(op: str, a: int, b: int) -> int | None:
    if op in ("floordiv", "div"):
        return a // b if b else None
    if op in ("mod", "fmod"):
        return a % b if b else None
    ops = {
        "add": a + b,
        "sub": a - b,
        "mul": a * b,
        "min": min(a, b),
        "max": max(a, b),
        "lt": int(a < b),
        "le": int(a <= b),
        "gt": int(a > b),
        "ge": int(a >= b),
        "eq": int(a == b),
        "ne": int(a != b),
        "and": int(bool(a and b)),
        "or": int(bool(a or b)),
    }
    return ops.get(op)


# --- the walk ----------------------------------------------------------------------------------


@dataclasses.dataclass
class _Dim:
    """One index of an access: its affine form when it has one, else the loops it uses."""

    expr: Expr
    form: tuple[dict[str, int], int] | None
    names: frozenset[str]


@dataclasses.dataclass
class _Access:
    buffer: Buffer
    dims: tuple[_Dim, ...]
    write: bool = False
    read: bool = False


@dataclasses.dataclass
class _StoreInfo:
    store: Store
    loops: tuple[For, ...]  # outermost first
    executions: int
    ops: tuple[int, ...]  # per execution, guards' conditions included
    accesses: list[_Access]
    guarded: bool

    @property
    def flops(self) -> int:
        return sum(self.ops[k] for k in _FLOAT_OPS)

    @property
    def loads(self) -> int:
        return self.ops[G_LOAD] + self.ops[L_LOAD]

    @property
    def cost(self) -> int:
        return self.executions * (1 + self.flops + self.loads)


class _Walker:
    """One pass over the function. Expression results are cached by node identity for the
    duration of one extraction (the tree keeps every node alive, so ids stay unique), so a
    subtree shared by several statements is analysed once."""

    def __init__(self) -> None:
        self.stores: list[_StoreInfo] = []
        self.allocations: list[Buffer] = []
        self.loop_count = 0
        self.vector_widths: list[int] = []
        self.parallel_loops = 0
        self._exprs: dict[int, tuple[tuple[int, ...], tuple[Load, ...]]] = {}
        self._dims: dict[int, _Dim] = {}

    def expr(self, e: Expr) -> tuple[tuple[int, ...], tuple[Load, ...]]:
        """Operation counts and the loads of `e` (a load's own index loads included)."""
        cached = self._exprs.get(id(e))
        if cached is not None:
            return cached
        counts = list(_ZERO)
        loads: tuple[Load, ...] = (e,) if isinstance(e, Load) else ()
        for slot, n in _own_ops(e):
            counts[slot] += n
        for child in _children(e):
            child_counts, child_loads = self.expr(child)
            for k, n in enumerate(child_counts):
                counts[k] += n
            loads += child_loads
        result = (tuple(counts), loads)
        self._exprs[id(e)] = result
        return result

    def dim(self, e: Expr) -> _Dim:
        cached = self._dims.get(id(e))
        if cached is None:
            form = affine(e)
            names = frozenset(form[0]) if form is not None else self._var_names(e)
            cached = self._dims[id(e)] = _Dim(e, form, names)
        return cached

    def _var_names(self, e: Expr) -> frozenset[str]:
        if isinstance(e, Var):
            return frozenset((e.name,))
        names: frozenset[str] = frozenset()
        for child in _children(e):
            names |= self._var_names(child)
        return names

    def stmt(self, s: Stmt, loops: tuple[For, ...], guard_ops: tuple[int, ...], guarded: bool):
        if isinstance(s, Block):
            for child in s.stmts:
                self.stmt(child, loops, guard_ops, guarded)
        elif isinstance(s, For):
            self.loop_count += 1
            if s.kind == ForKind.VECTORIZED:
                self.vector_widths.append(s.extent)
            elif s.kind in (ForKind.PARALLEL, ForKind.THREAD_BINDING):
                self.parallel_loops += 1
            self.stmt(s.body, (*loops, s), guard_ops, guarded)
        elif isinstance(s, Allocate):
            self.allocations.append(s.buffer)
            self.stmt(s.body, loops, guard_ops, guarded)
        elif isinstance(s, IfThenElse):
            cond_ops, _ = self.expr(s.cond)
            inner = tuple(a + b for a, b in zip(guard_ops, cond_ops, strict=True))
            self.stmt(s.then, loops, inner, True)
            if s.otherwise is not None:
                self.stmt(s.otherwise, loops, inner, True)
        elif isinstance(s, Store):
            self.store(s, loops, guard_ops, guarded)

    def store(self, s: Store, loops: tuple[For, ...], guard_ops: tuple[int, ...], guarded: bool):
        counts = list(guard_ops)
        loads: tuple[Load, ...] = ()
        for e in (*s.indices, s.value):
            e_counts, e_loads = self.expr(e)
            for k, n in enumerate(e_counts):
                counts[k] += n
            loads += e_loads
        accesses = self.accesses(s, loads)
        executions = math.prod(loop.extent for loop in loops)
        info = _StoreInfo(s, loops, executions, tuple(counts), accesses, guarded)
        self.stores.append(info)

    def accesses(self, s: Store, loads: tuple[Load, ...]) -> list[_Access]:
        """The store's target and its distinct loads; a load of the very element the store
        writes (an accumulator's read-modify-write) joins the write."""
        found: dict[tuple, _Access] = {}
        target = found[(s.buffer.name, s.indices)] = self._access(s.buffer, s.indices)
        target.write = True
        for load in loads:
            key = (load.buffer.name, load.indices)
            access = found.get(key)
            if access is None:
                access = found[key] = self._access(load.buffer, load.indices)
            access.read = True
        return list(found.values())

    def _access(self, buffer: Buffer, indices: tuple[Expr, ...]) -> _Access:
        return _Access(buffer, tuple(self.dim(i) for i in indices))


# --- per-access analysis -----------------------------------------------------------------------


@functools.lru_cache(maxsize=1024)
def _elements(shape: tuple[int, ...]) -> int:
    return math.prod(shape)  # Buffer.size goes through numpy: slow on this hot path


def _nbytes(buffer: Buffer) -> int:
    return _elements(buffer.shape) * _itemsize(buffer.dtype)


@functools.lru_cache(maxsize=1024)
def _row_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for extent in reversed(shape):
        strides.append(step)
        step *= extent
    return tuple(reversed(strides))


def _stride(access: _Access, loop: For | None) -> int:
    """Elements between the accesses of two consecutive iterations of `loop` (at the origin of
    the other loops: fused indices `f // n`, `f % n` step like their inner loop)."""
    if loop is None:
        return 0
    name = loop.var.name
    total = 0
    for dim, row in zip(access.dims, _row_strides(access.buffer.shape), strict=True):
        if name not in dim.names:
            continue
        if dim.form is not None:
            total += dim.form[0].get(name, 0) * row
            continue
        base, step = _evaluate(dim.expr, {}), _evaluate(dim.expr, {name: 1})
        if base is None or step is None:  # data-dependent (a gather): like random access
            return _elements(access.buffer.shape)
        total += (step - base) * row
    return total


def _footprints(access: _Access, inner_first: Sequence[For]) -> list[int]:
    """Distinct elements the access touches inside each loop, innermost first: per index, the
    width of its affine range (overlapping conv windows counted once) or, without a form, the
    product of the extents it uses; each capped at the buffer's extent."""
    shape = access.buffer.shape
    spans = [1] * len(access.dims)
    result = []
    for loop in inner_first:
        name, extent = loop.var.name, loop.extent
        for d, dim in enumerate(access.dims):
            if name not in dim.names:
                continue
            if dim.form is not None:
                spans[d] += abs(dim.form[0].get(name, 0)) * (extent - 1)
            else:
                spans[d] *= extent
        result.append(math.prod(min(s, n) for s, n in zip(spans, shape, strict=True)))
    return result


@dataclasses.dataclass
class _AccessStats:
    access: _Access
    level_bytes: list[int]  # bytes touched inside each loop, innermost first
    touched_bytes: int
    reuse: float


def _access_stats(access: _Access, inner_first: Sequence[For], executions: int) -> _AccessStats:
    itemsize = _itemsize(access.buffer.dtype)
    elements = _footprints(access, inner_first) or [1]
    level_bytes = [n * itemsize for n in elements]
    return _AccessStats(access, level_bytes, level_bytes[-1], executions / elements[-1])


def _cache_level(level_bytes: Sequence[int], capacity: int) -> int:
    """How many inner loops run before the footprint exceeds `capacity` (depth+1: never)."""
    return next((k for k, b in enumerate(level_bytes) if b > capacity), len(level_bytes)) + 1


def _log(x: float) -> float:
    return math.log2(1.0 + max(x, 0.0))


def _access_features(stats: _AccessStats, inner: For | None, vector: For | None) -> list[float]:
    access = stats.access
    vec_stride = _log(abs(_stride(access, vector))) if vector is not None else -1.0
    return [
        float(access.write),
        float(access.read),
        float(access.buffer.scope == "local"),
        _log(abs(_stride(access, inner))),
        vec_stride,
        _log(stats.touched_bytes),
        _log(stats.reuse),
        float(_cache_level(stats.level_bytes, L1_BYTES)),
        float(_cache_level(stats.level_bytes, L2_BYTES)),
        _log(_nbytes(access.buffer)),
    ]


# --- per-store blocks --------------------------------------------------------------------------


def _kind_onehot(kind: ForKind) -> list[float]:
    parallel = kind in (ForKind.PARALLEL, ForKind.THREAD_BINDING)
    return [
        float(kind == ForKind.SERIAL),
        float(parallel),
        float(kind == ForKind.VECTORIZED),
        float(kind == ForKind.UNROLLED),
    ]


def _loop_block(info: _StoreInfo, stats: Sequence[_AccessStats]) -> list[float]:
    inner_first = info.loops[::-1]
    written = set().union(*(d.names for d in info.accesses[0].dims))
    features: list[float] = []
    iters = 1
    for k, loop in enumerate(inner_first[:MAX_LOOPS]):
        iters *= loop.extent
        inner_bytes = sum(s.level_bytes[k] for s in stats)
        features += [_log(loop.extent), *_kind_onehot(loop.kind), _log(iters)]
        features += [float(loop.var.name not in written), _log(inner_bytes)]
    return _pad(features, MAX_LOOPS * len(_LOOP_FIELDS))


def _access_block(info: _StoreInfo, stats: Sequence[_AccessStats]) -> list[float]:
    inner = info.loops[-1] if info.loops else None
    vector = next((lp for lp in reversed(info.loops) if lp.kind == ForKind.VECTORIZED), None)
    largest = sorted(stats, key=lambda s: -s.touched_bytes)[:MAX_ACCESSES]
    features: list[float] = []
    for s in largest:
        features += _access_features(s, inner, vector)
    return _pad(features, MAX_ACCESSES * len(_ACCESS_FIELDS))


def _pad(features: list[float], width: int) -> list[float]:
    return features + [0.0] * (width - len(features))


def _heavy_block(info: _StoreInfo, total_exec: int, touched: int) -> list[float]:
    int_ops = info.ops[I_ARITH] + info.ops[I_DIVMOD]
    return [
        _log(info.executions),
        info.executions / max(total_exec, 1),
        _log(info.flops),
        _log(int_ops),
        _log(info.loads),
        float(len(info.accesses)),
        float(len(info.loops)),
        float(info.guarded),
        _log(touched),
    ]


# --- whole-function blocks ---------------------------------------------------------------------


def _count_block(stores: Sequence[_StoreInfo]) -> list[float]:
    totals = [0] * (_N_OPS + 3)
    for info in stores:
        for k, n in enumerate(info.ops):
            totals[k] += n * info.executions
        local = info.store.buffer.scope == "local"
        totals[_N_OPS + int(local)] += info.executions
        totals[_N_OPS + 2] += info.executions
    return [_log(x) for x in totals]


def _enclosing(info: _StoreInfo, kinds: tuple[ForKind, ...]) -> list[For]:
    return [loop for loop in info.loops if loop.kind in kinds]


def _exec_share(stores: Sequence[_StoreInfo], kinds: tuple[ForKind, ...], total: int) -> float:
    inside = sum(info.executions for info in stores if _enclosing(info, kinds))
    return inside / max(total, 1)


def _func_block(
    func: PrimFunc, walker: _Walker, heavy: _StoreInfo, all_stats: Sequence[list[_AccessStats]]
) -> list[float]:
    stores = walker.stores
    total_exec = sum(info.executions for info in stores)
    parallel_kinds = (ForKind.PARALLEL, ForKind.THREAD_BINDING)
    par = _enclosing(heavy, parallel_kinds)
    par_extent = par[0].extent if par else 0
    vec = _enclosing(heavy, (ForKind.VECTORIZED,))
    unrolled = math.prod(loop.extent for loop in _enclosing(heavy, (ForKind.UNROLLED,)))
    code = sum(
        math.prod(loop.extent for loop in _enclosing(info, (ForKind.UNROLLED,))) for info in stores
    )
    flops = sum(info.flops * info.executions for info in stores)
    global_bytes = sum(_nbytes(p) for p in func.params)
    touched = sum(s.touched_bytes for stats in all_stats for s in stats)
    accessed = sum(
        info.executions * sum(_itemsize(a.buffer.dtype) for a in info.accesses) for info in stores
    )
    local = [b for b in walker.allocations if b.scope == "local"]
    workspace = sum(_nbytes(b) for b in walker.allocations if b.scope == "workspace")
    guarded = sum(info.executions for info in stores if info.guarded)
    return [
        _log(len(stores)),
        _log(walker.loop_count),
        float(max((len(info.loops) for info in stores), default=0)),
        guarded / max(total_exec, 1),
        _log(par_extent),
        *(float(par_extent > 0 and par_extent % t == 0) for t in THREAD_COUNTS),
        _exec_share(stores, parallel_kinds, total_exec),
        float(walker.parallel_loops),
        float(vec[-1].extent if vec else 0),
        float(max(walker.vector_widths, default=0)),
        _exec_share(stores, (ForKind.VECTORIZED,), total_exec),
        _log(unrolled),
        _log(code),
        _log(flops),
        _log(global_bytes),
        _log(flops / max(global_bytes, 1)),
        _log(touched),
        _log(accessed),
        _log(flops / max(touched, 1)),
        float(len(local)),
        _log(sum(_nbytes(b) for b in local)),
        _log(workspace),
    ]


# --- entry points ------------------------------------------------------------------------------


def extract(func: PrimFunc) -> np.ndarray:
    """The feature vector of one scheduled function: float32, shape (FEATURE_COUNT,)."""
    walker = _Walker()
    walker.stmt(func.body, (), _ZERO, False)
    if not walker.stores:  # an empty kernel: nothing runs
        return np.zeros(FEATURE_COUNT, dtype=np.float32)
    all_stats = [
        [_access_stats(a, info.loops[::-1], info.executions) for a in info.accesses]
        for info in walker.stores
    ]
    heavy_index = max(range(len(walker.stores)), key=lambda k: walker.stores[k].cost)
    heavy, heavy_stats = walker.stores[heavy_index], all_stats[heavy_index]
    total_exec = sum(info.executions for info in walker.stores)
    features = [
        *_count_block(walker.stores),
        *_heavy_block(heavy, total_exec, sum(s.touched_bytes for s in heavy_stats)),
        *_loop_block(heavy, heavy_stats),
        *_access_block(heavy, heavy_stats),
        *_func_block(func, walker, heavy, all_stats),
    ]
    return np.asarray(features, dtype=np.float32)


def extract_many(funcs: Iterable[PrimFunc]) -> np.ndarray:
    """Feature vectors of several functions: float32, shape (n, FEATURE_COUNT)."""
    rows = [extract(func) for func in funcs]
    if not rows:
        return np.zeros((0, FEATURE_COUNT), dtype=np.float32)
    return np.stack(rows)
