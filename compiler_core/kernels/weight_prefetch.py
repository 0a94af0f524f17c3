"""Cross-kernel weight prefetch: a kernel brings the weights of the kernels after it into
cache while it computes.

Timed alone, a kernel finds its weights in cache; inside a whole model they have left it
since the last run (a model's weights outgrow L2, and on a shared host L3 as well), and a
kernel that streams them pays memory latency that no compute hides: MobileNetV2's
classifier (5 MB of weights) ran 30 us alone and 136 us in the model, its 7x7 blocks' 1x1
convs 15-25 us slower than alone (Zen 4, 2 threads). Within a kernel, `PrefetchNext` hides
the next output-channel chunk's weights behind the current chunk; the first chunk of each
thread, and a kernel with few chunks, still waits. Here the kernels before a heavy-weight
kernel prefetch its weights, a few lines at the top of each iteration of a loop deep in
their own heaviest loop nest, so that the fetches overlap their compute.

The plan is a whole-model decision, like the memory plan: a compute-bound kernel gets a
budget in bytes in proportion to its floating-point work, less its own weights; a
memory-bound one (a batch-1 GEMV) none. A kernel's weights are handed, first bytes first,
to the kernels right before it while their budgets last and while the weights the kernels
in between read would not evict them again. A prefetching kernel takes the weights as one
more input (the same value in the weights blob), so the entry function, `plan.json` and
`Module.profile` pass it like any other input, and the manifest notes it
(`weight_prefetches`); a prefetch changes no value, so outputs are bit-identical.

Measured on Zen 4 (2 threads, per kernel inside the model, `Module.profile`): MobileNetV2's
classifier 152 -> 83 us and its 7x7 blocks' kernels 3-8% faster (3.2% of the model);
encoder4's feed-forward GEMMs 5-8% faster and its last layer's one-row GEMMs 31 -> 19 us
(5% of the model).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from compiler_core.loop.ir import (
    INDEX,
    Allocate,
    Block,
    Buffer,
    Const,
    For,
    ForKind,
    PrimFunc,
    Stmt,
)
from compiler_core.loop.transform import replace_stmt
from compiler_core.schedule.primitives import CACHE_LINE_BYTES, spread_prefetches

# Weights below this come in fast enough on their own (the hardware prefetchers and the
# kernel's own `PrefetchNext` cover them). Up to RESIDENT_BYTES (what two cores' L2 hold)
# they are prefetched for any kernel; up to STAGED_BYTES only for a memory-bound one (below
# MIN_INTENSITY), which would stall on them anyway and reads them from L3 several times
# faster than from memory. A compute-bound kernel streams larger weights behind its own
# FLOPs, and prefetching them only slowed the kernels before (mlp's 4 MB second layer at
# batch 64: 1% slower; ResNet-18's 16.7 MB Winograd weights: the kernels before 40-50%).
PREFETCH_MIN_BYTES = 64 * 1024
RESIDENT_BYTES = 2 << 20
STAGED_BYTES = 8 << 20
# A kernel prefetches only while it is compute-bound: at least MIN_INTENSITY FLOPs per byte
# of its own weights (a batch-1 GEMV streams its weights at 0.5 FLOP a byte and has no
# memory time to spare), and at most one byte per FLOPS_PER_BYTE of its FLOPs, less its own
# weights (at 100 GFLOP/s a core, 12 GB/s of memory traffic in all).
MIN_INTENSITY = 16
FLOPS_PER_BYTE = 8
# How many kernels back a kernel's weights may be prefetched from (kernels too small to
# prefetch `MIN_SLICE_BYTES`, a pooling or a layout copy, neither prefetch nor count), and
# how many bytes of their own weights the kernels in between may read: further back, the
# lines would be evicted again before their kernel runs.
HORIZON = 6
MIN_SLICE_BYTES = 32 * 1024
EVICTING_BYTES = 4 << 20
# At most this many lines prefetched at once: more in a row fill the core's miss buffers and
# stall the loop they sit in instead of overlapping it.
MAX_LINES_PER_STEP = 8
# Loops a prefetch may sit in, or be spread over (never a vector loop).
_SPREAD_KINDS = (ForKind.SERIAL, ForKind.UNROLLED, ForKind.PARALLEL)


@dataclasses.dataclass(frozen=True)
class WeightPrefetch:
    """Kernel `by` prefetches bytes [start, start + nbytes) of kernel `of`'s input `value`."""

    by: int
    of: int
    value: str
    start: int
    nbytes: int


def plan(
    funcs: Sequence[PrimFunc],
    inputs: Sequence[Sequence[str]],
    flops: Sequence[float],
    weights: set[str],
) -> list[WeightPrefetch]:
    """The prefetches for kernels `funcs` run in this order, with their `inputs` (value names,
    one per leading parameter), floating-point work `flops`, and `weights` the names of the
    constant inputs (the weights blob's)."""
    own = _own_weight_bytes(funcs, inputs, weights)
    budgets = _budgets(funcs, flops, own)
    prefetches = []
    for index, names in enumerate(inputs):
        for value, buffer in zip(names, funcs[index].params, strict=False):
            if value not in weights:
                continue
            bound = STAGED_BYTES if flops[index] < MIN_INTENSITY * own[index] else RESIDENT_BYTES
            if not PREFETCH_MIN_BYTES <= buffer.nbytes <= bound:
                continue
            start = 0
            for by in _prefetchers(index, budgets, own):
                take = min(budgets[by], buffer.nbytes - start) // CACHE_LINE_BYTES
                if take * CACHE_LINE_BYTES < MIN_SLICE_BYTES:
                    continue
                nbytes = min(take * CACHE_LINE_BYTES, buffer.nbytes - start)
                prefetches.append(WeightPrefetch(by, index, value, start, nbytes))
                budgets[by] -= nbytes
                start += nbytes
                if start >= buffer.nbytes:
                    break
    return prefetches


