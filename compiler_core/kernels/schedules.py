"""Default CPU schedules for a fused group's lowered function.

A group's stages are named by the kernel context (`conv3`, `relu4`, `padconv3`...); their
loops are `<stage>_i<k>` (spatial) and `<stage>_<axis>` (reduction). The default schedule
inlines pure intermediate stages, gives the heavy anchor (conv, matmul, gemm) a register-tiled
schedule with its epilogue folded into the single store, and parallelizes and vectorizes the
rest. Everything is a list of records: the tuner replaces these defaults with measured ones.
"""

from __future__ import annotations

import dataclasses
import math

from compiler_core.schedule.primitives import (
    CacheWrite,
    ComputeInline,
    Fuse,
    Parallel,
    Record,
    Reorder,
    ReverseComputeInline,
    Split,
    Unroll,
    Vectorize,
)

VECTOR_LANES = 16


@dataclasses.dataclass(frozen=True)
class StageInfo:
    name: str
    shape: tuple[int, ...]
    reduce_axes: tuple[tuple[str, int], ...]  # (loop name, extent)
    output: bool
    op: str  # the graph operator that produced this stage
    reads: tuple[str, ...]  # stage names this stage reads
    notes: tuple[tuple[str, object], ...] = ()  # facts from the kernel builder

    def note(self, key: str, default=None):
        return dict(self.notes).get(key, default)

    @property
    def pure(self) -> bool:
        return not self.reduce_axes

    def loop(self, k: int) -> str:
        return f"{self.name}_i{k}"


def _largest_divisor(n: int, candidates) -> int:
    return next((c for c in candidates if c <= n and n % c == 0), 1)


def _inline_intermediates(stages: list[StageInfo]) -> tuple[list[Record], list[StageInfo]]:
    """Inline every pure intermediate stage, except the ones a builder asks to keep and padding
    that feeds a convolution with enough arithmetic per input value to pay for a copy without
    bounds tests. A depthwise conv has too little: it reads its padding through bounds tests
    rather than a copy of its input."""
    depthwise_reads = {
        read for s in stages if s.note("layout") == "nchwc_depthwise" for read in s.reads
    }
    records, kept = [], []
    for s in stages:
        keep_padding = s.name.startswith("pad") and s.name not in depthwise_reads
        # A rank-0 stage is a single store with no loop nest to inline: it stays as it is. A
        # builder notes `materialize` on a stage read many times over (a recurrence's state).
        keep = keep_padding or not s.shape or s.note("materialize", False)
        if s.pure and not s.output and not keep:
            records.append(ComputeInline(s.name))
        else:
            kept.append(s)
    return records, kept


def _epilogue_of(anchor: StageInfo, kept: list[StageInfo], inlined: set[str], all_stages):
    """The output stage that reads the anchor (after inlining), if it is a pure epilogue."""
    by_name = {s.name: s for s in all_stages}

    def reaches(stage: StageInfo) -> bool:
        return any(r == anchor.name or (r in inlined and reaches(by_name[r])) for r in stage.reads)

    for s in kept:
        if s.output and s.pure and s is not anchor and s.shape == anchor.shape and reaches(s):
            return s
    return None


def _vector_tile_io(stage: StageInfo) -> list[Record]:
    """Vectorize the accumulator tile's zero fill and its store (which carries the epilogue)
    along the tile's innermost axis, as the reduction itself is: left scalar and unrolled,
    LLVM's SLP vectorizer does not reassemble them (MobileNetV2's 1x1 convs ran 2.5x slower).
    """
    last = len(stage.shape) - 1
    return [Vectorize(f"{stage.name}_init{last}"), Vectorize(f"{stage.name}_wb{last}")]


