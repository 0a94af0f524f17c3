"""Schedule primitives as serializable records, applied to loop IR by one function.

A schedule is a list of records (`Split("c_i0", 4)`, `Vectorize("c_i1_i")`, ...). `apply`
replays them in order on a lowered function and raises `ScheduleError`, naming the record,
for anything illegal. Loops are named by their variables; a split of `x` makes `x_o` and
`x_i`, a fuse of `x` and `y` makes `x_y_f`. A record names the loops it makes (`Split.outer`,
`Fuse.fused`, `CacheWrite.store_loop(d)`...): its primitive names them so, and a schedule that
addresses them uses those names, not names rebuilt by hand.
"""

from __future__ import annotations

import contextvars
import dataclasses
import json
import math
from collections.abc import Callable, Sequence

import numpy as np

from compiler_core.loop.combiner import folds_over_lanes
from compiler_core.loop.ir import (
    BINDINGS,
    BLOCK_TAGS,
    INDEX,
    THREAD_TAGS,
    Allocate,
    Barrier,
    Binary,
    Block,
    Buffer,
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
    minimum,
    seq,
)
from compiler_core.loop.simplify import (
    affine,
    bounds,
    max_value,
    simplify_expr,
    simplify_stmt,
    value_range,
)
from compiler_core.loop.transform import (
    find_loop,
    flat_index,
    loads_of,
    loops_above,
    map_expr,
    map_stmt,
    replace_stmt,
    stmt_exprs,
    substitute,
    walk_exprs,
    walk_stmts,
)
from compiler_core.loop.verify import verify


class ScheduleError(ValueError):
    """A schedule record that cannot be applied; says which and why."""


class _Chunked:
    """The loops a split of `self.loop` into chunks makes: one over the (whole) chunks and one
    inside a chunk."""

    loop: str

    @property
    def outer(self) -> str:
        """The loop over the chunks."""
        return f"{self.loop}_o"

    @property
    def inner(self) -> str:
        """The loop inside a chunk."""
        return f"{self.loop}_i"


@dataclasses.dataclass(frozen=True)
class Split(_Chunked):
    loop: str
    factor: int


@dataclasses.dataclass(frozen=True)
class SplitOverlap(_Chunked):
    """Split `loop` into `loop_o` x `loop_i` over its whole `factor`-sized chunks, and cover
    the remainder with one more chunk of `tail` iterations (`factor` when 0), `loop_t`, that
    ends at the loop's end (it may overlap the last whole chunk): a row of 197 is 24 vectors
    and a vector at 189, not a scalar tail; a GEMM's 197 columns are six tiles of 32 and one
    of 16 at column 181. Loops inside the tail chunk take the suffix `_t` (`rk` -> `rk_t`),
    so that later records address each copy. Overlapped iterations run twice: each must
    write its own elements, and anything it reads of them it must first have written itself
    (a reduction's initial value)."""

    loop: str
    factor: int
    tail: int = 0

    @property
    def tail_loop(self) -> str:
        """The loop over the tail chunk."""
        return self.in_tail(self.loop)

    def in_tail(self, loop: str) -> str:
        """The name of `loop`, a loop inside the split one, in the tail chunk's copy."""
        return f"{loop}_t"


@dataclasses.dataclass(frozen=True)
class Reorder:
    loops: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Fuse:
    outer: str
    inner: str

    @property
    def fused(self) -> str:
        """The loop that replaces the two."""
        return f"{self.outer}_{self.inner}_f"


@dataclasses.dataclass(frozen=True)
class Vectorize:
    loop: str


@dataclasses.dataclass(frozen=True)
class Unroll:
    loop: str


@dataclasses.dataclass(frozen=True)
class Parallel:
    loop: str


@dataclasses.dataclass(frozen=True)
class PrefetchNext:
    """Bring what the next iteration of `loop` will read of the parameter `buffer` into L2
    while this iteration runs: the lines of that slice are prefetched a few at a time at the
    top of every iteration of `at` (a loop inside `loop`), spread evenly over this
    iteration's runs of `at`. Each iteration of `loop` must read an affine slice of the
    buffer that moves by a fixed stride (a blocked conv's weights per chunk of output
    channels): inside a whole model the slice then comes from L2, not memory, as a kernel
    timed alone finds it."""

    buffer: str
    loop: str
    at: str


@dataclasses.dataclass(frozen=True)
class ComputeInline:
    stage: str


@dataclasses.dataclass(frozen=True)
class ReverseComputeInline:
    """Fold a pure consumer stage (an epilogue: bias, residual add, relu...) into the stores
    of the stage it reads (one per nest computing it), so the epilogue runs on the value
    before it is stored."""

    stage: str


# ComputeAt shrinks a workspace stage to the region one iteration computes, on the stack of
# the loop's thread, when that region is at most this big (L1-sized).
MAX_LOCAL_BYTES = 32 * 1024


@dataclasses.dataclass(frozen=True)
class ComputeAt:
    """Compute `stage` inside `loop`, just the region one iteration of the loop reads. The
    region is shrunk to a stack buffer of the loop's thread when it holds at most
    `local_bytes` (L1-sized by default; a fused producer's tile of rows may ask for L2)."""

    stage: str
    loop: str
    local_bytes: int = MAX_LOCAL_BYTES

    def moved(self, loop: str) -> str:
        """The name of `loop`, a spatial loop of the stage's own nest, once moved inside
        `self.loop` (it then walks the region one iteration reads)."""
        return f"{loop}_at"


@dataclasses.dataclass(frozen=True)
class CacheWrite:
    """Accumulate the part of `stage` computed inside `loop` in a local buffer (registers),
    and store it to memory once, after `loop`. The buffer is `{stage}{suffix}_local`, its fill
    and store loops `{stage}{suffix}_init{d}` and `_wb{d}`: a stage computed by two nests (a
    GEMM's whole tiles and its tail tile) caches each under its own `suffix`.

    `accumulate`: the reduction also runs over loops outside `loop` (a GEMM's K blocks): each
    visit starts from the partial sums the earlier ones stored (the initial value on the
    first, its reload loops `_rl{d}`), so the stage's buffer holds partial sums until the
    last. Without it such a loop is an error: the cache would hold a part of the sum only."""

    stage: str
    loop: str
    suffix: str = ""
    accumulate: bool = False

    @property
    def local(self) -> str:
        """The name of the local buffer."""
        return f"{self.stage}{self.suffix}_local"

    def init_loop(self, d: int) -> str:
        """The loop of the buffer's fill with the initial value over the tile's axis `d`."""
        return self._tile_loop("init", d)

    def reload_loop(self, d: int) -> str:
        """The loop of the reload of the partial sums (`accumulate`) over the axis `d`."""
        return self._tile_loop("rl", d)

    def store_loop(self, d: int) -> str:
        """The loop of the store of the buffer to memory over the tile's axis `d`."""
        return self._tile_loop("wb", d)

    def _tile_loop(self, label: str, d: int) -> str:
        return f"{self.stage}{self.suffix}_{label}{d}"


@dataclasses.dataclass(frozen=True)
class Bind:
    """GPU: run the iterations of `loop` as the blocks or threads named by `thread`
    (`blockIdx.x` ... `threadIdx.z`)."""

    loop: str
    thread: str