def _prefetchers(index: int, budgets: Sequence[int], own: Sequence[int]) -> list[int]:
    """The kernels that may prefetch kernel `index`'s weights, nearest first: up to
    `HORIZON` with a budget, while the weights read by the kernels between (which pass
    through the same caches) stay under `EVICTING_BYTES`."""
    found, between = [], 0
    for by in range(index - 1, -1, -1):
        if between > EVICTING_BYTES or len(found) == HORIZON:
            break
        if budgets[by] >= MIN_SLICE_BYTES:
            found.append(by)
        between += own[by]
    return found


def _own_weight_bytes(
    funcs: Sequence[PrimFunc], inputs: Sequence[Sequence[str]], weights: set[str]
) -> list[int]:
    return [
        sum(b.nbytes for v, b in zip(names, func.params, strict=False) if v in weights)
        for names, func in zip(inputs, funcs, strict=True)
    ]


def prefetch_budgets(
    funcs: Sequence[PrimFunc],
    inputs: Sequence[Sequence[str]],
    flops: Sequence[float],
    weights: set[str],
) -> list[int]:
    """Bytes each kernel may prefetch (`plan`'s arguments)."""
    return _budgets(funcs, flops, _own_weight_bytes(funcs, inputs, weights))


def _budgets(funcs: Sequence[PrimFunc], flops: Sequence[float], own: Sequence[int]) -> list[int]:
    return [_budget(*args) for args in zip(funcs, flops, own, strict=True)]


def _budget(func: PrimFunc, flops: float, weight_bytes: int) -> int:
    """Bytes `func` may prefetch, given its FLOPs and the bytes of its own weights: none
    below `MIN_INTENSITY`, else its FLOPs' share less its own weights, and no more lines than
    its spread loops take at `MAX_LINES_PER_STEP` a step."""
    if flops < MIN_INTENSITY * weight_bytes:
        return 0
    path = _spread_path(func.body, math.inf)
    steps = math.prod(loop.extent for loop in path) if path else 0
    share = flops / FLOPS_PER_BYTE - weight_bytes
    return max(0, int(min(share, steps * MAX_LINES_PER_STEP * CACHE_LINE_BYTES)))


def add_prefetch(
    func: PrimFunc, position: int, source: Buffer, start: int, nbytes: int
) -> PrimFunc:
    """`func` with a new parameter at `position` shaped like `source`, whose bytes [start,
    start + nbytes) it prefetches: spread evenly over the iterations of the loops from the
    top of its heaviest loop nest down to the deepest one whose iterations do not outnumber
    the lines (a few lines at the top of each iteration of that loop)."""
    taken = {p.name for p in func.params}
    name = next(f"prefetch{k}" for k in range(len(taken) + 1) if f"prefetch{k}" not in taken)
    buffer = Buffer(name, source.shape, source.dtype)
    itemsize = source.nbytes // max(source.size, 1)
    first, span = start // itemsize, -(-nbytes // itemsize)
    path = _spread_path(func.body, -(-span // max(1, CACHE_LINE_BYTES // itemsize)))
    if not path:
        raise ValueError(f"{func.name}: no serial or parallel loop to spread prefetches over")
    new = spread_prefetches(buffer, Const(first, INDEX), span, path)
    params = (*func.params[:position], buffer, *func.params[position:])
    body = replace_stmt(func.body, path[-1], new)
    return dataclasses.replace(func, params=params, body=body)


def _spread_path(body: Stmt, lines: float) -> list[For]:
    """The loops prefetches are spread over: from the heaviest top-level loop, each time into
    the heaviest loop of the body, while the iterations so far do not outnumber `lines`."""
    path: list[For] = []
    steps = 1
    loop = _heaviest_loop(body)
    while loop is not None and loop.kind in _SPREAD_KINDS:
        if path and steps * loop.extent > lines:
            break
        path.append(loop)
        steps *= loop.extent
        loop = _heaviest_loop(loop.body)
    return path


def _heaviest_loop(s: Stmt) -> For | None:
    """The loop directly under `s` (through blocks and allocations) that runs the most
    statements."""
    loops = [child for child in _direct(s) if isinstance(child, For)]
    return max(loops, key=_work, default=None)


def _work(loop: For) -> int:
    """Statement executions inside `loop`."""
    inner = sum(_work(s) if isinstance(s, For) else 1 for s in _direct(loop.body))
    return loop.extent * max(inner, 1)


def _direct(s: Stmt) -> list[Stmt]:
    """The statements directly under `s`, through blocks and allocations."""
    if isinstance(s, Block):
        return [c for stmt in s.stmts for c in _direct(stmt)]
    if isinstance(s, Allocate):
        return _direct(s.body)
    return [s]
