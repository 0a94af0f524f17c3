"""Default GPU schedules for a fused group's lowered function, as schedule records.

The CPU schedules tile for vector registers and caches; a GPU wants many threads, each with a
little work, and consecutive threads touching consecutive addresses. The default here:
inline pure intermediates (padding included: a bounds test is cheaper than a copy through
global memory), then give every remaining stage one thread per output element, its
reduction accumulated in a register and its epilogue applied to the register before the one
store. Templates with knobs (`TEMPLATES`) refine the heavy stages; their defaults are what an
untuned build uses.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from compiler_core.kernels.schedules import (
    Knob,
    StageInfo,
    Template,
    Tunable,
    fuse_all,
    kept_by_builder,
)
from compiler_core.loop.ir import Load, PrimFunc, Store
from compiler_core.loop.transform import walk_exprs, walk_stmts
from compiler_core.schedule.primitives import (
    Bind,
    CacheRead,
    CacheWrite,
    ComputeInline,
    CrossThreadReduce,
    Record,
    Reorder,
    ReverseComputeInline,
    Split,
    Unroll,
    apply,
)
from compiler_core.target import Target, gpu_limits

Config = Mapping[str, object]


def gpu_template(name: str, version: int, choices, default, records, fits=None) -> Template:
    """A GPU schedule family as the tuner's `Template`: `choices(stage, target)` names each
    knob's candidate values, `default(stage, target)` the untuned point, `records(stage,
    epilogue, config)` the schedule at a point, `fits(stage, config, target)` which points
    the shapes and the target allow."""

    def knobs(stage: StageInfo, target: Target) -> tuple[Knob, ...]:
        start = default(stage, target)
        return tuple(
            Knob(knob, values if start[knob] in values else (start[knob], *values), start[knob])
            for knob, values in choices(stage, target).items()
        )

    return Template(
        name,
        version,
        knobs,
        lambda stage, epilogue, config, _target: records(stage, epilogue, config),
        fits or (lambda _stage, _config, _target: True),
    )


def default_config(template: Template, stage: StageInfo, target: Target) -> dict[str, object]:
    return {knob.name: knob.default for knob in template.knobs(stage, target)}


def _inline_intermediates(stages: list[StageInfo]) -> tuple[list[Record], list[StageInfo]]:
    records, kept = [], []
    for s in stages:
        if s.pure and not s.output and not kept_by_builder(s):
            records.append(ComputeInline(s.name))
        else:
            kept.append(s)
    return records, kept


def _epilogue(
    stage: StageInfo, kept: list[StageInfo], inlined: set[str], stages
) -> StageInfo | None:
    """The pure output stage that reads only `stage` (through inlined stages), at its shape:
    folded into `stage`'s register write-back instead of a kernel of its own."""
    by_name = {s.name: s for s in stages}

    def sources(s: StageInfo) -> set[str]:
        found = set()
        for r in s.reads:
            found |= sources(by_name[r]) if r in inlined else {r}
        return found

    for s in kept:
        crop = len(s.shape) == len(stage.shape) and all(
            a <= b for a, b in zip(s.shape, stage.shape, strict=True)
        )
        if s.output and s.pure and s is not stage and crop and sources(s) == {stage.name}:
            return s
    return None


def _fused_spatial(stage: StageInfo) -> tuple[list[Record], str]:
    """Fuse the stage's spatial loops into one (outermost first); its name."""
    return fuse_all([stage.loop(k) for k in range(len(stage.shape))])


# --- one thread per element ---------------------------------------------------------------------


def _elementwise_knobs(stage: StageInfo, target: Target) -> dict[str, tuple]:
    most = gpu_limits(target).max_threads_per_block
    return {"threads": tuple(t for t in (64, 128, 256, 512, 1024) if t <= most)}


def _elementwise_default(stage: StageInfo, target: Target) -> dict[str, object]:
    return {"threads": 256}


def elementwise_records(
    stage: StageInfo, epilogue: StageInfo | None, config: Config
) -> list[Record]:
    """One thread per output element: the spatial loops fused and split into blocks of
    `threads`; a reduction accumulates in a register (cached around its reduction loops, so
    the register holds one element) and the epilogue is applied to it before the store."""
    records: list[Record] = []
    if not stage.shape:
        return records  # one element: the kernel split runs it as a one-thread kernel
    if stage.reduce_axes:
        records.append(CacheWrite(stage.name, stage.reduce_axes[0][0]))
        if epilogue is not None:
            records.append(ReverseComputeInline(epilogue.name))
    fused, name = _fused_spatial(stage)
    total = math.prod(stage.shape)
    blocks = Split(name, min(int(config["threads"]), total))
    return [
        *records,
        *fused,
        blocks,
        Bind(blocks.outer, "blockIdx.x"),
        Bind(blocks.inner, "threadIdx.x"),
    ]


# --- GEMM: block tiles through shared memory, a register tile per thread ---------------------


def _dense_shape(stage: StageInfo) -> tuple[int, int, int, int] | None:
    """(M, N, K, panel width) of a GEMM stage whose B is read in panels, else None."""
    panel = stage.note("panel")
    if stage.op not in ("MatMul", "Gemm") or len(stage.shape) < 2 or not panel:
        return None
    if len(stage.reduce_axes) != 1 or stage.shape[-1] % panel:
        return None
    return stage.shape[-2], stage.shape[-1], stage.reduce_axes[0][1], int(panel)


def _divisors(n: int, candidates) -> tuple[int, ...]:
    return tuple(c for c in candidates if c <= n and n % c == 0) or (1,)


def _dense_knobs(stage: StageInfo, target: Target) -> dict[str, tuple]:
    m, n, k, panel = _dense_shape(stage)  # type: ignore[misc]
    return {
        "block_m": _divisors(m, (1, 2, 4, 8, 16, 32, 64)),
        "thread_m": (1, 2, 4, 8),
        "thread_n": _divisors(panel, (1, 2, 4)),
        "block_k": _divisors(k, (4, 8, 16, 32)),
    }


def _dense_default(stage: StageInfo, target: Target) -> dict[str, object]:
    knobs = _dense_knobs(stage, target)
    block_m = max(b for b in knobs["block_m"] if b <= 32)
    thread_m = max(t for t in (1, 2, 4) if block_m % t == 0)
    return {
        "block_m": block_m,
        "thread_m": thread_m,
        "thread_n": 1,
        "block_k": max(b for b in knobs["block_k"] if b <= 16),
    }


def dense_records(stage: StageInfo, epilogue: StageInfo | None, config: Config) -> list[Record]:
    """C[.., M, N] = A[.., M, K] B[.., K, N] with B read in panels of P columns: a block
    computes block_m rows of one panel; thread (y, x) owns thread_m rows x thread_n adjacent
    columns in registers (with thread_n = 1 the threads of a warp read and write consecutive
    columns); the K loop walks block_k slices, A's and B's staged through shared memory."""
    m, n, k, panel = _dense_shape(stage)  # type: ignore[misc]
    bm, tm = int(config["block_m"]), int(config["thread_m"])
    tn, bk = int(config["thread_n"]), int(config["block_k"])
    rank = len(stage.shape)
    i, j, (r, _) = stage.loop(rank - 2), stage.loop(rank - 1), stage.reduce_axes[0]
    batch_fuse, batch = _fused_batch(stage, rank - 2)
    # Blocks of rows and of panels; in a block, threads of tm rows and of tn columns.
    panels, block_rows, slices = Split(j, panel), Split(i, bm), Split(r, bk)
    columns, rows = Split(panels.inner, tn), Split(block_rows.inner, tm)
    records: list[Record] = [
        panels,
        columns,
        block_rows,
        rows,
        slices,
        *batch_fuse,
        Reorder(
            (
                *([batch] if batch else []),
                block_rows.outer,
                panels.outer,
                rows.outer,
                columns.outer,
                slices.outer,
                slices.inner,
                rows.inner,
                columns.inner,
            )
        ),
        CacheWrite(stage.name, slices.outer),
    ]
    if epilogue is not None:
        records.append(ReverseComputeInline(epilogue.name))
    records += [
        *([Bind(batch, "blockIdx.z")] if batch else []),
        Bind(block_rows.outer, "blockIdx.y"),
        Bind(panels.outer, "blockIdx.x"),
        Bind(rows.outer, "threadIdx.y"),
        Bind(columns.outer, "threadIdx.x"),
        Unroll(rows.inner),
        Unroll(columns.inner),
    ]
    records += [CacheRead(operand, slices.outer) for operand in stage.note("operands", ())]
    return records


def _fused_batch(stage: StageInfo, count: int) -> tuple[list[Record], str | None]:
    if count == 0:
        return [], None
    return fuse_all([stage.loop(d) for d in range(count)])


def dense_fits(stage: StageInfo, config: Config, target: Target) -> bool:
    """Tiles divide the GEMM (a guard may not wrap the barriers) and the block fits."""
    m, n, k, panel = _dense_shape(stage)  # type: ignore[misc]
    bm, tm = int(config["block_m"]), int(config["thread_m"])
    tn, bk = int(config["thread_n"]), int(config["block_k"])
    threads = (panel // tn) * (bm // tm)
    return (
        m % bm == 0
        and bm % tm == 0
        and panel % tn == 0
        and k % bk == 0
        and threads <= gpu_limits(target).max_threads_per_block
    )


# --- convolutions: a thread per output pixel, a register tile of channels or columns ------


def _is_conv(stage: StageInfo) -> bool:
    return stage.op == "Conv" and len(stage.shape) >= 3 and bool(stage.reduce_axes)


def _conv_knobs(stage: StageInfo, target: Target) -> dict[str, tuple]:
    channels, width = stage.shape[1], stage.shape[-1]
    return {
        "threads": (64, 128, 256, 512),
        "tile_axis": ("channel", "width"),
        "tile": tuple(t for t in (1, 2, 4, 8) if t <= max(channels, width)),
    }


# A dense conv's default channel tile leaves at least this many threads (outputs / tile):
# measured on an H200 (132 multiprocessors), every 3x3 conv of resnet18 from 28x28 down ran
# 1.4-3.4x faster with one channel per thread than with the former 4 (14x14x256: 106 us
# against 253; the grid had too few threads to hide the loads' latency), while the
# 112x112 stem, with 16x the outputs, ran fastest with 8 (28.6 us, 34.7 with 4). Over the
# model's conv tasks: 3.51 ms of kernels with the former default, 1.71 with this rule, 1.54
# tuned.
CONV_GRID_THREADS = 65536


def _conv_default(stage: StageInfo, target: Target) -> dict[str, object]:
    """Channels share each input value (a dense conv): a tile of channels per thread, the
    largest of 8, 4 or 2 that leaves CONV_GRID_THREADS threads, else one. A depthwise conv's
    channels share nothing: a tile of adjacent columns, whose input windows overlap,
    instead."""
    channels, width = stage.shape[1], stage.shape[-1]
    depthwise = _reduction_length(stage) <= 49  # no input-channel axis worth the name
    if not depthwise:
        outputs = math.prod(stage.shape)
        tiles = (t for t in (8, 4, 2) if channels % t == 0 and outputs // t >= CONV_GRID_THREADS)
        return {"threads": 128, "tile_axis": "channel", "tile": next(tiles, 1)}
    tile = 2 if width % 2 == 0 else 1
    return {"threads": 128, "tile_axis": "width", "tile": tile}


def conv_fits(stage: StageInfo, config: Config, target: Target) -> bool:
    axis = 1 if config["tile_axis"] == "channel" else len(stage.shape) - 1
    return stage.shape[axis] % int(config["tile"]) == 0


def conv_records(stage: StageInfo, epilogue: StageInfo | None, config: Config) -> list[Record]:
    """A thread computes `tile` outputs along the channel or width axis, accumulated in
    registers over the whole reduction (each input value loaded once for all of them); the
    remaining spatial loops are fused, a block of `threads` threads per chunk."""
    rank, tile = len(stage.shape), int(config["tile"])
    axis = 1 if config["tile_axis"] == "channel" else rank - 1
    tiled = Split(stage.loop(axis), tile)
    reductions = [name for name, _ in stage.reduce_axes]
    outer = [tiled.outer if k == axis else stage.loop(k) for k in range(rank)]
    records: list[Record] = [
        tiled,
        Reorder((*outer, *reductions, tiled.inner)),
        CacheWrite(stage.name, reductions[0]),
    ]
    if epilogue is not None:
        records.append(ReverseComputeInline(epilogue.name))
    records.append(Unroll(tiled.inner))
    fused, name = fuse_all(outer)
    total = math.prod(stage.shape) // tile
    blocks = Split(name, min(int(config["threads"]), total))
    return [
        *records,
        *fused,
        blocks,
        Bind(blocks.outer, "blockIdx.x"),
        Bind(blocks.inner, "threadIdx.x"),
    ]


# --- row reductions: a block per output element, a shared-memory tree ----------------------

# Below this many elements a reduction runs in one thread per output (a tree's barriers
# would cost more than they save).
MIN_CROSS_THREAD = 64


def _reduction_length(stage: StageInfo) -> int:
    return math.prod(extent for _, extent in stage.reduce_axes)


def _row_knobs(stage: StageInfo, target: Target) -> dict[str, tuple]:
    most = gpu_limits(target).max_threads_per_block
    length = _reduction_length(stage)
    return {
        "threads": tuple(t for t in (32, 64, 128, 256, 512, 1024) if t <= most and t < 2 * length)
    }


def _row_default(stage: StageInfo, target: Target) -> dict[str, object]:
    return {"threads": max(t for t in _row_knobs(stage, target)["threads"] if t <= 256)}


def row_records(stage: StageInfo, epilogue: StageInfo | None, config: Config) -> list[Record]:
    records: list[Record] = [CrossThreadReduce(stage.name, int(config["threads"]))]
    if epilogue is not None:
        records.append(ReverseComputeInline(epilogue.name))
    return records


def _is_dot_products(stage: StageInfo) -> bool:
    """A GEMM of one row (a batch-1 dense layer): N dot products of length K. The tiled
    template would run N / panel blocks of `panel` threads, each thread walking all of K
    alone between barriers (the batch-1 MLP's 784x512 layers took 36-39 us each on an H200);
    a block per output whose threads fold K together keeps every multiprocessor busy."""
    shape = _dense_shape(stage)
    return shape is not None and shape[0] == 1 and shape[2] >= MIN_CROSS_THREAD


def _is_row_reduction(stage: StageInfo) -> bool:
    return (
        bool(stage.reduce_axes)
        and not _is_conv(stage)
        and _dense_shape(stage) is None
        and _reduction_length(stage) >= MIN_CROSS_THREAD
    )


TEMPLATES: dict[str, Template] = {
    "gpu_dense": gpu_template(
        "gpu_dense", 1, _dense_knobs, _dense_default, dense_records, dense_fits
    ),
    "gpu_conv": gpu_template("gpu_conv", 1, _conv_knobs, _conv_default, conv_records, conv_fits),
    "gpu_row_reduction": gpu_template(
        "gpu_row_reduction", 1, _row_knobs, _row_default, row_records
    ),
    "gpu_elementwise": gpu_template(
        "gpu_elementwise", 1, _elementwise_knobs, _elementwise_default, elementwise_records
    ),
}


def gpu_schedule_for(
    stages: list[StageInfo],
    target: Target,
    configs: Mapping[str, Config] | None = None,
    plain: bool = False,
    func: PrimFunc | None = None,
) -> list[Record]:
    """The group's GPU schedule: intermediates inlined, then each remaining stage's template
    at its configuration (`configs`, by stage name) or its default point. `plain` gives every
    stage the one-thread-per-element template (the fallback when a refined template's
    schedule fails a GPU check). With the lowered `func`, templates that stage operands
    through shared memory learn which buffers each stage reads once intermediates are
    inlined."""
    stages = [s for s in stages if all(d > 0 for d in s.shape)]
    records, kept = _inline_intermediates(stages)
    if func is not None:
        kept = _with_operands(kept, apply(func, records))
    inlined = {s.name for s in stages} - {s.name for s in kept}
    folded: set[str] = set()
    for stage in kept:
        if stage.name in folded:
            continue
        template = TEMPLATES["gpu_elementwise"] if plain else template_for(stage, target)
        epilogue = _epilogue(stage, kept, inlined, stages) if stage.reduce_axes else None
        config = default_config(template, stage, target)
        config.update((configs or {}).get(stage.name, {}))
        records += template.schedule(stage, epilogue, config, target)
        if epilogue is not None:
            folded.add(epilogue.name)
    return records


def gpu_tunable_of(stages: list[StageInfo], target: Target, func: PrimFunc) -> Tunable | None:
    """The group's heaviest stage with a refined GPU template, as the tuner's `Tunable`."""
    stages = [s for s in stages if all(d > 0 for d in s.shape)]
    records, kept = _inline_intermediates(stages)
    kept = _with_operands(kept, apply(func, records))
    inlined = {s.name for s in stages} - {s.name for s in kept}
    candidates = [s for s in kept if template_for(s, target).name != "gpu_elementwise"]
    if not candidates:
        return None
    anchor = max(candidates, key=_work)
    template = template_for(anchor, target)
    epilogue = _epilogue(anchor, kept, inlined, stages)
    return Tunable(template, anchor, epilogue, template.knobs(anchor, target), target)


def _work(stage: StageInfo) -> int:
    return math.prod(stage.shape) * math.prod(e for _, e in stage.reduce_axes)


def _with_operands(stages: list[StageInfo], func: PrimFunc) -> list[StageInfo]:
    """Each stage with the note `operands`: the buffers its stores read, itself excluded."""
    result = []
    for stage in stages:
        names: list[str] = []
        for s in walk_stmts(func.body):
            if isinstance(s, Store) and s.buffer.name == stage.name:
                for x in walk_exprs(s.value):
                    name = x.buffer.name if isinstance(x, Load) else None
                    if name and name != stage.name and name not in names:
                        names.append(name)
        result.append(dataclasses.replace(stage, notes=(*stage.notes, ("operands", tuple(names)))))
    return result


def template_for(stage: StageInfo, target: Target) -> Template:
    """The refined template of a stage when it has one whose default point fits."""
    if _is_dot_products(stage):
        return TEMPLATES["gpu_row_reduction"]
    if _dense_shape(stage) is not None:
        template = TEMPLATES["gpu_dense"]
        if dense_fits(stage, default_config(template, stage, target), target):
            return template
    if _is_conv(stage):
        template = TEMPLATES["gpu_conv"]
        if conv_fits(stage, default_config(template, stage, target), target):
            return template
    if _is_row_reduction(stage):
        return TEMPLATES["gpu_row_reduction"]
    return TEMPLATES["gpu_elementwise"]