@dataclasses.dataclass(frozen=True)
class CacheRead:
    """GPU: stage the part of `buffer` that one iteration of `loop` reads, for every thread of
    the block, in shared memory: the block's threads copy it cooperatively at the top of the
    iteration, a barrier publishes it, the iteration reads the copy, and a second barrier
    keeps the next iteration's copy from overwriting what a slower thread still reads."""

    buffer: str
    loop: str


@dataclasses.dataclass(frozen=True)
class CrossThreadReduce:
    """GPU: one block per output element of the reduction `stage` (its spatial loops become
    blockIdx.x); each of the block's `threads` threads folds a strided share of the reduction
    in a register (consecutive threads read consecutive elements), then the partial results
    are combined in shared memory by a tree that halves each step, barrier-separated, and
    thread 0 stores the result."""

    stage: str
    threads: int


Record = (
    Split
    | SplitOverlap
    | Reorder
    | Fuse
    | Vectorize
    | Unroll
    | Parallel
    | ComputeInline
    | ReverseComputeInline
    | ComputeAt
    | CacheWrite
    | Bind
    | CacheRead
    | CrossThreadReduce
    | PrefetchNext
)
RECORD_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        Split,
        SplitOverlap,
        Reorder,
        Fuse,
        Vectorize,
        Unroll,
        Parallel,
        ComputeInline,
        ReverseComputeInline,
        ComputeAt,
        CacheWrite,
        Bind,
        CacheRead,
        CrossThreadReduce,
        PrefetchNext,
    )
}
MAX_VECTOR_LANES = 64
MAX_UNROLL = 256


def to_json(schedule: Sequence[Record]) -> str:
    return json.dumps([{"primitive": type(r).__name__, **dataclasses.asdict(r)} for r in schedule])


def from_json(text: str) -> list[Record]:
    records = []
    for entry in json.loads(text):
        entry = dict(entry)
        kind = entry.pop("primitive", None)
        if kind not in RECORD_TYPES:
            raise ScheduleError(f"unknown schedule primitive {kind!r}")
        if "loops" in entry:
            entry["loops"] = tuple(entry["loops"])
        records.append(RECORD_TYPES[kind](**entry))
    return records


# --- helpers -----------------------------------------------------------------------------------


def _loop(func: PrimFunc, name: str, record) -> For:
    loop = find_loop(func.body, name)
    if loop is None:
        loops = [s.var.name for s in walk_stmts(func.body) if isinstance(s, For)]
        raise ScheduleError(f"{record}: no loop {name!r} (loops: {', '.join(loops)})")
    return loop


def _fresh_loop_name(func: PrimFunc, name: str, record) -> Var:
    if find_loop(func.body, name) is not None:
        raise ScheduleError(f"{record}: a loop named {name!r} already exists")
    return Var(name)


def _with_body(func: PrimFunc, body: Stmt) -> PrimFunc:
    return PrimFunc(func.name, func.params, simplify_stmt(body, cache=_SIMPLIFIED.get()))


# The simplifier's cache while `apply` replays a schedule (each record re-simplifies the
# whole function; most of it is what the last record left simplified).
_SIMPLIFIED: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "kiln_simplified", default=None
)


def _stores_depend_on(loop: For, lane_folds: bool = False) -> bool:
    """Every store inside `loop` writes an element that depends on the loop variable, so
    iterations write disjoint elements (what parallel and vector execution need). With
    `lane_folds` (vector execution), a store may also be a reduction over the loop that
    folds its lanes in any order (`loop.combiner.folds_over_lanes`)."""
    private = {s.buffer for s in walk_stmts(loop.body) if isinstance(s, Allocate)}
    stores = [s for s in walk_stmts(loop.body) if isinstance(s, Store) and s.buffer not in private]
    for store in stores:
        names = {x.name for i in store.indices for x in walk_exprs(i) if isinstance(x, Var)}
        if loop.var.name not in names and not (lane_folds and folds_over_lanes(loop, store)):
            return False
    return bool(stores)


# --- primitives --------------------------------------------------------------------------------