def conv_schedule(
    conv: StageInfo, epilogue: StageInfo | None, depthwise: bool, block: int
) -> list[Record]:
    n_loop, m_loop, y_loop, x_loop = (conv.loop(k) for k in range(4))
    width = conv.shape[3]
    reduce_loops = [name for name, _ in conv.reduce_axes]
    records: list[Record] = []
    if depthwise:
        lanes = _largest_divisor(width, (16, 8, 4))
        records += [Split(x_loop, lanes)]
        records += [Reorder((n_loop, m_loop, y_loop, f"{x_loop}_o", *reduce_loops, f"{x_loop}_i"))]
        records += [CacheWrite(conv.name, reduce_loops[0])]
        if lanes > 1:
            records += [Vectorize(f"{x_loop}_i"), *_vector_tile_io(conv)]
        if epilogue is not None:
            records.append(ReverseComputeInline(epilogue.name))
        records += [Fuse(m_loop, y_loop), Parallel(f"{m_loop}_{y_loop}_f")]
        return records
    tile = _largest_divisor(width, (8, 7, 6, 5, 4, 3, 2))
    records += [Split(m_loop, block), Split(x_loop, tile)]
    records += [
        Reorder(
            (
                n_loop,
                f"{m_loop}_o",
                y_loop,
                f"{x_loop}_o",
                *reduce_loops,
                f"{x_loop}_i",
                f"{m_loop}_i",
            )
        )
    ]
    records += [
        CacheWrite(conv.name, reduce_loops[0]),
        Vectorize(f"{m_loop}_i"),
        Unroll(f"{x_loop}_i"),
        *_vector_tile_io(conv),
    ]
    if epilogue is not None:
        records.append(ReverseComputeInline(epilogue.name))
    records += [Fuse(f"{m_loop}_o", y_loop), Parallel(f"{m_loop}_o_{y_loop}_f")]
    return records


def nchwc_conv_schedule(conv: StageInfo, epilogue: StageInfo | None, tile: int) -> list[Record]:
    """Conv writing NCHW[b]c: a row of `tile` output pixels x one b-channel block held in
    registers over the whole reduction (broadcast an input value, FMA with a weight vector);
    the parallel loop is output-channel blocks x rows."""
    n_loop, mo_loop, y_loop, x_loop, mi_loop = (conv.loop(k) for k in range(5))
    reduce_loops = [name for name, _ in conv.reduce_axes]
    tile = _largest_divisor(conv.shape[3], tuple(range(tile, 0, -1)))
    records: list[Record] = [
        Split(x_loop, tile),
        Reorder((n_loop, mo_loop, y_loop, f"{x_loop}_o", *reduce_loops, f"{x_loop}_i", mi_loop)),
        CacheWrite(conv.name, reduce_loops[0]),
        Vectorize(mi_loop),
        Unroll(f"{x_loop}_i"),
        *_vector_tile_io(conv),
    ]
    if epilogue is not None:
        records.append(ReverseComputeInline(epilogue.name))
    records += [Fuse(mo_loop, y_loop), Parallel(f"{mo_loop}_{y_loop}_f")]
    return records


# Output pixels per register tile: accumulators + a weight vector must fit the 32 registers.
NCHWC_TILE = 14
NCHWC_DEPTHWISE_TILE = 8