def split(func: PrimFunc, r: Split) -> PrimFunc:
    loop = _loop(func, r.loop, r)
    if not r.factor >= 1:
        raise ScheduleError(f"{r}: factor must be positive")
    if r.factor > loop.extent:
        raise ScheduleError(f"{r}: factor {r.factor} exceeds the extent {loop.extent}")
    outer = _fresh_loop_name(func, r.outer, r)
    inner = _fresh_loop_name(func, r.inner, r)
    index = Binary("add", Binary("mul", outer, Const(r.factor, INDEX)), inner)
    body = substitute(loop.body, {r.loop: index})
    if loop.extent % r.factor:
        body = IfThenElse(Binary("lt", index, Const(loop.extent, INDEX)), body)
    outer_extent = -(-loop.extent // r.factor)
    new = For(outer, outer_extent, For(inner, r.factor, body), loop.kind)
    return _with_body(func, replace_stmt(func.body, loop, new))


def split_overlap(func: PrimFunc, r: SplitOverlap) -> PrimFunc:
    loop = _loop(func, r.loop, r)
    if not 1 <= r.factor <= loop.extent:
        raise ScheduleError(f"{r}: factor must be in 1..{loop.extent}")
    size = r.tail or r.factor
    remainder = loop.extent % r.factor
    if remainder and not remainder <= size <= loop.extent:
        raise ScheduleError(f"{r}: the tail must cover the {remainder} left (at most the loop)")
    overlap = remainder and size > remainder
    if overlap and not _rerunnable(loop):
        raise ScheduleError(
            f"{r}: an iteration reads what it did not write; overlap would repeat it"
        )
    outer = _fresh_loop_name(func, r.outer, r)
    inner = _fresh_loop_name(func, r.inner, r)
    tail = _fresh_loop_name(func, r.tail_loop, r)
    whole = loop.extent // r.factor
    index = Binary("add", Binary("mul", outer, Const(r.factor, INDEX)), inner)
    new: Stmt = For(outer, whole, For(inner, r.factor, substitute(loop.body, {r.loop: index})))
    if remainder:
        start = Const(loop.extent - size, INDEX)
        body = substitute(loop.body, {r.loop: Binary("add", start, tail)})
        body = _renamed_loops(body, r.in_tail)
        for name in {s.var.name for s in walk_stmts(body) if isinstance(s, For)}:
            _fresh_loop_name(func, name, r)
        new = seq(new, For(tail, size, body))
    return _with_body(func, replace_stmt(func.body, loop, new))


def _renamed_loops(body: Stmt, renamed: Callable[[str], str]) -> Stmt:
    """`body` with every loop it holds renamed `renamed(name)` (and every use of its var)."""
    names = {s.var.name for s in walk_stmts(body) if isinstance(s, For)}
    if not names:
        return body
    body = substitute(body, {name: Var(renamed(name)) for name in names})

    def rename(s: Stmt):
        if isinstance(s, For) and s.var.name in names:
            return dataclasses.replace(s, var=Var(renamed(s.var.name)))
        return None

    return map_stmt(body, stmt_fn=rename)


def _rerunnable(loop: For) -> bool:
    """Whether running some iterations of `loop` again leaves what one run left: every store
    writes elements of its own iteration (an index affine in the loop's variable), and a store
    that reads its buffer reads only the element it writes, which a store that reads nothing of
    that buffer (a reduction's initial value) also writes. The initial value's own guard is
    trusted to hold once per iteration (a reduction's first step, `rk == 0`)."""
    stores = [s for s in walk_stmts(loop.body) if isinstance(s, Store)]
    written = {s.buffer for s in stores}
    var = loop.var.name
    for s in stores:
        if not any(_affine_in(i, var) for i in s.indices):
            return False
        reads = [x for x in walk_exprs(s.value) if isinstance(x, Load) and x.buffer in written]
        if any(x.buffer != s.buffer or x.indices != s.indices for x in reads):
            return False
        if reads and not any(
            t.buffer == s.buffer
            and t.indices == s.indices
            and not any(isinstance(x, Load) and x.buffer == s.buffer for x in walk_exprs(t.value))
            for t in stores
        ):
            return False
    return True


def _affine_in(e: Expr, var: str) -> bool:
    form = affine(e)
    return form is not None and form[0].get(var, 0) != 0


def _perfect_chain(top: For) -> list[For]:
    chain = [top]
    while isinstance(chain[-1].body, For):
        chain.append(chain[-1].body)
    return chain


def _guarded_chain(top: For) -> tuple[list[For], list[IfThenElse]]:
    """The loops of a nest that is perfect but for guards without an else between its loops
    (a split of a loop that its factor does not divide leaves one), and those guards."""
    chain, guards = [top], []
    while True:
        body = chain[-1].body
        while isinstance(body, IfThenElse) and body.otherwise is None:
            guards.append(body)
            body = body.then
        if not isinstance(body, For):
            return chain, guards
        chain.append(body)


def reorder(func: PrimFunc, r: Reorder) -> PrimFunc:
    """Permute loops of one nest. Guards between them move innermost, around the body: a
    guard's condition holds or fails for a whole iteration of the loops inside it, so testing
    it once per innermost iteration computes the same."""
    loops = [_loop(func, name, r) for name in r.loops]
    if len(set(r.loops)) != len(r.loops):
        raise ScheduleError(f"{r}: a loop is named twice")
    chains = [_guarded_chain(loop) for loop in loops]
    top_chain, guards = max(chains, key=lambda c: len(c[0]))
    names = [loop.var.name for loop in top_chain]
    if not set(r.loops) <= set(names):
        raise ScheduleError(f"{r}: the loops are not one perfect nest (nest: {names})")
    slots = [i for i, name in enumerate(names) if name in r.loops]
    by_name = {loop.var.name: loop for loop in top_chain}
    order = list(top_chain)
    for slot, name in zip(slots, r.loops, strict=True):
        order[slot] = by_name[name]
    body: Stmt = top_chain[-1].body
    while isinstance(body, IfThenElse) and body.otherwise is None and body in guards:
        body = body.then
    for guard in reversed(guards):
        body = IfThenElse(guard.cond, body)
    for loop in reversed(order):
        body = For(loop.var, loop.extent, body, loop.kind, loop.binding)
    return _with_body(func, replace_stmt(func.body, top_chain[0], body))


def fuse(func: PrimFunc, r: Fuse) -> PrimFunc:
    outer = _loop(func, r.outer, r)
    inner = outer.body
    if not isinstance(inner, For) or inner.var.name != r.inner:
        raise ScheduleError(f"{r}: {r.inner!r} is not the loop directly inside {r.outer!r}")
    fused = _fresh_loop_name(func, r.fused, r)
    extent = Const(inner.extent, INDEX)
    body = substitute(
        inner.body,
        {r.outer: Binary("floordiv", fused, extent), r.inner: Binary("mod", fused, extent)},
    )
    new = For(fused, outer.extent * inner.extent, body, outer.kind)
    return _with_body(func, replace_stmt(func.body, outer, new))


def _annotate(func: PrimFunc, name: str, kind: ForKind, record) -> PrimFunc:
    loop = _loop(func, name, record)
    return _with_body(func, replace_stmt(func.body, loop, dataclasses.replace(loop, kind=kind)))


def vectorize(func: PrimFunc, r: Vectorize) -> PrimFunc:
    loop = _loop(func, r.loop, r)
    if any(isinstance(s, For) for s in walk_stmts(loop.body)):
        raise ScheduleError(f"{r}: only an innermost loop can be vectorized")
    if loop.extent > MAX_VECTOR_LANES:
        raise ScheduleError(f"{r}: {loop.extent} lanes exceed {MAX_VECTOR_LANES}; split first")
    if not _stores_depend_on(loop, lane_folds=True):
        raise ScheduleError(
            f"{r}: iterations write the same element (a reduction loop whose combiner is not "
            "associative, or whose running value is read)"
        )
    return _annotate(func, r.loop, ForKind.VECTORIZED, r)


def unroll(func: PrimFunc, r: Unroll) -> PrimFunc:
    loop = _loop(func, r.loop, r)
    if loop.extent > MAX_UNROLL:
        raise ScheduleError(f"{r}: extent {loop.extent} is too large to unroll (> {MAX_UNROLL})")
    return _annotate(func, r.loop, ForKind.UNROLLED, r)


def parallel(func: PrimFunc, r: Parallel) -> PrimFunc:
    loop = _loop(func, r.loop, r)
    path = loops_above(func.body, loop) or []
    if any(outer.kind == ForKind.PARALLEL for outer in path) or any(
        isinstance(s, For) and s.kind == ForKind.PARALLEL for s in walk_stmts(loop.body)
    ):
        raise ScheduleError(f"{r}: parallel loops cannot nest")
    if not _stores_depend_on(loop):
        raise ScheduleError(f"{r}: iterations write the same element (a reduction loop)")
    return _annotate(func, r.loop, ForKind.PARALLEL, r)


def _stage_buffer(func: PrimFunc, stage: str, record) -> tuple[Buffer, list[Store]]:
    stores = [s for s in walk_stmts(func.body) if isinstance(s, Store) and s.buffer.name == stage]
    if not stores:
        raise ScheduleError(f"{record}: no stage named {stage!r}")
    return stores[0].buffer, stores


def _stage_nest(func: PrimFunc, buffer: Buffer, record) -> For:
    """The outermost loop of the stage's own nest (it writes `buffer` and nothing else). A
    stage is a statement of the function's top level or of a recurrence's step: a serial loop
    that writes more than the stage (a loop over the steps) is looked into."""
    body = func.body
    while True:
        while isinstance(body, Allocate):
            body = body.body
        stmt = _writer(body, buffer, record)
        if isinstance(stmt, Allocate):  # a stage computed inside a loop, in its buffers
            body = stmt
            continue
        writes = {s.buffer for s in walk_stmts(stmt) if isinstance(s, Store)}
        own = {buffer} | {s.buffer for s in walk_stmts(stmt) if isinstance(s, Allocate)}
        if isinstance(stmt, For) and writes <= own:
            return stmt
        if not (isinstance(stmt, For) and stmt.kind == ForKind.SERIAL):
            raise ScheduleError(f"{record}: stage {buffer.name!r} is not a loop nest of its own")
        body = stmt.body


def _writer(body: Stmt, buffer: Buffer, record) -> Stmt:
    for stmt in body.stmts if isinstance(body, Block) else (body,):
        if any(isinstance(s, Store) and s.buffer == buffer for s in walk_stmts(stmt)):
            return stmt
    raise ScheduleError(f"{record}: stage {buffer.name!r} is not at the top level")


def _remove_allocation(body: Stmt, buffer: Buffer) -> Stmt:
    def drop(s):
        return s.body if isinstance(s, Allocate) and s.buffer == buffer else None

    return map_stmt(body, stmt_fn=drop)


def compute_inline(func: PrimFunc, r: ComputeInline) -> PrimFunc:
    buffer, stores = _stage_buffer(func, r.stage, r)
    if buffer.scope == "global":
        raise ScheduleError(f"{r}: {r.stage!r} is a function output and cannot be inlined")
    if len(stores) != 1:
        raise ScheduleError(f"{r}: {r.stage!r} is a reduction; only pure stages inline")
    (store,) = stores
    index_vars = [i.name for i in store.indices if isinstance(i, Var)]
    if len(index_vars) != len(store.indices) or len(set(index_vars)) != len(index_vars):
        raise ScheduleError(f"{r}: {r.stage!r} must store at its plain loop indices")
    if any(isinstance(x, Load) and x.buffer == buffer for x in walk_exprs(store.value)):
        raise ScheduleError(f"{r}: {r.stage!r} reads itself")
    nest = _stage_nest(func, buffer, r)
    own_loops = {s.var.name for s in walk_stmts(nest) if isinstance(s, For)}
    if not set(index_vars) <= own_loops:  # a recurrence's update stores at row t of a state
        raise ScheduleError(f"{r}: {r.stage!r} stores at indices its own loops do not cover")

    def inline(e: Expr):
        if isinstance(e, Load) and e.buffer == buffer:
            return substitute(store.value, dict(zip(index_vars, e.indices, strict=True)))
        return None

    body = replace_stmt(func.body, nest, Block(()))
    body = map_stmt(body, inline)
    return _with_body(func, _remove_allocation(body, buffer))


def reverse_compute_inline(func: PrimFunc, r: ReverseComputeInline) -> PrimFunc:
    consumer, stores = _stage_buffer(func, r.stage, r)
    if len(stores) != 1:
        raise ScheduleError(f"{r}: {r.stage!r} must be a pure stage with a single store")
    (store,) = stores
    index_vars = [i.name for i in store.indices if isinstance(i, Var)]
    if len(index_vars) != len(store.indices) or len(set(index_vars)) != len(index_vars):
        raise ScheduleError(f"{r}: {r.stage!r} must store at its plain loop indices")
    reads = {x.buffer for x in walk_exprs(store.value) if isinstance(x, Load)}
    # The intermediate it reads: a workspace buffer, or the local one of a stage computed
    # inside a loop (an expand conv's tile of rows).
    producers = [b for b in reads if b.scope in ("workspace", "local")]
    if len(producers) != 1:
        raise ScheduleError(f"{r}: {r.stage!r} must read exactly one intermediate stage")
    (producer,) = producers
    reads_of_producer = [
        x for x in walk_exprs(store.value) if isinstance(x, Load) and x.buffer == producer
    ]
    # The consumer reads one element of the producer: the one at its own indices, or at a
    # permutation of them (an im2col conv's [N, H, M, W] product read as [N, M, H, W]).
    read = reads_of_producer[0].indices if reads_of_producer else ()
    names = [i.name for i in read if isinstance(i, Var)]
    same = all(x.indices == read for x in reads_of_producer) and len(names) == len(read)
    if not same or sorted(names) != sorted(index_vars):
        raise ScheduleError(f"{r}: {r.stage!r} must read {producer.name!r} at its own indices")
    # A consumer may cover a leading part of the producer (the real rows and columns of a
    # GEMM computed in whole register tiles): the folded store is guarded to that part.
    extent = dict(zip(index_vars, consumer.shape, strict=True))
    if any(extent[n] > p for n, p in zip(names, producer.shape, strict=True)):
        raise ScheduleError(f"{r}: {r.stage!r} is not {producer.name!r} or a crop of it")
    writers = [s for s in walk_stmts(func.body) if isinstance(s, Store) and s.buffer == producer]
    readers = [
        s
        for s in walk_stmts(func.body)
        for e in stmt_exprs(s)
        for x in walk_exprs(e)
        if isinstance(x, Load) and x.buffer == producer and s is not store
    ]
    if not writers or readers or any(_reads(w.value, producer) for w in writers):
        raise ScheduleError(
            f"{r}: {producer.name!r} must be stored, not read back, and read only by "
            f"{r.stage!r} (cache its write first if it is a reduction)"
        )
    nest = _stage_nest(func, consumer, r)
    body = func.body
    # Each store of the producer (one per nest that computes it: a GEMM's whole tiles and its
    # tail tile) carries the epilogue.
    for final in writers:
        body = replace_stmt(body, final, _folded_store(store, names, final, consumer, extent))
    body = replace_stmt(body, nest, Block(()))
    return _with_body(func, _remove_allocation(body, producer))


def _reads(e: Expr, buffer: Buffer) -> bool:
    return any(isinstance(x, Load) and x.buffer == buffer for x in walk_exprs(e))


def _folded_store(store: Store, read: list[str], final: Store, consumer: Buffer, extent):
    """The consumer's `store` at the producer's store `final`, reading the value stored there,
    guarded to the consumer's part of the producer. `read`: the consumer's index variables in
    the order it reads the producer; `extent`: each one's range in the consumer."""
    producer = final.buffer
    mapping = dict(zip(read, final.indices, strict=True))

    def value_at_store(e: Expr):
        if isinstance(e, Load) and e.buffer == producer:
            return final.value
        return None

    epilogue = map_expr(substitute(store.value, mapping), value_at_store)
    indices = tuple(mapping[i.name] for i in store.indices)
    folded: Stmt = Store(consumer, indices, epilogue)
    # Innermost dimension's guard innermost: a vector loop over it becomes a masked store.
    for name, index, p in reversed(list(zip(read, final.indices, producer.shape, strict=True))):
        if extent[name] != p:
            folded = IfThenElse(Binary("lt", index, Const(extent[name], INDEX)), folded)
    return folded


def _clamped(e: Expr, size: int) -> Expr | None:
    """The index `e` of a padded read's clamp into 0..size-1 (`max(min(e, size - 1), 0)`, or
    either half where the simplifier decided the other), else None."""
    clamped = False
    if isinstance(e, Binary) and e.op == "max" and e.b == Const(0, INDEX):
        e, clamped = e.a, True
    if isinstance(e, Binary) and e.op == "min" and e.b == Const(size - 1, INDEX):
        e, clamped = e.a, True
    return e if clamped else None


def _span(index: Expr, size: int, inner_ranges: dict[str, int]):
    """(start, extent) of an index over the inner loops, or None when it is not affine. A
    clamped index (a padded read) lies where its unclamped one does, within the dimension:
    a constant span is cut to the dimension, a moving one is kept whole (see `_region`)."""
    unclamped = _clamped(index, size)
    span = bounds(unclamped if unclamped is not None else index, inner_ranges)
    if span is None or unclamped is None or not isinstance(span[0], Const):
        return span
    low = max(int(span[0].value), 0)
    return Const(low, INDEX), min(int(span[0].value) + span[1], size) - low


def _region(loop: For, buffer: Buffer, inner_ranges: dict[str, int]):
    """(start expressions, extents) of `buffer` touched inside `loop`, per dimension: the
    union of fixed spans, cut to the dimension; one moving span (the same base in every
    access), which keeps its whole extent even where it is wider than the dimension (a tile
    of rows and its halo, whose ends past the edges are computed under guards, `compute_at`,
    and never read); else the whole dimension."""
    accesses: list[tuple[Expr, ...]] = []
    for stmt in walk_stmts(loop.body):
        if isinstance(stmt, Store) and stmt.buffer == buffer:
            accesses.append(stmt.indices)
        for e in stmt_exprs(stmt):
            accesses += [
                x.indices for x in walk_exprs(e) if isinstance(x, Load) and x.buffer == buffer
            ]
    starts, extents = [], []
    for dim, size in enumerate(buffer.shape):
        spans = [_span(idx[dim], size, inner_ranges) for idx in accesses]
        if spans and all(s is not None and isinstance(s[0], Const) for s in spans):
            # Fixed spans (a row's whole vectors and the last one, at 181 of 197): their
            # union, which a padded dimension (a GEMM's columns, past the row) exceeds.
            low = min(int(s[0].value) for s in spans)
            high = max(int(s[0].value) + s[1] for s in spans)
            starts.append(Const(low, INDEX))
            extents.append(min(high, size) - low)
        elif not spans or any(s is None for s in spans) or len({str(s[0]) for s in spans}) > 1:
            starts.append(Const(0, INDEX))  # not affine, or several bases: the whole dimension
            extents.append(size)
        else:
            starts.append(spans[0][0])
            extents.append(max(s[1] for s in spans))
    return starts, extents


def _needs_guard(start: Expr, extent: int, size: int, ranges: dict[str, int]) -> bool:
    """Whether start + (0..extent-1) can run past `size` for some values of the loops."""
    largest = max_value(start, ranges)
    return largest is None or largest + extent > size


def _may_start_below_zero(start: Expr, ranges: dict[str, int]) -> bool:
    """Whether a region's start can be negative (a padded read's first row, clamped)."""
    span = value_range(start, ranges)
    return span is None or span[0] < 0


def _enclosing_ranges(func: PrimFunc, loop: For) -> dict[str, int]:
    path = loops_above(func.body, loop) or []
    return {outer.var.name: outer.extent for outer in path}


def _inner_ranges(loop: For) -> dict[str, int]:
    ranges = {loop.var.name: loop.extent}
    ranges.update({s.var.name: s.extent for s in walk_stmts(loop.body) if isinstance(s, For)})
    return ranges


def compute_at(func: PrimFunc, r: ComputeAt) -> PrimFunc:
    buffer, _ = _stage_buffer(func, r.stage, r)
    if buffer.scope == "global":
        raise ScheduleError(f"{r}: {r.stage!r} is a function output; compute it at its own place")
    nest = _stage_nest(func, buffer, r)
    target = _loop(func, r.loop, r)
    if find_loop(nest, r.loop) is not None:
        raise ScheduleError(f"{r}: {r.loop!r} belongs to {r.stage!r} itself")
    if not any(
        isinstance(x, Load) and x.buffer == buffer
        for s in walk_stmts(target.body)
        for e in stmt_exprs(s)
        for x in walk_exprs(e)
    ):
        raise ScheduleError(f"{r}: nothing inside {r.loop!r} reads {r.stage!r}")
    inner = {s.var.name: s.extent for s in walk_stmts(target.body) if isinstance(s, For)}
    starts, extents = _region(target, buffer, inner)
    spatial = _perfect_chain(nest)[: len(buffer.shape)]
    (store,) = [s for s in walk_stmts(nest) if isinstance(s, Store) and s.buffer == buffer][-1:]
    if [loop.var for loop in spatial] != list(store.indices):
        raise ScheduleError(f"{r}: apply compute_at before transforming {r.stage!r}'s loops")
    ranges = _enclosing_ranges(func, target) | {target.var.name: target.extent}
    mapping, loops = {}, []
    for loop, start, extent, size in zip(spatial, starts, extents, buffer.shape, strict=True):
        local = Var(r.moved(loop.var.name))
        index = Binary("add", start, local)
        mapping[loop.var.name] = index
        # A region that may run past the dimension (a tile of rows at an edge of a padded
        # read) computes only the elements inside it: the guards test each dimension inside
        # its own loop, so the loops inside a guard stay one nest to schedule.
        guards = []
        if _may_start_below_zero(start, ranges):
            guards.append(Binary("ge", index, Const(0, INDEX)))
        if _needs_guard(start, extent, size, ranges):
            guards.append(Binary("lt", index, Const(size, INDEX)))
        loops.append((local, extent, guards))
    body = substitute(spatial[-1].body, mapping)
    for local, extent, guards in reversed(loops):
        for guard in guards:
            body = IfThenElse(guard, body)
        body = For(local, extent, body)
    inside = _before_body(body, target.body)
    local = Buffer(buffer.name, tuple(extents), buffer.dtype, "local")
    if buffer.scope == "workspace" and local.nbytes <= r.local_bytes:
        inside = _shrunk(func.body, nest, target, buffer, local, starts, inside)
    moved = dataclasses.replace(target, body=inside)
    new_body = replace_stmt(func.body, target, moved)
    new_body = replace_stmt(new_body, nest, Block(()))
    if isinstance(inside, Allocate) and inside.buffer == local:
        new_body = _remove_allocation(new_body, buffer)
    return _with_body(func, new_body)


def _before_body(nest: Stmt, body: Stmt) -> Stmt:
    """`nest`, then `body`, inside the allocations `body` opens with (the local buffers of
    stages computed in the same loop before): a stage computed later may come to write
    them (`ReverseComputeInline` of the stage it feeds)."""
    if isinstance(body, Allocate):
        return dataclasses.replace(body, body=_before_body(nest, body.body))
    return seq(nest, body)


def _accesses(stmt: Stmt, buffer: Buffer) -> int:
    count = 0
    for s in walk_stmts(stmt):
        count += isinstance(s, Store) and s.buffer == buffer
        for e in stmt_exprs(s):
            count += sum(isinstance(x, Load) and x.buffer == buffer for x in walk_exprs(e))
    return count


def _shrunk(root: Stmt, nest: For, target: For, buffer: Buffer, local: Buffer, starts, inside):
    """`inside` with `buffer` replaced by `local`, a buffer of just the region one iteration of
    `target` computes (a row of softmax's exp values, a padded channel plane), allocated in
    the loop: what is written and read back stays in L1 (or registers) instead of streaming
    through a whole workspace buffer. Unchanged when the buffer is read outside the loop."""
    if _accesses(root, buffer) != _accesses(nest, buffer) + _accesses(target, buffer):
        return inside

    def offset(indices):  # simplified: a stage's index into its own region is its loop's
        return tuple(
            simplify_expr(Binary("sub", i, start)) for i, start in zip(indices, starts, strict=True)
        )

    def load(e: Expr):
        if isinstance(e, Load) and e.buffer == buffer:
            return Load(local, offset(e.indices))
        return None

    def store(st: Stmt):
        if isinstance(st, Store) and st.buffer == buffer:
            return Store(local, offset(st.indices), st.value)  # its value is already mapped
        return None

    return Allocate(local, map_stmt(inside, load, store))


def _without_reduction_init(loop: For, buffer: Buffer, inside: set[str], record):
    """Remove the reduction's guarded first-step store (`if k == 0: c[..] = init`) from
    `loop`, returning the loop, the initial value and, when reduction loops run outside
    `loop` (allowed by `record.accumulate` only), the condition of the first visit: the
    guard with the loops inside at their first iteration."""
    guards = [
        s
        for s in walk_stmts(loop.body)
        if isinstance(s, IfThenElse)
        and isinstance(s.then, Store)
        and s.then.buffer == buffer
        and s.otherwise is None
    ]
    if not guards:
        return loop, None, None
    values, firsts = set(), set()
    for guard in guards:
        names = {x.name for x in walk_exprs(guard.cond) if isinstance(x, Var)}
        if not names <= inside and not record.accumulate:
            outside = ", ".join(sorted(names - inside))
            raise ScheduleError(
                f"{record}: reduction loop(s) {outside} run outside {record.loop!r}; cache the "
                "write at a loop that holds the whole reduction, or accumulate"
            )
        values.add(guard.then.value)
        if not names <= inside:
            at_start = {name: Const(0, INDEX) for name in names & inside}
            firsts.add(simplify_expr(substitute(guard.cond, at_start)))
    if len(values) != 1 or not isinstance(next(iter(values)), Const) or len(firsts) > 1:
        if record.accumulate:
            raise ScheduleError(f"{record}: the reduction must start from one constant")
        return loop, None, None
    stripped = map_stmt(loop, stmt_fn=lambda s: Block(()) if s in guards else None)
    return stripped, next(iter(values)), next(iter(firsts), None)


def _tile_dim_order(loop: For, buffer: Buffer) -> list[int]:
    """Buffer dimensions ordered by the depth of the loop that walks them, innermost last:
    the tile's layout follows the loop nest, so a vectorized loop reads its tile
    contiguously."""
    depth = {s.var.name: k for k, s in enumerate(x for x in walk_stmts(loop) if isinstance(x, For))}
    store = next(s for s in walk_stmts(loop.body) if isinstance(s, Store) and s.buffer == buffer)

    def dim_depth(d: int) -> int:
        names = [x.name for x in walk_exprs(store.indices[d]) if isinstance(x, Var)]
        return max((depth[n] for n in names if n in depth), default=-1)

    return sorted(range(len(buffer.shape)), key=lambda d: (dim_depth(d), d))


def cache_write(func: PrimFunc, r: CacheWrite) -> PrimFunc:
    buffer, _ = _stage_buffer(func, r.stage, r)
    target = _loop(func, r.loop, r)
    writes = {s.buffer for s in walk_stmts(target.body) if isinstance(s, Store)}
    if writes != {buffer}:
        raise ScheduleError(f"{r}: {r.loop!r} must contain only {r.stage!r}'s computation")
    # The local buffer covers everything the stage writes over the whole of `loop`.
    inside = _inner_ranges(target)
    starts, extents = _region(target, buffer, inside)
    order = _tile_dim_order(target, buffer)
    if any(isinstance(s, Allocate) and s.buffer.name == r.local for s in walk_stmts(func.body)):
        raise ScheduleError(f"{r}: {r.local} exists; give this nest's cache its own suffix")
    local = Buffer(r.local, tuple(extents[d] for d in order), buffer.dtype, "local")
    stripped, init_value, first_visit = _without_reduction_init(target, buffer, set(inside), r)
    # Loops over a small tile are unrolled, so that its indices are constants and LLVM keeps
    # the whole tile in registers.
    tile_kind = ForKind.UNROLLED if local.size <= MAX_UNROLL else ForKind.SERIAL

    def offset(indices: tuple[Expr, ...]) -> tuple[Expr, ...]:
        return tuple(Binary("sub", indices[d], starts[d]) for d in order)

    def redirect_expr(e: Expr):
        if isinstance(e, Load) and e.buffer == buffer:
            return Load(local, offset(e.indices))
        return None

    def redirect_stmt(s: Stmt):
        if isinstance(s, Store) and s.buffer == buffer:
            return Store(local, offset(s.indices), s.value)
        return None

    computed = map_stmt(stripped, redirect_expr, redirect_stmt)
    ranges = _enclosing_ranges(func, target)

    def tile_nest(loop_name: Callable[[int], str], make, guarded: bool = True) -> Stmt:
        """A nest over the local tile (its loop over axis d named `loop_name(d)`) of
        `make(local index, buffer index)`; `guarded`: where the region runs past the buffer
        (a cropped tile), only the elements inside it."""
        tile = [Var(loop_name(k)) for k in range(len(extents))]
        index = tuple(Binary("add", starts[d], tile[order.index(d)]) for d in range(len(starts)))
        body = make(tuple(tile), index)
        for i, s, e, size in zip(index, starts, extents, buffer.shape, strict=True):
            if guarded and _needs_guard(s, e, size, ranges):
                body = IfThenElse(Binary("lt", i, Const(size, INDEX)), body)
        for var, extent in reversed(list(zip(tile, local.shape, strict=True))):
            body = For(var, extent, body, tile_kind)
        return body

    if init_value is not None:  # the first reduction step's store, done once up front
        fill = tile_nest(r.init_loop, lambda tile, _: Store(local, tile, init_value), guarded=False)
        if first_visit is not None:  # later visits add to the partial sums stored so far
            reload = tile_nest(r.reload_loop, lambda tile, ix: Store(local, tile, Load(buffer, ix)))
            fill = seq(fill, IfThenElse(Unary("not", first_visit), reload))
        computed = seq(fill, computed)
    copy = tile_nest(r.store_loop, lambda tile, index: Store(buffer, index, Load(local, tile)))
    new = Allocate(local, seq(computed, copy))
    return _with_body(func, replace_stmt(func.body, target, new))


# --- GPU primitives ----------------------------------------------------------------------------


def bind(func: PrimFunc, r: Bind) -> PrimFunc:
    loop = _loop(func, r.loop, r)
    if r.thread not in BINDINGS:
        raise ScheduleError(f"{r}: unknown binding {r.thread!r} (one of {', '.join(BINDINGS)})")
    if loop.kind not in (ForKind.SERIAL, ForKind.THREAD_BINDING):
        raise ScheduleError(f"{r}: {r.loop!r} is already {loop.kind.value}")
    path = loops_above(func.body, loop) or []
    inner = [s for s in walk_stmts(loop.body) if isinstance(s, For)]
    if any(x.binding == r.thread for x in path + inner):
        raise ScheduleError(f"{r}: {r.thread} is already bound around or inside {r.loop!r}")
    if r.thread in BLOCK_TAGS and any(x.binding in THREAD_TAGS for x in path):
        raise ScheduleError(f"{r}: a block binding cannot sit inside a thread binding")
    if r.thread in THREAD_TAGS and any(x.binding in BLOCK_TAGS for x in inner):
        raise ScheduleError(f"{r}: a thread binding cannot enclose a block binding")
    if not _stores_depend_on(loop):
        raise ScheduleError(f"{r}: iterations write the same element (a reduction loop)")
    bound = dataclasses.replace(loop, kind=ForKind.THREAD_BINDING, binding=r.thread)
    return _with_body(func, replace_stmt(func.body, loop, bound))


def _block_threads(path: list[For]) -> list[For]:
    """The thread-bound loops among `path` (the loops around a point), outermost first."""
    return [x for x in path if x.binding in THREAD_TAGS]


def cache_read(func: PrimFunc, r: CacheRead) -> PrimFunc:
    loop = _loop(func, r.loop, r)
    path = loops_above(func.body, loop) or []
    threads = _block_threads(path)
    if not any(x.binding in BLOCK_TAGS for x in path):
        raise ScheduleError(f"{r}: {r.loop!r} is not inside a block binding")
    if any(s.kind == ForKind.THREAD_BINDING for s in walk_stmts(loop.body) if isinstance(s, For)):
        raise ScheduleError(f"{r}: {r.loop!r} must be inside the thread bindings, not around them")
    buffers = {
        x.buffer
        for s in walk_stmts(loop.body)
        for e in stmt_exprs(s)
        for x in walk_exprs(e)
        if isinstance(x, Load) and x.buffer.name == r.buffer
    }
    if len(buffers) != 1:
        raise ScheduleError(f"{r}: nothing inside {r.loop!r} reads a buffer named {r.buffer!r}")
    (buffer,) = buffers
    # Written by an earlier nest of the group, it is a finished kernel's output by the time
    # this nest runs; written by this nest, a copy would go stale.
    if any(isinstance(s, Store) and s.buffer == buffer for s in walk_stmts(path[0])):
        raise ScheduleError(f"{r}: {r.buffer!r} is written by the nest that reads it")
    # The tile covers what every thread of the block reads in one iteration of `loop`.
    ranges = {x.var.name: x.extent for x in threads} | {
        s.var.name: s.extent for s in walk_stmts(loop.body) if isinstance(s, For)
    }
    starts, extents = _region(loop, buffer, ranges)
    tile = Buffer(f"{buffer.name}_shared_{r.loop}", tuple(extents), buffer.dtype, "shared")
    copy = _cooperative_copy(func, loop, buffer, tile, starts, threads)

    def redirect(e: Expr):
        if isinstance(e, Load) and e.buffer == buffer:
            return Load(
                tile, tuple(Binary("sub", i, st) for i, st in zip(e.indices, starts, strict=True))
            )
        return None

    moved = dataclasses.replace(
        loop, body=Allocate(tile, _staged(copy, map_stmt(loop.body, redirect)))
    )
    return _with_body(func, replace_stmt(func.body, loop, moved))


def _staged(copy: Stmt, body: Stmt) -> Stmt:
    """copy; barrier; body; barrier — or, when `body` already stages another operand (shared
    allocations around copies, a barrier, the computation, a barrier), the copy joins the
    other copies before that same first barrier."""
    allocations = []
    inner = body
    while isinstance(inner, Allocate) and inner.buffer.scope == "shared":
        allocations.append(inner.buffer)
        inner = inner.body
    stmts = inner.stmts if isinstance(inner, Block) else (inner,)
    barriers = [k for k, x in enumerate(stmts) if isinstance(x, Barrier)]
    if not allocations or len(barriers) < 2 or barriers[-1] != len(stmts) - 1:
        return seq(copy, Barrier(), body, Barrier())
    first = barriers[0]
    result: Stmt = Block((*stmts[:first], copy, *stmts[first:]))
    for buffer in reversed(allocations):
        result = Allocate(buffer, result)
    return result


def _cooperative_copy(func, loop: For, buffer: Buffer, tile: Buffer, starts, threads) -> Stmt:
    """Every thread of the block copies elements t, t + T, t + 2T ... of the tile (t: its
    linear thread index, T: the block's threads), so that consecutive threads read
    consecutive addresses. Elements past the buffer's end are filled with zeros (the
    computation never reads them: its own guards cut them off)."""
    count = max(1, math.prod(x.extent for x in threads))
    linear: Expr = Const(0, INDEX)
    for x in threads:
        linear = Binary("add", Binary("mul", linear, Const(x.extent, INDEX)), x.var)
    step = Var(f"{tile.name}_c")
    flat = Binary("add", Binary("mul", step, Const(count, INDEX)), linear)
    index, rest = [], flat
    for extent in reversed(tile.shape):
        index.append(Binary("mod", rest, Const(extent, INDEX)))
        rest = Binary("floordiv", rest, Const(extent, INDEX))
    index.reverse()
    source = tuple(Binary("add", st, i) for st, i in zip(starts, index, strict=True))
    ranges = _enclosing_ranges(func, loop) | {loop.var.name: loop.extent}
    guards = [
        Binary("lt", src, Const(size, INDEX))
        for src, st, e, size in zip(source, starts, tile.shape, buffer.shape, strict=True)
        if _needs_guard(st, e, size, ranges)
    ]
    store: Stmt = Store(tile, tuple(index), Load(buffer, source))
    if guards:  # a branch, not a select: the load itself must not run past the buffer
        inside = guards[0]
        for g in guards[1:]:
            inside = Binary("and", inside, g)
        store = IfThenElse(inside, store, Store(tile, tuple(index), Const(0, buffer.dtype)))
    steps = -(-tile.size // count)
    if steps * count != tile.size:
        store = IfThenElse(Binary("lt", flat, Const(tile.size, INDEX)), store)
    return For(step, steps, store, ForKind.UNROLLED if steps <= 8 else ForKind.SERIAL)


def _unflatten(flat: Expr, extents: Sequence[int]) -> list[Expr]:
    """Row-major indices of `flat` over `extents`."""
    index: list[Expr] = []
    for extent in reversed(extents):
        index.append(Binary("mod", flat, Const(extent, INDEX)))
        flat = Binary("floordiv", flat, Const(extent, INDEX))
    return index[::-1]


def _combiner(update: Store, buffer: Buffer, r) -> Callable[[Expr, Expr], Expr]:
    """combine(a, b) of a reduction update `buffer = combine(buffer, term)` (as lowered)."""
    acc, value = Load(buffer, update.indices), update.value
    if isinstance(value, Binary) and value.a == acc and value.op in ("add", "mul", "min", "max"):
        return lambda a, b: Binary(value.op, a, b)
    if (
        isinstance(value, Select)
        and value.b == acc
        and isinstance(value.cond, Binary)
        and value.cond.b == acc
        and value.cond.a == value.a
    ):
        op = value.cond.op
        return lambda a, b: Select(Binary(op, b, a), b, a)
    raise ScheduleError(f"{r}: {buffer.name!r} is not a reduction this primitive knows")


def _reduction_parts(func: PrimFunc, r: CrossThreadReduce):
    """(buffer, spatial loops, reduction loops, init value, update store) of a plain lowered
    reduction nest: spatial loops, reduction loops, `if first: init` and the update."""
    buffer, stores = _stage_buffer(func, r.stage, r)
    nest = _stage_nest(func, buffer, r)
    chain = _perfect_chain(nest)
    rank = len(buffer.shape)
    body = chain[-1].body
    parts = body.stmts if isinstance(body, Block) else ()
    if len(stores) != 2 or len(parts) != 2 or not isinstance(parts[0], IfThenElse):
        raise ScheduleError(f"{r}: {r.stage!r} is not an untransformed reduction nest")
    init, update = parts[0].then, parts[1]
    spatial, reduction = chain[:rank], chain[rank:]
    if [x.var for x in spatial] != list(update.indices) or not reduction:
        raise ScheduleError(f"{r}: {r.stage!r}'s loops are not spatial then reduction")
    if not isinstance(init, Store) or not isinstance(init.value, Const):
        raise ScheduleError(f"{r}: {r.stage!r} has no constant initial value")
    return buffer, nest, spatial, reduction, init.value, update


def cross_thread_reduce(func: PrimFunc, r: CrossThreadReduce) -> PrimFunc:
    threads = r.threads
    if threads < 2 or threads & (threads - 1) or threads > 1024:
        raise ScheduleError(f"{r}: threads must be a power of two in 2..1024")
    buffer, nest, spatial, reduction, init, update = _reduction_parts(func, r)
    combine = _combiner(update, buffer, r)
    row, lane = Var(f"{r.stage}_row"), Var(f"{r.stage}_t")
    step = Var(f"{r.stage}_c")
    rows = math.prod(x.extent for x in spatial)
    count = math.prod(x.extent for x in reduction)
    where = dict(
        zip(
            [x.var.name for x in spatial], _unflatten(row, [x.extent for x in spatial]), strict=True
        )
    )
    flat = Binary("add", Binary("mul", step, Const(threads, INDEX)), lane)
    where |= dict(
        zip(
            [x.var.name for x in reduction],
            _unflatten(flat, [x.extent for x in reduction]),
            strict=True,
        )
    )
    acc = Buffer(f"{r.stage}_acc", (1,), buffer.dtype, "local")
    pair = Buffer(f"{r.stage}_pair", (1,), buffer.dtype, "local")
    partials = Buffer(f"{r.stage}_red", (threads,), buffer.dtype, "shared")
    zero = (Const(0, INDEX),)
    term = substitute(update.value, where)
    term = map_expr(
        term, lambda e: Load(acc, zero) if isinstance(e, Load) and e.buffer == buffer else None
    )
    fold: Stmt = Store(acc, zero, term)
    if count % threads:
        fold = IfThenElse(Binary("lt", flat, Const(count, INDEX)), fold)
    tree: list[Stmt] = []
    half = threads // 2
    while half >= 1:
        inside = Binary("lt", lane, Const(half, INDEX))
        other = Load(partials, (Binary("add", lane, Const(half, INDEX)),))
        tree += [
            IfThenElse(inside, Store(pair, zero, combine(Load(partials, (lane,)), other))),
            Barrier(),
            IfThenElse(inside, Store(partials, (lane,), Load(pair, zero))),
            Barrier(),
        ]
        half //= 2
    result = Store(buffer, tuple(where[x.var.name] for x in spatial), Load(partials, zero))
    body = seq(
        Store(acc, zero, init),
        For(step, -(-count // threads), fold),
        Store(partials, (lane,), Load(acc, zero)),
        Barrier(),
        *tree,
        IfThenElse(Binary("eq", lane, Const(0, INDEX)), result),
    )
    body = Allocate(partials, Allocate(acc, Allocate(pair, body)))
    thread_loop = For(lane, threads, body, ForKind.THREAD_BINDING, "threadIdx.x")
    new = For(row, rows, thread_loop, ForKind.THREAD_BINDING, "blockIdx.x")
    return _with_body(func, replace_stmt(func.body, nest, new))


# The line size prefetches step by (every x86 and Arm core Kiln targets has 64-byte lines).
CACHE_LINE_BYTES = 64


def prefetch_next(func: PrimFunc, r: PrefetchNext) -> PrimFunc:
    buffer = next((p for p in func.params if p.name == r.buffer), None)
    if buffer is None:
        raise ScheduleError(f"{r}: {r.buffer!r} is not a parameter of {func.name}")
    loop, at = _loop(func, r.loop, r), _loop(func, r.at, r)
    path = loops_above(loop.body, at)
    if path is None:
        raise ScheduleError(f"{r}: {r.at!r} is not inside {r.loop!r}")
    if at.kind not in (ForKind.SERIAL, ForKind.UNROLLED):
        raise ScheduleError(f"{r}: {r.at!r} is {at.kind.value}; prefetches go in a serial loop")
    start, span = _next_slice(loop, buffer, r)
    new = spread_prefetches(buffer, start, span, [*path, at])
    return _with_body(func, replace_stmt(func.body, at, new))


def spread_prefetches(buffer: Buffer, start: Expr, span: int, steps: Sequence[For]) -> For:
    """The last loop of `steps` (outermost first, each inside the one before) with
    prefetches of the `span` elements of `buffer` from `start` at the top of its body: their
    lines spread evenly over the iterations of all `steps`, a few per iteration, never past
    the span or the buffer."""
    at = steps[-1]
    step: Expr = Const(0, INDEX)
    for s in steps:
        step = step * s.extent + s.var
    per_line = max(1, CACHE_LINE_BYTES // np.dtype(buffer.dtype).itemsize)
    lines = -(-span // per_line)
    per_step = -(-lines // math.prod(s.extent for s in steps))
    last = minimum(start + (span - 1), buffer.size - 1)  # the slice's end, inside the buffer
    offsets = (start + (step * per_step + k) * per_line for k in range(per_step))
    prefetches = [Prefetch(buffer, simplify_expr(minimum(offset, last))) for offset in offsets]
    return For(at.var, at.extent, seq(*prefetches, at.body), at.kind)


def _next_slice(loop: For, buffer: Buffer, record) -> tuple[Expr, int]:
    """(first element, length) of the flat run of `buffer` that the iteration after the
    current one of `loop` reads: every read's flat index must be affine, with the loops
    inside `loop` counting up (so the run starts where they are all 0)."""
    inner = {s.var.name: s.extent for s in walk_stmts(loop.body) if isinstance(s, For)}
    name = loop.var.name
    forms = []
    for load in loads_of(loop.body, buffer):
        form = affine(simplify_expr(flat_index(buffer, load.indices)))
        if form is None or any(c < 0 for v, c in form[0].items() if v in inner):
            raise ScheduleError(f"{record}: {buffer.name!r} is not read in an affine run")
        forms.append(form)
    if not forms:
        raise ScheduleError(f"{record}: {loop.var.name!r} does not read {buffer.name!r}")
    outer = {v: c for v, c in forms[0][0].items() if v not in inner}
    if any({v: c for v, c in f[0].items() if v not in inner} != outer for f in forms):
        raise ScheduleError(f"{record}: the reads of {buffer.name!r} move differently")
    if outer.get(name, 0) <= 0:
        raise ScheduleError(f"{record}: {buffer.name!r} does not move with {name!r}")
    first = min(f[1] for f in forms)
    end = max(f[1] + sum(c * (inner[v] - 1) for v, c in f[0].items() if v in inner) for f in forms)
    start: Expr = Const(first, INDEX)
    for v, c in outer.items():  # the outer loops as they are, `loop` one iteration on
        start = start + (Var(v) + 1 if v == name else Var(v)) * c
    return start, end - first + 1


PRIMITIVES = {
    Split: split,
    SplitOverlap: split_overlap,
    Reorder: reorder,
    Fuse: fuse,
    Vectorize: vectorize,
    Unroll: unroll,
    Parallel: parallel,
    ComputeInline: compute_inline,
    ReverseComputeInline: reverse_compute_inline,
    ComputeAt: compute_at,
    CacheWrite: cache_write,
    Bind: bind,
    CacheRead: cache_read,
    CrossThreadReduce: cross_thread_reduce,
    PrefetchNext: prefetch_next,
}


def apply(func: PrimFunc, schedule: Sequence[Record]) -> PrimFunc:
    """Replay `schedule` on `func` and verify the result. A failure is reported as it
    happens after the first record that breaks the function: the replay is then repeated
    with the function verified after every record (the verifier, run after each of a
    group's dozens of records, took a sixth of a model's compile)."""
    for record in schedule:
        if type(record) not in PRIMITIVES:
            raise ScheduleError(f"not a schedule record: {record!r}")
    token = _SIMPLIFIED.set({})
    try:
        return verify(_replay(func, schedule, verify_each=False))
    except Exception:  # noqa: BLE001 - the replay names the record (or raises the same)
        return _replay(func, schedule, verify_each=True)
    finally:
        _SIMPLIFIED.reset(token)


def _replay(func: PrimFunc, schedule: Sequence[Record], verify_each: bool) -> PrimFunc:
    for record in schedule:
        func = PRIMITIVES[type(record)](func, record)
        if verify_each:
            func = verify(func)
    return func