def matmul_schedule(mm: StageInfo, epilogue: StageInfo | None, panel: int) -> list[Record]:
    rank = len(mm.shape)
    rows, cols = mm.shape[-2], mm.shape[-1]
    batch_loops = [mm.loop(k) for k in range(rank - 2)]
    i_loop, j_loop = mm.loop(rank - 2), mm.loop(rank - 1)
    ((k_loop, _),) = mm.reduce_axes
    records: list[Record] = []
    row_dims = mm.shape[:-1]
    if batch_loops and panel and sum(d > 1 for d in row_dims) <= 1:
        # A shared (packed) weight, and the rows spread over one dimension only: every batch
        # row is just another row of one GEMM (the fused index stays affine).
        for loop in [*batch_loops[1:], i_loop]:
            records.append(Fuse(batch_loops[0], loop))
            batch_loops[0] = f"{batch_loops[0]}_{loop}_f"
        i_loop, batch_loops = batch_loops[0], []
        rows = math.prod(mm.shape[:-1])
    mr = _largest_divisor(rows, (12, 8, 6, 4, 3, 2))
    nr = panel if cols % panel == 0 else _largest_divisor(cols, (32, 16, 8, 4))
    records += [Split(i_loop, mr), Split(j_loop, nr)]
    inner_j = [f"{j_loop}_i"]
    if nr > VECTOR_LANES and nr % VECTOR_LANES == 0:
        records.append(Split(f"{j_loop}_i", VECTOR_LANES))
        inner_j = [f"{j_loop}_i_o", f"{j_loop}_i_i"]
    order = (*batch_loops, f"{i_loop}_o", f"{j_loop}_o", k_loop, f"{i_loop}_i", *inner_j)
    records += [Reorder(order), CacheWrite(mm.name, k_loop)]
    if nr >= 4:
        records += [Vectorize(inner_j[-1]), *_vector_tile_io(mm)]
    if len(inner_j) == 2:
        records.append(Unroll(inner_j[0]))
    records.append(Unroll(f"{i_loop}_i"))
    if epilogue is not None:
        records.append(ReverseComputeInline(epilogue.name))
    outer = [*batch_loops, f"{i_loop}_o", f"{j_loop}_o"]
    extents = [*mm.shape[: len(batch_loops)], rows // mr, -(-cols // nr)]
    parallel = next((loop for loop, e in zip(outer, extents, strict=True) if e > 1), None)
    if parallel is not None:
        records.append(Parallel(parallel))
    return records


def generic_schedule(stage: StageInfo) -> list[Record]:
    """Parallel outermost loop with work; vectorize the innermost loop of a pure stage."""
    records: list[Record] = []
    rank = len(stage.shape)
    if rank == 0:
        return records
    inner = rank - 1
    if stage.pure and stage.shape[inner] % VECTOR_LANES == 0:
        records += [Split(stage.loop(inner), VECTOR_LANES), Vectorize(f"{stage.loop(inner)}_i")]
    outer = next((k for k in range(rank) if stage.shape[k] > 1), None)
    if outer is not None and not (stage.pure and outer == inner and records):
        records.append(Parallel(stage.loop(outer)))
    elif outer is not None and records:
        records.append(Parallel(f"{stage.loop(inner)}_o"))
    return records


ANCHOR_OPS = ("Conv", "MatMul", "Gemm")


def default_schedule(stages: list[StageInfo]) -> list[Record]:
    # An empty stage lowers to nothing: there is nothing to schedule.
    stages = [s for s in stages if all(stages_dim > 0 for stages_dim in s.shape)]
    records, kept = _inline_intermediates(stages)
    inlined = {s.name for s in stages} - {s.name for s in kept}
    handled: set[str] = set()
    anchor = next((s for s in kept if s.op in ANCHOR_OPS and s.reduce_axes), None)
    if anchor is not None:
        epilogue = _epilogue_of(anchor, kept, inlined, stages)
        layout = anchor.note("layout")
        if anchor.op == "Conv" and layout in ("nchwc", "nchwc_depthwise"):
            tile = NCHWC_TILE if layout == "nchwc" else NCHWC_DEPTHWISE_TILE
            records += nchwc_conv_schedule(anchor, epilogue, tile)
            handled.add(anchor.name)
        elif anchor.op == "Conv" and len(anchor.shape) == 4 and layout in ("packed", "depthwise"):
            depthwise = layout == "depthwise"
            records += conv_schedule(anchor, epilogue, depthwise, anchor.note("block"))
            handled.add(anchor.name)
        elif anchor.op in ("MatMul", "Gemm") and len(anchor.shape) >= 2:
            records += matmul_schedule(anchor, epilogue, anchor.note("panel") or 32)
            handled.add(anchor.name)
        if epilogue is not None and anchor.name in handled:
            handled.add(epilogue.name)
    for stage in kept:
        if stage.name not in handled:
            records += generic_schedule(stage)
    return records
