"""Default CPU schedules for a fused group's lowered function.

A group's stages are named by the kernel context (`conv3`, `relu4`, `padconv3`...); their
loops are `<stage>_i<k>` (spatial) and `<stage>_<axis>` (reduction). The default schedule
inlines pure intermediate stages, gives the heavy anchor (conv, matmul, gemm) a register-tiled
schedule with its epilogue folded into the single store, and parallelizes and vectorizes the
rest. Everything is a list of records: the tuner replaces these defaults with measured ones.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping, Sequence

from compiler_core.kernels.weight_prefetch import MIN_INTENSITY
from compiler_core.loop.ir import Block, Expr, For, ForKind, IfThenElse, Load, PrimFunc, Store
from compiler_core.loop.transform import (
    find_loop,
    flat_index,
    lane_stride,
    loops_above,
    walk_exprs,
    walk_stmts,
)
from compiler_core.schedule.primitives import (
    CACHE_LINE_BYTES,
    MAX_VECTOR_LANES,
    CacheWrite,
    ComputeAt,
    ComputeInline,
    Fuse,
    Parallel,
    PrefetchNext,
    Record,
    Reorder,
    ReverseComputeInline,
    Split,
    SplitOverlap,
    Unroll,
    Vectorize,
)
from compiler_core.target import Target


def max_accumulators(target: Target) -> int:
    """A register tile of accumulators, with room left for a weight vector, a broadcast input
    and an address or two: 28 of AVX-512's 32 registers, 12 of AVX2's 16."""
    return target.vector_registers - 4


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


def kept_by_builder(s: StageInfo) -> bool:
    """A stage no schedule inlines: a rank-0 stage (a single store, no nest to inline), one
    its builder notes `materialize` (read many times over: inlined, it would be recomputed at
    every read), or a recurrence's update (`state`: it writes the row its loop carries on)."""
    return not s.shape or bool(s.note("materialize")) or bool(s.note("state"))


def _inline_intermediates(stages: list[StageInfo]) -> tuple[list[Record], list[StageInfo]]:
    """Inline every pure intermediate stage, except the ones a builder asks to keep and padding
    that feeds a convolution with enough arithmetic per input value to pay for a copy without
    bounds tests. A depthwise conv has too little: it reads its padding through bounds tests
    rather than a copy of its input."""
    depthwise_reads = {
        read for s in stages if s.note("layout") == "nchwc_depthwise" for read in s.reads
    }
    chained = _chained_epilogues(stages)
    records, kept = [], []
    for s in stages:
        keep_padding = s.name.startswith("pad") and s.name not in depthwise_reads
        # A row kernel's output that another stage reads (attention's probabilities, which
        # its second GEMM reads once per column tile) is computed once, not at each read.
        row_output = bool(s.note("row_stages"))
        keep = keep_padding or kept_by_builder(s) or s.name in chained or row_output
        if s.pure and not s.output and not keep:
            records.append(ComputeInline(s.name))
        else:
            kept.append(s)
    return records, kept


def _chained_epilogues(stages: list[StageInfo]) -> set[str]:
    """The last stage of each expand conv's epilogue that a depthwise conv reads (through its
    padding): kept, so that a chained group's expand conv applies it once, in the store of its
    tile (`nchwc_chain_schedule`), not the depthwise conv at each of its taps."""
    by_name = {s.name: s for s in stages}

    def feeds_from_conv(stage: StageInfo) -> bool:  # pure stages back to a blocked conv
        for read in stage.reads:
            source = by_name.get(read)
            if source is None:
                continue
            if source.note("layout") == "nchwc" and source.reduce_axes:
                return True
            if source.pure and feeds_from_conv(source):
                return True
        return False

    kept = set()
    for dw in stages:
        if dw.note("layout") != "nchwc_depthwise":
            continue
        for read in dw.reads:
            stage = by_name.get(read)
            if stage is not None and stage.name.startswith("pad") and len(stage.reads) == 1:
                stage = by_name.get(stage.reads[0])
            if stage is not None and stage.pure and not stage.output and feeds_from_conv(stage):
                kept.add(stage.name)
    return kept


def _epilogue_of(anchor: StageInfo, kept: list[StageInfo], inlined: set[str], all_stages):
    """The output stage that reads the anchor (after inlining), if it is a pure epilogue."""
    by_name = {s.name: s for s in all_stages}

    def reaches(stage: StageInfo) -> bool:
        return any(r == anchor.name or (r in inlined and reaches(by_name[r])) for r in stage.reads)

    for s in kept:
        # A padded GEMM's epilogue covers the real rows and columns (it crops the product);
        # an im2col conv's reads its rows of channels as the output's channel axis.
        shapes = (anchor.shape, anchor.note("real_shape"), anchor.note("epilogue_shape"))
        if s.output and s.pure and s is not anchor and s.shape in shapes and reaches(s):
            return s
    return None


def _kept_sources(stage: StageInfo, inlined: set[str], all_stages) -> set[str]:
    """The kept stages `stage` reads, through the inlined ones (a residual Add inlined into
    the ReLU after it reads the conv's output and only kernel inputs besides)."""
    by_name = {s.name: s for s in all_stages}
    sources: set[str] = set()
    pending = list(stage.reads)
    while pending:
        name = pending.pop()
        if name in inlined:
            pending.extend(by_name[name].reads)
        else:
            sources.add(name)
    return sources


def _vector_tile_io(cache: CacheWrite, rank: int) -> list[Record]:
    """Vectorize the accumulator tile's zero fill and its store (which carries the epilogue)
    along the tile's innermost axis (of `rank`), as the reduction itself is: left scalar and
    unrolled, LLVM's SLP vectorizer does not reassemble them (MobileNetV2's 1x1 convs ran 2.5x
    slower)."""
    return [Vectorize(cache.init_loop(rank - 1)), Vectorize(cache.store_loop(rank - 1))]


def fuse_all(loops: Sequence[str]) -> tuple[list[Record], str]:
    """Fuse `loops` (outermost first, each directly inside the one before) into one loop: the
    records, and the fused loop (the first loop itself when there is only one)."""
    records: list[Record] = []
    fused = loops[0]
    for loop in loops[1:]:
        record = Fuse(fused, loop)
        records.append(record)
        fused = record.fused
    return records, fused


def conv_schedule(
    conv: StageInfo, epilogue: StageInfo | None, block: int, target: Target
) -> list[Record]:
    """A plain-layout conv whose filters are packed in blocks of `block` output channels:
    a tile of pixels along the row x one block, the block vectorized."""
    n_loop, m_loop, y_loop, x_loop = (conv.loop(k) for k in range(4))
    width = conv.shape[3]
    reduce_loops = [name for name, _ in conv.reduce_axes]
    records: list[Record] = []
    cache = CacheWrite(conv.name, reduce_loops[0])
    most = max_accumulators(target) // max(block // target.vector_lanes, 1)
    tile = _largest_divisor(width, tuple(range(min(8, most), 1, -1)))
    channels, pixels = Split(m_loop, block), Split(x_loop, tile)
    records += [channels, pixels]
    records += [
        Reorder(
            (
                n_loop,
                channels.outer,
                y_loop,
                pixels.outer,
                *reduce_loops,
                pixels.inner,
                channels.inner,
            )
        )
    ]
    records += [
        cache,
        Vectorize(channels.inner),
        Unroll(pixels.inner),
        *_vector_tile_io(cache, len(conv.shape)),
    ]
    if epilogue is not None:
        records.append(ReverseComputeInline(epilogue.name))
    planes = Fuse(channels.outer, y_loop)
    return [*records, planes, Parallel(planes.fused)]


def nchwc_conv_schedule(
    conv: StageInfo, epilogue: StageInfo | None, config: Mapping[str, object], target: Target
) -> list[Record]:
    """Conv writing NC[D][H]W[b]c (1, 2 or 3 spatial axes): `tile` output pixels of a row (the
    last spatial axis) x `mo_tile` b-channel blocks held in registers over the whole reduction
    (broadcast an input value, FMA with a weight vector per block). Output-channel blocks go
    in chunks of `mo_chunk`, the blocks of a chunk innermost around each tile: they reuse the
    tile's input window from cache while their weights stay in L2 (with chunks of one block,
    every block streams the whole input). The parallel loop is chunks x the outer spatial axes
    (x row tiles, with `parallel=mo_y_x` or when that leaves under 4 chunks of work per core),
    the rows first when the input outweighs the weights (`rows_before_channels`; a 1-D conv of
    plain data: its row tiles; the chunk's weights are then not prefetched: they are small,
    and each thread reads them all).
    Knobs: tile, mo_tile, mo_chunk, the reduction order (input-channel blocks or kernel taps
    outermost), whether the taps along the row are unrolled, the parallel loops."""
    rank = len(conv.shape)
    n_loop, mo_loop, mi_loop = conv.loop(0), conv.loop(1), conv.loop(rank - 1)
    rows = [conv.loop(k) for k in range(2, rank - 2)]  # spatial axes outside the row
    x_loop = conv.loop(rank - 2)
    reduce_loops = [name for name, _ in conv.reduce_axes]
    taps = [name for name in reduce_loops if _is_tap(conv, name)]
    if config["reduce_order"] == "taps_outer":
        reduce_loops = [*taps, *(name for name in reduce_loops if name not in taps)]
    tile, chunk, blocks = int(config["tile"]), int(config["mo_chunk"]), int(config["mo_tile"])
    pixels = Split(x_loop, tile)
    records: list[Record] = [pixels]
    outer, inner, tile_blocks = [mo_loop], [], []
    if chunk > 1:
        chunked = Split(mo_loop, chunk)
        records.append(chunked)
        outer, inner = [chunked.outer], [chunked.inner]
    if blocks > 1:  # the register tile spans `blocks` channel blocks of the chunk
        paired = Split((inner or outer)[0], blocks)
        records.append(paired)
        if inner:
            inner = [paired.outer]
        else:
            outer = [paired.outer]
        tile_blocks = [paired.inner]
    cache = CacheWrite(conv.name, reduce_loops[0])
    rows_first = bool(rows) and rows_before_channels(conv)
    tiles_first = config["parallel"] == TILES_FIRST
    # The loops the threads split, outermost first (`rows_before_channels`), then the rest.
    if tiles_first:
        split, tiles = [pixels.outer, *outer], []
    else:
        split, tiles = [*rows, *outer] if rows_first else [*outer, *rows], [pixels.outer]
    records += [
        Reorder(
            (
                n_loop,
                *split,
                *tiles,
                *inner,
                *reduce_loops,
                pixels.inner,
                *tile_blocks,
                mi_loop,
            )
        ),
        cache,
        Vectorize(mi_loop),
        Unroll(pixels.inner),
        *(Unroll(loop) for loop in tile_blocks),
        *_vector_tile_io(cache, rank),
    ]
    if config.get("unroll_kw") and taps:
        records.append(Unroll(taps[-1]))  # the taps along the row
    if epilogue is not None:
        records.append(ReverseComputeInline(epilogue.name))
    spread = list(split)
    chunks = conv.shape[1] // max(chunk, blocks) * math.prod(conv.shape[2 : rank - 2])
    if not tiles_first and (config["parallel"] == "mo_y_x" or chunks < 4 * target.cores):
        spread.append(pixels.outer)
    if config.get("prefetch") and not rows_first and not tiles_first:
        extents = {
            **{loop: conv.shape[k] for k, loop in enumerate(rows, start=2)},
            pixels.outer: -(-conv.shape[rank - 2] // tile),
            **{loop: chunk // blocks for loop in inner},
            **dict(conv.reduce_axes),
        }
        blocks_per_chunk = max(chunk, blocks)
        records.append(
            _weights_prefetch(conv, outer[0], blocks_per_chunk, extents, len(spread) - 1)
        )
    fused, parallel = fuse_all(spread)
    return [*records, *fused, Parallel(parallel)]


def rows_before_channels(*convs: StageInfo) -> bool:
    """Whether a conv's parallel loop (or a chain's, `convs` its convs in order) hands the
    threads rows before channel chunks: when its weights are smaller than its input. Split
    by output channels, every thread reads the whole input and half the weights; split by
    rows, half the input (the rows the thread itself wrote in the kernel before, as
    kiln_claim keeps each thread on its home range of a loop) and all the weights. Inside a
    model the input of a 1x1 conv of MobileNetV2's 14x14 blocks (301 KB; 98 KB of weights)
    then comes from the thread's own L2: 56 -> 42 us (Xeon, 2 threads); its last 1x1 conv
    (62 KB in, 1.6 MB of weights) ran 16% slower split by rows. Convs whose builder did not
    note the sizes (a Winograd GEMM) keep channels first."""
    weights = sum(conv.note("weight_bytes", math.inf) for conv in convs)
    return weights < convs[0].note("input_bytes", 0)


def _weights_prefetch(
    conv: StageInfo, chunk_loop: str, blocks: int, extents: dict[str, int], fused: int
) -> PrefetchNext:
    """Prefetch the next chunk's weights during this chunk's rows: a line or a few at the
    top of every iteration of the deepest loop (in `extents`' order, the loops inside the
    chunk loop) whose iterations, counted from the chunk loop down, do not outnumber the
    lines. The first `fused` loops join the parallel loop later, so no prefetch goes there."""
    # One output-channel block's weights: its share of the packed weights where the builder
    # noted their size (any dtype), else float32 reduction x block.
    per_block = (
        conv.note("weight_bytes") // conv.shape[1]
        if conv.note("weight_bytes")
        else 4 * math.prod(extent for _, extent in conv.reduce_axes) * conv.shape[-1]
    )
    lines = blocks * per_block // CACHE_LINE_BYTES
    loops = list(extents.items())
    at = loops[fused][0]
    steps = math.prod(extent for _, extent in loops[: fused + 1])
    for loop, extent in loops[fused + 1 :]:
        steps *= extent
        if steps > lines:
            break
        at = loop
    return PrefetchNext(conv.note("weights"), chunk_loop, at)


def _is_tap(conv: StageInfo, loop: str) -> bool:
    """Whether a reduction loop of a conv walks kernel taps (`rk<j>`), not channels."""
    return loop[len(conv.name) + 1 :].startswith("rk")


def _reduces_channels(conv: StageInfo) -> bool:
    """Whether a conv sums over input channels as well as taps (all but a depthwise one)."""
    return any(not _is_tap(conv, name) for name, _ in conv.reduce_axes)


def _nchwc_most(block: int, target: Target) -> int:
    """Output pixels a register tile of one b-channel block can hold (a 16-channel block on an
    8-lane target takes two registers per pixel)."""
    return max_accumulators(target) // max(block // target.vector_lanes, 1)


def _nchwc_preferred(depthwise: bool, block: int, target: Target) -> int:
    """The default tile's upper bound: accumulators in at most half the registers, the other
    half left for the weight vectors and input broadcasts that LLVM keeps live across the
    unrolled taps of a short kernel (12 accumulators spill on AVX2: a 1-D stride-2 conv ran
    20% slower than with 8), and at most NCHWC_TILE pixels."""
    vectors = max(block // target.vector_lanes, 1)
    half = target.vector_registers // 2 // vectors
    return min(NCHWC_DEPTHWISE_TILE if depthwise else NCHWC_TILE, half, _nchwc_most(block, target))


def nchwc_default_tile(
    width: int,
    block: int,
    depthwise: bool,
    out_blocks: int,
    target: Target,
    group_blocks: int | None = None,
    taps: bool = True,
) -> tuple[int, int]:
    """(pixels, channel blocks) of the default register tile: see `_default_tile`."""
    tile, blocks, _ = _default_tile(width, block, depthwise, out_blocks, target, group_blocks, taps)
    return tile, blocks


def _default_tile(
    width: int,
    block: int,
    depthwise: bool,
    out_blocks: int,
    target: Target,
    group_blocks: int | None,
    taps: bool = True,
) -> tuple[int, int, bool]:
    """The default register tile of a row of `width` pixels: (pixels, channel blocks, whether
    it is a latency tile), or 0 pixels when no good tile divides the row (see
    nchwc_row_width).

    Two channel blocks per tile when the blocks pair up (not for a depthwise conv, whose
    blocks share no input): each input broadcast then feeds two FMAs, which took 15-33% off
    1-D, 3-D and stem convs on AVX2 and changed nothing on a 3x3 conv. A tile has at least
    half the pixels its accumulator budget allows; failing that, one block with more pixels;
    a row that fits one tile is one tile. Between the two, the tile with more accumulators
    wins (two blocks on a tie): a 14-pixel row has 2 pixels x 2 blocks or 7 x 1, and the four
    accumulators of the first left ResNet-18's 14x14 3x3 convs at 82 GFLOP/s against 146 with
    seven (AVX2). A tile still short of FMA_CHAINS accumulators takes `_latency_tile`. A conv
    without taps (`taps`: more than one kernel tap) may take `_triple_tile` first."""
    triple = None
    if not (depthwise or taps):
        triple = _triple_tile(width, block, out_blocks, target, group_blocks)
    if triple:
        return (*triple, False)
    preferred = _nchwc_preferred(depthwise, block, target)
    # Blocks pair up only within a group: a grouped conv's blocks of different groups read
    # different inputs (as a depthwise conv's do), so a pair would share no broadcast.
    pair_up = (group_blocks or out_blocks) % 2 == 0
    options = [2, 1] if not depthwise and pair_up and preferred >= 2 else [1]
    candidates = []
    for blocks in options:
        bound = preferred // blocks
        divisor = next((t for t in range(bound, -(-bound // 2) - 1, -1) if width % t == 0), 0)
        if divisor:
            candidates.append((divisor * blocks, blocks, divisor))
    best = max(candidates, default=None)
    if not depthwise and (best is None or best[0] < FMA_CHAINS):
        latency_tile = _latency_tile(width, block, group_blocks or out_blocks, target)
        if latency_tile:
            return (*latency_tile, True)
    if best:
        _, blocks, divisor = best
        return divisor, blocks, False
    if width <= preferred // options[0]:
        return width, options[0], False
    return 0, options[0], False


def _triple_tile(
    width: int, block: int, out_blocks: int, target: Target, group_blocks: int | None
) -> tuple[int, int] | None:
    """Three channel blocks per tile of a conv without taps (a 1x1 conv, a Winograd GEMM),
    for output blocks that do not pair up but come in threes (24 channels: MobileNet's 56x56
    stage), on a target whose FMAs cannot take a broadcast operand (AVX2), or whose blocks
    are narrower than its vectors (8-channel blocks on AVX-512: ymm FMAs, two a cycle, each
    with its broadcast load where a tile of one block shares none): each broadcast input then
    feeds three FMAs instead of one, and the tile has as many pixels as the accumulators
    allow. Measured on Zen 1 (AVX2, one 256-bit FMA a cycle), MobileNetV2's
    56x56 project convs (96 and 144 -> 24 channels) against the one-block tile of 8 pixels:
    245 -> 195 us and 382 -> 290 us (59 -> 74 GFLOP/s, the peak 78); 2 pixels x 3 blocks
    201 and 305 us. With taps, the three weight vectors of each tap join the twelve
    accumulators in the sixteen registers: a 3x3 conv to 24 channels ran 494 us in 4 x 3
    tiles, 436 in 8 x 1. On Zen 4 (AVX-512, 24 channels in 8-channel blocks), MobileNetV2's
    56x56 project convs alone: 8 pixels x 3 blocks 99 and 66 us against 113 and 73 with
    14 x 1 (bench.transfer's measured tables, every config of the two)."""
    pair_up, come_in_threes = out_blocks % 2 == 0, (group_blocks or out_blocks) % 3 == 0
    broadcasts_free = target.fma_broadcasts and block >= target.vector_lanes
    if broadcasts_free or pair_up or not come_in_threes:
        return None
    bound = _nchwc_most(block, target) // 3
    pixels = next((t for t in range(bound, 1, -1) if width % t == 0), 0)
    return (pixels, 3) if pixels else None


# Accumulators a register tile needs to keep the FMA pipes busy: FMA latency (4 cycles) x
# pipes (2) on Zen 3/4 and Intel's AVX-512 cores. With fewer, every reduction step waits on
# its own chain: a 7-pixel tile of one block (AVX2, 14- and 7-pixel rows) ran 10-20% slower
# than the 8-accumulator tiles below.
FMA_CHAINS = 8


def _latency_tile(
    width: int, block: int, group_blocks: int, target: Target
) -> tuple[int, int] | None:
    """A tile of FMA_CHAINS accumulators for a row whose divisors give fewer: 2 pixels x 4
    blocks when 2 divides the row, else 4 pixels x 2 blocks with a partial last tile (its
    pixels past the row are guarded off; a guard invariant over the reduction costs little).
    The blocks of a tile come from one group (`group_blocks` output blocks per group), so that
    they share each input broadcast. Measured on AVX2 (Zen 3) against 7 pixels x 1 block:
    ResNeXt-50's and MobileNetV2's 1x1 convs on 14-pixel rows +3-15% with 2 x 4, on 7-pixel
    rows +10-20% with 4 x 2 (2 x 4 there, a guarded 2-pixel tile, was slower)."""
    vectors = max(block // target.vector_lanes, 1)
    for blocks in (4, 2):
        pixels = FMA_CHAINS // (blocks * vectors)
        whole = width % pixels == 0 if blocks == 4 else width > pixels
        fits = pixels and pixels * blocks * vectors <= _nchwc_most(block, target)
        if whole and fits and group_blocks % blocks == 0:
            return pixels, blocks
    return None


def nchwc_row_width(
    width: int,
    block: int,
    depthwise: bool,
    out_blocks: int,
    target: Target,
    group_blocks: int | None = None,
    taps: bool = True,
) -> int:
    """Output pixels per row the blocked conv computes: `width` when a good default tile
    divides it, else `width` rounded up to the tile that wastes least (a tile costs its pixels
    plus about two pixels' worth of overhead: the zero fill and the store), so that a prime
    row length does not fall to a tile of 1."""
    tile, blocks = nchwc_default_tile(
        width, block, depthwise, out_blocks, target, group_blocks, taps
    )
    if tile:
        return width
    bound = _nchwc_preferred(depthwise, block, target) // blocks
    tiles = range(-(-bound // 2), bound + 1)
    best = min(tiles, key=lambda t: (-(-width // t) * (t + 2), -t))
    return -(-width // best) * best


def _nchwc_knobs(conv: StageInfo, target: Target) -> tuple[Knob, ...]:
    width, block, blocks = conv.shape[-2], conv.shape[-1], conv.shape[1]
    depthwise = conv.note("layout") == "nchwc_depthwise"
    most = _nchwc_most(block, target)
    group_blocks = conv.note("group_blocks")
    default_tile, default_blocks, latency = _default_tile(
        width, block, depthwise, blocks, target, group_blocks, _has_taps(conv)
    )
    if not default_tile:  # a row the builder did not pad: the largest tile that divides it
        bound = _nchwc_preferred(depthwise, block, target) // default_blocks
        default_tile = _largest_divisor(width, tuple(range(bound, 0, -1)))
    # Tiles that divide the row, and the default (a latency tile may leave a partial one).
    tiles = tuple(t for t in range(1, most + 1) if width % t == 0 or t == default_tile)
    chunks = (1,)
    if not depthwise:  # a depthwise block reads only its own channels
        # A Winograd GEMM's chunk stays inside one position's blocks (they share its input).
        span = group_blocks if conv.note("winograd") else blocks
        chunks = tuple(k for k in range(1, span + 1) if span % k == 0)
    default_chunk = _default_mo_chunk(conv, chunks, default_blocks)
    if latency:
        # A latency tile's blocks are its chunk: a 1-D conv's 4 x 2 tile ran at 150 GFLOP/s
        # in chunks of 2 blocks and at 91 in the 8 that fit NCHWC_CHUNK_BYTES (AVX2, Zen 3).
        default_chunk = default_blocks
    pairs = (1,)
    if not depthwise:  # channel blocks per tile
        pairs += tuple(b for b in (2, 3, 4) if blocks % b == 0 and most >= b)
    knobs = [
        Knob("tile", tiles, default_tile),
        Knob("mo_chunk", chunks, default_chunk),
        Knob("mo_tile", pairs, default_blocks),
        _parallel_knob(conv),
        # A depthwise tile loads an input vector per pixel and tap: with the row's taps
        # unrolled, the tile + k - 1 vectors of a kernel row are loaded once for all k taps
        # (a 7x7 depthwise conv ran 2.8x ORT rolled, 1.2x unrolled; 5x5 1.7x -> 0.8x). Knobs
        # that change nothing for a conv without taps (a 1x1 conv, a Winograd GEMM) have one
        # value, so that the space holds no duplicates.
        Knob("unroll_kw", (0, 1) if _has_taps(conv) else (0,), int(depthwise)),
    ]
    if _reduces_channels(conv) and _has_taps(conv):
        knobs.append(Knob("reduce_order", ("channels_outer", "taps_outer"), "channels_outer"))
    else:
        knobs.append(Knob("reduce_order", ("channels_outer",), "channels_outer"))
    if _reduces_channels(conv) and conv.note("weights"):
        # The next chunk's weights prefetched into L2 (`PrefetchNext`): inside a model they
        # come from L3 or memory, not from L2 as in a kernel timed alone (a Xeon's layer4
        # Winograd GEMM of ResNet-18 ran at 197 GFLOP/s with caches flushed, 317 prefetched;
        # hot, 359 and 383). Records logged before the knob ran without it.
        knobs.append(Knob("prefetch", (0, 1), 1, absent=0))
    return tuple(knobs)


def _parallel_knob(conv: StageInfo) -> Knob:
    """The loops the threads split: channel chunks x the outer spatial axes (`mo_y`, the
    rows first where `rows_before_channels`), with the row tiles too (`mo_y_x`), or, for a 1-D
    conv, which has no rows outside its row, the row tiles first (`x_mo`). That is the default
    for a 1-D conv of plain data whose input outweighs its weights: split by channels, each
    chunk reads every input channel's row in short pieces (wav2vec2's second extractor conv,
    512 x 3199 plain in, 3 MB of weights: 18.5 -> 14.6 ms, 2 threads, Xeon); blocked data is
    read in whole lines, and there row tiles first re-read all the weights for every tile (its
    third conv, 512 x 1599 blocked: 8.9 -> 12.1 ms)."""
    if len(conv.shape) != 4 or conv.note("winograd"):
        return Knob("parallel", ("mo_y", "mo_y_x"), "mo_y")
    plain_data = conv.note("plain_data", False) and rows_before_channels(conv)
    return Knob("parallel", ("mo_y", "mo_y_x", TILES_FIRST), TILES_FIRST if plain_data else "mo_y")


def _has_taps(conv: StageInfo) -> bool:
    """Whether a conv's kernel has more than one tap (a reduction loop over taps that moves)."""
    return any(_is_tap(conv, name) and extent > 1 for name, extent in conv.reduce_axes)


def _nchwc_fits(conv: StageInfo, config: Mapping[str, object], target: Target) -> bool:
    """The tile's accumulators fit the registers and its channel blocks divide the chunk."""
    blocks, chunk = int(config["mo_tile"]), int(config["mo_chunk"])
    fits = int(config["tile"]) * blocks <= _nchwc_most(conv.shape[-1], target)
    return fits and (chunk == 1 or chunk % blocks == 0)


def _default_mo_chunk(conv: StageInfo, chunks: tuple[int, ...], tile_blocks: int) -> int:
    """The most output-channel blocks (a multiple of the tile's) whose packed weights fit
    NCHWC_CHUNK_BYTES; 1 when a block's reduction is short: its input window is small, so
    chunks would only scatter the output writes over more blocks (a 1-D stem with 10 taps
    ran 20% slower in chunks of 32 blocks)."""
    per_block = math.prod(extent for _, extent in conv.reduce_axes) * conv.shape[-1] * 4
    if per_block < NCHWC_CHUNK_MIN_BYTES:
        return 1
    fitting = [k for k in chunks if k % tile_blocks == 0 and k * per_block <= NCHWC_CHUNK_BYTES]
    return max(fitting, default=1)


# A 1-D conv's parallel knob value: row tiles before channel chunks (`_parallel_knob`).
TILES_FIRST = "x_mo"
# Output pixels per register tile (at most max_accumulators(target) vectors).
NCHWC_TILE = 14
NCHWC_DEPTHWISE_TILE = 8
# Weights of one chunk of output-channel blocks: half of a small (512 KB) L2, so that the
# input window they share stays in cache too.
NCHWC_CHUNK_BYTES = 256 * 1024
NCHWC_CHUNK_MIN_BYTES = 4 * 1024


def gemm_row_tile(rows: int, target: Target, vectors: int = 2, row_bytes: int = 0) -> int:
    """Rows per register tile (mr) of a GEMM whose column tile is `vectors` vectors wide: all
    the rows when they fit one tile, else the tile between half the register budget and all
    of it that pads the rows least (49 rows: 5 x 10 tiles with AVX2, 7 x 7 with AVX-512),
    the larger on a tie: every such tile keeps both FMA pipes busy, and padded rows are work
    thrown away (512 rows on Zen 5: 8-row tiles 504 GFLOP/s, 12-row ones, 4 rows padded,
    454). The kernel builder pads the rows to a multiple of it.

    `row_bytes`, A's row stride when the tile reads A's rows along K: rows whose starts lie a
    multiple of 4 KB apart share an L1 set, and the tile streams every one of its rows at
    once: at most the set's ways less L1_PANEL_WAYS of them may share a set, or they evict
    each other every step (64x1024 @ 1024x1024: 13-row tiles ran at 190 GFLOP/s, 5-row
    tiles at 227 on Zen 4's 8 ways; 1024^3 on Zen 5's 12 ways: 4-row tiles 445 GFLOP/s,
    8-row ones 510)."""
    most = max(max_accumulators(target) // vectors, 1)
    if row_bytes:
        sets = L1_SET_STRIDE // math.gcd(row_bytes, L1_SET_STRIDE)  # distinct set offsets
        most = min(most, (target.l1_ways - L1_PANEL_WAYS) * sets)
    if rows <= most:
        return max(rows, 1)
    candidates = range(most, max(-(-most // 2), 1) - 1, -1)
    return min(candidates, key=lambda m: (-(-rows // m) * m, -m))


def packed_row_tile(rows: int, target: Target, vectors: int = 2) -> int:
    """Rows per register tile of a GEMM whose A is packed into row-tile panels (the packed-A
    algorithm: no row stride, so no L1 set limit): the most the registers hold where that
    pads the rows by at most PACKED_ROW_PAD of them, else `gemm_row_tile`'s least padding.
    A packed tile's rows share one stream, so more rows cost no more streams: with AVX2, 6
    rows (12 accumulators) where the direct GEMM takes 4 to pad none (64x1024x1024 on Zen 3:
    152 GFLOP/s packed with 6-row tiles, 136 with 4-row ones)."""
    most = max(max_accumulators(target) // vectors, 1)
    if rows <= most or -(-rows // most) * most - rows <= rows * PACKED_ROW_PAD:
        return min(rows, most)
    return gemm_row_tile(rows, target, vectors)


PACKED_ROW_PAD = 1 / 16


# L1 data cache: addresses a multiple of L1_SET_STRIDE apart share a set (32 KB and 8 ways on
# Zen 3/4, 48 KB and 12 ways on Zen 5 and Intel's recent cores: 4 KB either way). A tile may
# stream as many rows of A that share a set as the ways (Target.l1_ways) less two for B's panel.
L1_SET_STRIDE = 4096
L1_PANEL_WAYS = 2


def _gemm_rows(mm: StageInfo) -> tuple[int, bool]:
    """(rows of the GEMM, whether the batch loops fold into the row loop)."""
    rank = len(mm.shape)
    if rank > 2 and sum(d > 1 for d in mm.shape[:-1]) <= 1:
        return math.prod(mm.shape[:-1]), True
    return mm.shape[-2], False


def matmul_schedule(
    mm: StageInfo, epilogue: StageInfo | None, config: Mapping[str, object], target: Target
) -> list[Record]:
    """Register-tiled GEMM: an mr x nr tile of accumulators over the whole reduction
    (broadcast A, load a vector of B's packed panel, FMA), its epilogue (and the crop of the
    padded rows and columns) folded into the tile's store. Knobs: mr, nr, the order of the
    row-tile and column-tile loops, the parallel loop (`outer`: the outermost loop with work;
    `fused`: the batch loops fused with the first tile loop, or without batch loops both tile
    loops, so that every thread gets an even share), and `pack`: whether an activation B is
    packed into panels by a stage of its own (else the GEMM reads it where it is).

    Columns that nr does not divide go to a tail tile after the whole tiles
    (`gemm_column_tail`): its own nest, ending at the last column (197 columns: six tiles of
    32 and one of 8 at column 189), instead of padding the columns to a multiple of nr."""
    rank = len(mm.shape)
    batch_loops = [mm.loop(k) for k in range(rank - 2)]
    i_loop, j_loop = mm.loop(rank - 2), mm.loop(rank - 1)
    ((k_loop, _),) = mm.reduce_axes
    records: list[Record] = []
    if mm.note("pack") and not config["pack"]:
        records.append(ComputeInline(mm.note("pack")))
    pack_a = mm.note("pack_a")
    _, folded = _gemm_rows(mm)
    if folded:
        # A shared (packed) weight, and the rows spread over one dimension only: every batch
        # row is just another row of one GEMM (the fused index stays affine).
        fused, i_loop = fuse_all([*batch_loops, i_loop])
        records += fused
        batch_loops = []
    # Packing per batch (an im2col conv's columns of one output row): computed in the row's
    # loop, into a buffer that stays in L1.
    pack_at = bool(batch_loops and config["pack"] and mm.note("pack_per_batch"))
    if pack_at:
        records += _pack_at(mm.note("pack"), len(batch_loops), batch_loops[-1])
    mr, nr = int(config["mr"]), int(config["nr"])
    rows, cols = _gemm_rows(mm)[0], mm.shape[-1]
    row_tiles = -(-rows // mr)
    column_records, nests = _column_nests(i_loop, j_loop, k_loop, cols, nr, target)
    records += column_records
    tail = len(nests) > 1
    parallel: list[list[tuple[str, int]]] = []
    for nest in nests:
        row_tile = Split(nest.rows, mr)
        tiles = [(row_tile.outer, row_tiles)]
        if nest.column_tiles is not None:
            tiles.append((nest.column_tiles, nest.column_tile_count))
        if config["order"] == "ji":
            tiles = tiles[::-1]
        blocks: list[Record] = []
        if config.get("row_block"):  # fits: `ji`, one nest of whole column tiles
            block = Split(row_tile.outer, _row_block_tiles(config))
            blocks.append(block)
            tiles = [
                (block.outer, -(-row_tiles // block.factor)),
                tiles[0],
                (block.inner, block.factor),
            ]
        records += _gemm_tile(mm, nest, row_tile, [name for name, _ in tiles], target, blocks)
        if config.get("prefetch") and nest.column_tiles is not None:
            records.append(_panel_prefetch(mm, nest, tiles))
        if pack_a and config["pack_a_at"] == "tile":  # one nest, its row tiles outermost
            records += _pack_a_at(pack_a, row_tile.outer)
        parallel.append(tiles)
    if epilogue is not None:
        records.append(ReverseComputeInline(epilogue.name))
    batch = list(zip(batch_loops, mm.shape[: len(batch_loops)], strict=True))
    if not (tail or pack_at):
        return records + _gemm_parallel([*batch, *parallel[0]], len(batch), config)
    if batch:  # more than one nest inside the batch loops: the threads share the batches
        return records + _gemm_parallel(batch, len(batch), config)
    for tiles in parallel:  # the two nests side by side: each splits its own tiles
        records += _gemm_parallel(tiles, 0, config)
    return records


def _column_nests(
    i_loop: str, j_loop: str, k_loop: str, cols: int, nr: int, target: Target
) -> tuple[list[Record], list[_GemmNest]]:
    """A GEMM stage's columns in tiles of `nr`: the split, and its nests (the whole tiles',
    and where nr does not divide the columns the tail tile's, `gemm_column_tail`)."""
    tail = gemm_column_tail(cols, nr, target.vector_lanes)
    if not tail:
        whole = Split(j_loop, nr)
        return [whole], [_GemmNest(whole.outer, cols // nr, whole.inner, nr, i_loop, k_loop, "")]
    # The batch loops stay outermost (the stage's own order) above both nests.
    columns = SplitOverlap(j_loop, nr, tail)
    in_tail = columns.in_tail
    nests = [
        _GemmNest(columns.outer, cols // nr, columns.inner, nr, i_loop, k_loop, ""),
        _GemmNest(None, 1, columns.tail_loop, tail, in_tail(i_loop), in_tail(k_loop), "_t"),
    ]
    return [Reorder((j_loop, i_loop, k_loop)), columns], nests


@dataclasses.dataclass(frozen=True)
class _GemmNest:
    """The loops of one nest of a GEMM stage: its column tiles (None: the one tail tile), the
    columns inside a tile, its row loop and reduction loop, and its cache's suffix."""

    column_tiles: str | None
    column_tile_count: int
    columns: str
    width: int
    rows: str
    reduction: str
    suffix: str


# At most this many prefetches at the top of one iteration of a GEMM's loop (see
# `_panel_prefetch`): a column tile's iterations run thousands of cycles each.
PANEL_PREFETCH_BURST = 16


def _panel_prefetch(mm: StageInfo, nest: _GemmNest, tiles: list[tuple[str, int]]) -> PrefetchNext:
    """The next column tile's panel of B (fits: a tile is one whole panel) prefetched while
    this tile computes: its lines spread over the loops inside the column-tile loop (`tiles`,
    (loop, extent) outermost first, then the reduction), at the top of the outermost of them
    whose iterations each take at most PANEL_PREFETCH_BURST lines. Deeper, each reduction step
    of a tall GEMM would compute a prefetch (most of them of the panel's last line, clamped):
    GEMM 1024^3 with its 128 row tiles ran 12-15% slower so, and with 16 lines at the top of
    each row tile no slower than without."""
    ((_, depth),) = mm.reduce_axes
    lines = depth * nest.width * 4 // CACHE_LINE_BYTES  # float32: the count only places them
    names = [name for name, _ in tiles]
    inside = [*tiles[names.index(nest.column_tiles) + 1 :], (nest.reduction, depth)]
    steps = itertools.accumulate(extent for _, extent in inside)
    depth_at = next((k for k, n in enumerate(steps) if lines <= n * PANEL_PREFETCH_BURST), -1)
    return PrefetchNext(mm.note("weights"), nest.column_tiles, inside[depth_at][0])


def _pack_a_at(pack: str, loop: str) -> list[Record]:
    """A's [T, K, mr] row-tile panels packed one tile at a time inside the GEMM's row-tile
    loop, into a buffer of the thread's (the tile's K x mr values, read by every column tile
    after it): a reduction step's mr values, one from each row, stored side by side."""
    at = ComputeAt(pack, loop)
    return [at, Unroll(at.moved(f"{pack}_i2"))]


def _pack_at(pack: str, batch_rank: int, loop: str) -> list[Record]:
    """A [*batch, N/P, K, P] packing stage computed inside the GEMM's innermost batch loop: its
    K loop unrolled (an im2col column's channel and taps become constants) and its panel's
    lanes vectorized."""
    k, lane = batch_rank + 1, batch_rank + 2
    at = ComputeAt(pack, loop)
    return [at, Unroll(at.moved(f"{pack}_i{k}")), Vectorize(at.moved(f"{pack}_i{lane}"))]


def _gemm_tile(
    mm: StageInfo,
    nest: _GemmNest,
    row_tile: Split,
    tiles: list[str],
    target: Target,
    blocks: Sequence[Record] = (),
) -> list[Record]:
    """One nest's register tile: mr rows (`row_tile`, the split of the nest's rows) x
    `nest.width` columns of accumulators over the whole reduction, vectorized along the
    columns, its rows and vectors unrolled; `blocks`, the split of the row-tile loop into
    row blocks, if any (`tiles` names the tile loops outermost first)."""
    lanes = target.vector_lanes
    records: list[Record] = [row_tile, *blocks]
    inner_j = [nest.columns]
    if nest.width > lanes and nest.width % lanes == 0:
        vectors = Split(nest.columns, lanes)
        records.append(vectors)
        inner_j = [vectors.outer, vectors.inner]
    order = (*tiles, nest.reduction, row_tile.inner, *inner_j)
    cache = CacheWrite(mm.name, nest.reduction, nest.suffix)
    records += [Reorder(order), cache]
    if nest.width >= 4:
        records += [Vectorize(inner_j[-1]), *_vector_tile_io(cache, len(mm.shape))]
    if len(inner_j) == 2:
        records.append(Unroll(inner_j[0]))
    records.append(Unroll(row_tile.inner))
    return records


def _gemm_parallel(outer: list[tuple[str, int]], batch: int, config) -> list[Record]:
    """The parallel loop over `outer` ((loop, extent), outermost first; the first `batch` of
    them batch loops): `fused`, the batch loops and the first tile loop (without batch loops
    the tile loops) fused into one; `outer`, the outermost loop with work."""
    if config["parallel"] == "fused":
        fused, loop = fuse_all([name for name, _ in outer[: batch + 1 if batch else 2]])
        return [*fused, Parallel(loop)]
    loop = next((name for name, extent in outer if extent > 1), None)
    return [] if loop is None else [Parallel(loop)]


def gemm_column_tail(columns: int, nr: int, lanes: int) -> int:
    """Columns of a GEMM's tail tile after its whole nr-wide ones: what is left, rounded up to
    a multiple of GEMM_COLUMN_STEP (to a whole nr when nr is not a number of vectors); 0 when
    nr divides the columns."""
    left = columns % nr
    if not left:
        return 0
    step = min(lanes, GEMM_COLUMN_STEP) if nr % lanes == 0 else nr
    return min(-(-left // step) * step, nr, columns)


def _prefetches_panels(mm: StageInfo) -> bool:
    """Whether a GEMM is offered the `prefetch` knob (on by default but where the target's
    own prefetchers do better, `Target.prefetches_panels`): its next column tile's
    panel of B brought in while this tile computes. Its B must be constant panels (`weights`),
    with two panel-wide tiles at least (fits: tiles of one whole panel), and it must be
    compute-bound, MIN_INTENSITY FLOPs per byte of B (float32, 2 x rows a value: 32 rows
    and more), as the cross-kernel prefetch plan asks of a kernel: inside a model B comes
    from L3 or memory, and the tile's FMAs hide the fetch. A GEMV streams B at the memory's
    pace with nothing to hide it behind, and the prefetches only compete with its loads
    (mlp's 1024 x 1024 layer at batch 1 alone, median 36 -> 30 GFLOP/s); at batch 64 the
    model in the acceptance check's blocks ran 1.120 -> 1.040 ms, alone level or faster
    (Emerald Rapids Xeon, 2 threads)."""
    rows, _ = _gemm_rows(mm)
    panel_tiles = mm.shape[-1] // mm.note("panel") if mm.note("weights") else 0
    return panel_tiles >= 2 and 2 * rows / 4 >= MIN_INTENSITY


# A GEMM's columns are computed in multiples of 8 (a ymm register): a short remainder wastes
# less of an 8-lane tail than of a 16-lane one, and a core that splits 512-bit operations in
# two (Zen 4) runs 8-lane FMAs at the same FLOP rate (ViT's 197-column Q.K^T: a 16-lane tail
# 0.295 ms, an 8-lane one 0.286).
GEMM_COLUMN_STEP = 8


def _matmul_knobs(mm: StageInfo, target: Target) -> tuple[Knob, ...]:
    rows, folded = _gemm_rows(mm)
    cols = mm.shape[-1]
    panel = mm.note("panel") or 2 * target.vector_lanes
    noted = mm.note("mr")  # the row tile the builder padded the rows for
    if noted and rows == mm.shape[-2] and rows % noted == 0:
        default_mr = noted
    else:
        default_mr = _largest_divisor(rows, range(max_accumulators(target) // 2, 1, -1))
    # Columns nr does not divide go to a tail tile (see matmul_schedule).
    default_nr = min(panel, cols)
    mrs = tuple(m for m in (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16) if rows % m == 0)
    nrs = {n for n in (4, 8, 16, 32, 48, 64) if n <= cols}
    if mm.note("panel"):  # a tile across two panels reads B lane by lane
        nrs = {n for n in nrs if panel % n == 0}
    nrs = tuple(sorted(nrs | {default_nr}))
    batch = len(mm.shape) > 2 and not folded and math.prod(mm.shape[:-2]) > 1
    default_order = "ij" if batch else _default_gemm_order(mm, default_mr, default_nr)
    # Batches: each thread takes whole batches and row tiles, evenly, whatever the counts.
    default_parallel = "fused" if batch else "outer"
    # Packing costs a pass over B; it pays where B's columns are padded (else the last tile
    # reads them through a clamp, lane by lane) or B is computed in the kernel (a transpose).
    packs = ((1, 0) if mm.note("pack_default") else (0, 1)) if mm.note("pack") else (0,)
    if mm.note("packed_rows"):  # A's packed panels are a row tile wide
        mrs = ()
    knobs = (
        Knob("mr", tuple(sorted(set(mrs) | {default_mr})), default_mr),
        Knob("nr", nrs, default_nr),
        Knob("order", ("ij", "ji"), default_order),
        Knob("parallel", ("outer", "fused"), default_parallel),
        Knob("pack", packs, packs[0]),
    )
    if _prefetches_panels(mm):  # its default nr is then the panel's width
        knobs += (Knob("prefetch", (0, 1), int(target.prefetches_panels), absent=0),)
    if not mm.note("pack_a"):
        return knobs
    blocks = _row_block_choices(mm, target)
    if blocks:
        knobs += (Knob("row_block", (0, *blocks), 0, absent=0),)
    # Where A's panels are packed: a tile at a time in the row-tile loop (when the row tiles
    # are the outer loop of the one nest: A read once, each tile's panel in L1 for all the
    # column tiles), or all of A by a parallel pass before the GEMM.
    at_tile = default_order == "ij" and not gemm_column_tail(cols, default_nr, target.vector_lanes)
    return (*knobs, Knob("pack_a_at", ("tile", "root"), "tile" if at_tile else "root"))


def _row_block_choices(mm: StageInfo, target: Target) -> tuple[int, ...]:
    """Rows per block of a packed-A GEMM's `row_block` knob: where A outgrows the L2
    (GEMM_L2_BYTES), the `ji` order re-reads all of A from L3 for every column tile (64 of
    them at 2048^3), and `ij` all of B for every row tile. Cut into blocks of rows, with the
    column tiles inside each block and the block's row tiles inside them, the block's panels
    of A stay in L2 for all the column tiles and B is read from L3 once per block. 2048^3 on
    a Cascade Lake Xeon (2 threads, 4 rounds alternated, twice): 128-row blocks 219 / 212
    GFLOP/s at best, medians 134 / 146, against 179 / 144 and 119 / 135 unblocked; at 1024^3
    no gain (A is 4 MB), nor for the direct GEMM, whose rows lie a row's stride apart (so it
    is not offered there). The blocks offered hold at most twice GEMM_L2_BYTES of A (rows x K
    x 4), and only for one nest of whole column tiles outside any batch loop."""
    rows, folded = _gemm_rows(mm)
    ((_, depth),) = mm.reduce_axes
    batch = len(mm.shape) > 2 and not folded
    tail = gemm_column_tail(mm.shape[-1], 2 * target.vector_lanes, target.vector_lanes)
    if batch or tail or rows * depth * 4 <= GEMM_L2_BYTES:
        return ()
    return tuple(m for m in ROW_BLOCKS if m < rows and m * depth * 4 <= 2 * GEMM_L2_BYTES)


ROW_BLOCKS = (32, 64, 128, 256)


def _row_block_tiles(config: Mapping[str, object]) -> int:
    """Row tiles per block: the block's rows over mr, at least one."""
    return max(int(config["row_block"]) // int(config["mr"]), 1)


def _default_gemm_order(mm: StageInfo, mr: int, nr: int) -> str:
    """Stream the larger operand once: with more columns than rows, the column tiles go
    outermost (each panel of B is read once, for every row tile, while it is in cache). So
    too when B outgrows a core's L2 and the row tiles would re-read it more than the column
    tiles re-read A: `ij` reads all of B once per row tile, `ji` all of A once per column tile
    (1024^3 on a 2 MB-L2 Xeon: ij 107 GFLOP/s, ji 287)."""
    rows, cols = _gemm_rows(mm)[0], mm.shape[-1]
    real_rows = (mm.note("real_shape") or mm.shape)[-2]
    if cols > real_rows:
        return "ji"
    ((_, depth),) = mm.reduce_axes
    b_bytes, a_bytes = depth * cols * 4, rows * depth * 4
    b_rereads, a_rereads = -(-rows // mr) * b_bytes, -(-cols // nr) * a_bytes
    return "ji" if b_bytes > GEMM_L2_BYTES and b_rereads > a_rereads else "ij"


# The smallest per-core L2 of the CPUs we target (Zen 3's): a B this size is re-read from L2.
GEMM_L2_BYTES = 512 * 1024


def _matmul_fits(mm: StageInfo, config: Mapping[str, object], target: Target) -> bool:
    """mr x nr accumulators plus a row of B must fit the vector registers; A's panels are
    packed in the row-tile loop only when the row tiles are the one nest's outer loop (not
    fused with the column tiles); row blocks only in the `ji` order of one nest, and more
    than one of them; B's next panel prefetched by tiles of one panel, and more than one."""
    vectors = -(-int(config["nr"]) // target.vector_lanes)
    tail = gemm_column_tail(mm.shape[-1], int(config["nr"]), target.vector_lanes)
    row_tiles = -(-_gemm_rows(mm)[0] // int(config["mr"]))
    one_block = config.get("row_block") and _row_block_tiles(config) >= row_tiles
    if config.get("prefetch") and int(config["nr"]) != mm.note("panel"):
        # A tile of one whole panel reads a run of B that moves with its column tile (part
        # of a panel, or two, read index by index, is no affine run).
        return False
    if config.get("row_block") and (config["order"] != "ji" or tail or one_block):
        return False
    if config.get("pack_a_at") == "tile" and (
        config["order"] != "ij" or config["parallel"] == "fused" or tail
    ):
        return False
    return int(config["mr"]) * vectors + vectors <= target.vector_registers


def row_partial_schedule(name: str, rows: int, at: ComputeAt | None = None) -> list[Record]:
    """A row_reduce partial stage (`name`: rows x lanes, reduced over the row's whole vectors):
    the vector loop outside the lane loop, the lanes accumulated in one register (a local
    tile), and every access a vector. `at`: the record that computes it inside a row."""
    lane, whole = f"{name}_i{rows}", f"{name}_rv"
    if at is not None:
        lane = at.moved(lane)
    cache = CacheWrite(name, whole)
    return [Reorder((whole, lane)), cache, Vectorize(lane), *_vector_tile_io(cache, rows + 1)]


def _vector_rows(loop: str, extent: int, target: Target) -> list[Record]:
    """Vectorize a pure stage's innermost loop: whole vectors, then one last vector ending at
    the loop's end when the extent is not a multiple of the lanes."""
    return _vectorized(_vector_split(loop, extent, target))


# The fewest elements of a row shorter than a vector that a row kernel still takes as one
# (shorter) vector: softmax over 64 rows of 10 ran 0.95x the scalar rows' time, over 12 x 128
# rows of 8 0.84x, over 1000 rows of 4 1.42x (Zen 5, whole runs in `bench.ab`).
SHORT_ROW_LANES = 8


def _row_vectors(loop: str, extent: int, target: Target) -> list[Record]:
    """`_vector_rows` of a row stage, whose rows shorter than a vector (softmax over a few
    classes or keys, a layer norm of few features) are one shorter vector each."""
    if SHORT_ROW_LANES <= extent < target.vector_lanes:
        return [Vectorize(loop)]
    return _vector_rows(loop, extent, target)


def _vector_split(loop: str, extent: int, target: Target) -> Split | SplitOverlap | None:
    """The split of `loop` into vectors (see `_vector_rows`); None for less than a vector."""
    lanes = target.vector_lanes
    if extent < lanes:
        return None
    return Split(loop, lanes) if extent % lanes == 0 else SplitOverlap(loop, lanes)


def _vectorized(split: Split | SplitOverlap | None) -> list[Record]:
    """The split and its vector loops (the whole chunks' and the tail's) vectorized."""
    if split is None:
        return []
    if isinstance(split, SplitOverlap):
        return [split, Vectorize(split.inner), Vectorize(split.tail_loop)]
    return [split, Vectorize(split.inner)]


def row_schedule(
    out: StageInfo, epilogue: StageInfo | None, config: Mapping[str, object], target: Target
) -> list[Record]:
    """A row-wise kernel (softmax, layer norm): `out`'s first `rows` loops walk rows and its
    statistics (max, sums: row_reduce stages) are read per row. With `per_row`, they are
    computed inside the row loop, so the row is still in L1 when `out` reads it again; the
    row loops fuse into one parallel loop; the row's elements are vectors. A `row_split`
    note (k, factor) says out's loop k walks rows in blocks of `factor` (group norm: a group
    of channels). Knobs: per_row."""
    rows, stats, pure = out.note("rows"), out.note("row_stages"), out.note("row_pure")
    per_row = bool(config["per_row"]) and rows > 0
    records: list[Record] = []
    row_loops = [out.loop(k) for k in range(rows)]
    if out.note("row_split") and per_row:
        # rows in blocks of out's loop (a group norm's group is `factor` channels)
        k, factor = out.note("row_split")
        blocks = Split(out.loop(k), factor)
        records.append(blocks)
        row_loops = [*row_loops[:k], blocks.outer]
    at: dict[str, ComputeAt] = {}
    if per_row:
        at = {name: ComputeAt(name, row_loops[-1]) for name in stats}
        records += [at[name] for name in reversed(stats)]

    def last_loop(name: str) -> str:
        """A row stage's innermost loop, where it runs (moved inside the row loop, per row)."""
        loop = f"{name}_i{len(out.shape) - 1}"
        return at[name].moved(loop) if per_row else loop

    for name in out.note("row_partials"):
        records += row_partial_schedule(name, rows, at[name] if per_row else None)
    # A fold's lanes one vector, its initial value stored before them: the renderer folds
    # the lanes as a tree (log2(lanes) steps), not a chain of one lane at a time.
    for name in out.note("row_folds", ()):
        records += [CacheWrite(name, f"{name}_rl"), Vectorize(f"{name}_rl")]
    for name in pure:
        records += _row_vectors(last_loop(name), out.shape[-1], target)
    if not per_row and rows > 0:
        records += [Parallel(f"{name}_i0") for name in stats]
    if len(out.shape) > rows and not out.reduce_axes:
        records += _row_vectors(out.loop(len(out.shape) - 1), out.shape[-1], target)
    if not row_loops:
        return records
    fused, parallel = fuse_all(row_loops)
    return [*records, *fused, Parallel(parallel)]


def plain_window_schedule(
    window: StageInfo,
    epilogue: StageInfo | None,
    padded: StageInfo | None,
    target: Target,
    rows: StageInfo | None = None,
) -> list[Record]:
    """A window over plain NCHW, one channel plane in, one out (2-d pooling, a depthwise conv):
    a register tile of output pixels along the width (a whole output row when it fits) takes
    every tap of the window as one vector operation (a depthwise conv's weight broadcast), and
    the epilogue (AveragePool's divide, a bias and activation) runs on it before the single
    store; the padded copy of the input is made one channel plane at a time, while it stays in
    L1 (its rows in scalar code); parallel over channels. `rows`: a separable max pool's
    maxima along the rows, which the window then reads down the columns."""
    c, x = window.loop(1), window.loop(3)
    # Scalar: vectorized, ResNet's 3x3 stride-2 stem pool ran 0.068 -> 0.080 ms on Zen 5
    # (a 3x3 average pool at 56 x 56 0.050 -> 0.039).
    records: list[Record] = []
    if rows is not None:  # a separable max pool's maxima along the rows, a plane at a time
        at = ComputeAt(rows.name, c)
        records += [at, *_row_register_tile(rows, at.moved(rows.loop(3)), target)]
    records += _padded_plane(padded, c, target, vectorized=False)
    records += _row_register_tile(window, x, target)
    if epilogue is not None:
        records.append(ReverseComputeInline(epilogue.name))
    return [*records, Parallel(c)]


def _row_register_tile(stage: StageInfo, x: str, target: Target) -> list[Record]:
    """A window stage's outputs along its row (`x`, its last axis) in a register tile over
    all its taps (`_output_row_tile`: the whole row when it fits), vectorized along the row
    and stored once. For a separable max pool's first pass (`nn._separable_max`), computed
    in the channel plane's loop, its row maxima stay in L1 for the pass down the columns."""
    width = stage.shape[-1]
    taps = [name for name, _ in stage.reduce_axes]
    tile = _output_row_tile(width, target)
    records: list[Record] = []
    inner = x
    if tile < width:
        pixels = Split(x, tile)
        records.append(pixels)
        inner = pixels.inner
    cache = CacheWrite(stage.name, taps[0])
    records += [Reorder((*taps, inner)), cache]
    if tile > 1:
        records += [Vectorize(inner), *_vector_tile_io(cache, len(stage.shape))]
    return records


def _padded_plane(
    padded: StageInfo | None, channels: str, target: Target, vectorized: bool = True
) -> list[Record]:
    """A window's padded input made one channel plane at a time (in L1 while it fits), with
    `vectorized` its rows in vectors: masked loads of the input (`_guarded_load` in
    codegen/llvm.py)."""
    if padded is None:
        return []
    at = ComputeAt(padded.name, channels)
    if not vectorized:
        return [at]
    return [at, *_vector_rows(at.moved(padded.loop(3)), padded.shape[3], target)]


# Output rows of a plain depthwise conv's register tile: each row's vector of pixels is one
# chain of FMAs over the taps (4 cycles apart), and two FMA pipes need 8 chains in flight.
DEPTHWISE_TILE_ROWS = 8
# Taps of a plain depthwise conv unrolled in its tile (at most 7x7): the rows of the tile read
# the same input rows at other taps, and unrolled, one load serves them all (`bench.ab` on Zen
# 5: 5x5 at 28 x 28 0.78 of the tile with its taps in loops, 3x3 at 112 x 112 0.96).
DEPTHWISE_UNROLLED_TAPS = 49


def depthwise_window_schedule(
    conv: StageInfo, epilogue: StageInfo | None, padded: StageInfo | None, target: Target
) -> list[Record]:
    """A depthwise conv over plain NCHW, stride 1: a register tile of up to 8 output rows x
    one vector of pixels along the row accumulates over the taps (a broadcast weight, then one
    FMA per row, each a load of the padded plane at its tap; the taps unrolled, so that rows
    share the loads of the input rows they both read), the epilogue in the tile's single
    store; the row in whole vectors and, where the lanes do not divide it, a last vector
    ending at its end (overlapping the one before); the padded plane made one channel at a
    time; parallel over channels. A whole row as one tile (the plain pool's) made each vector
    one chain of FMAs over the taps, and LLVM moved a 56-pixel accumulator through the stack
    lane by lane: against it (`bench.ab` on Zen 5, medians of block ratios) 3x3 at 112 x 112
    0.66, 5x5 at 28 x 28 0.64, 3x3 on 576 channels at 14 x 14 0.54. With a width stride the
    whole row wins instead (`plain_window_schedule`: 3x3 stride 2 at 56 x 56, 0.74 of the
    blocked conv against 1.24 for this tile)."""
    n, c, y, x = (conv.loop(k) for k in range(4))
    lanes = target.vector_lanes
    taps = [name for name, _ in conv.reduce_axes]
    rows = _largest_divisor(conv.shape[2], range(DEPTHWISE_TILE_ROWS, 0, -1))
    records = [*_padded_plane(padded, c, target), Reorder((x, y))]
    nests = [(x, y, taps, "")]
    if conv.shape[3] > lanes:
        split = _vector_split(x, conv.shape[3], target)
        records.append(split)
        nests = [(split.inner, y, taps, "")]
        if isinstance(split, SplitOverlap):
            tail = split.in_tail
            nests.append((split.tail_loop, tail(y), [tail(k) for k in taps], "_t"))
    for pixels, row_loop, nest_taps, suffix in nests:
        row_tile = Split(row_loop, rows)
        cache = CacheWrite(conv.name, nest_taps[0], suffix)
        records += [row_tile, Reorder((row_tile.outer, *nest_taps, row_tile.inner, pixels))]
        records += [cache, Vectorize(pixels), *_vector_tile_io(cache, 4), Unroll(row_tile.inner)]
        if math.prod(extent for _, extent in conv.reduce_axes) <= DEPTHWISE_UNROLLED_TAPS:
            records += [Unroll(tap) for tap in nest_taps]
    if epilogue is not None:
        records.append(ReverseComputeInline(epilogue.name))
    return [*records, Parallel(c)]


# Output pixels of a blocked pool's register tile: each holds one vector of its block.
BLOCKED_POOL_TILE = 8


def blocked_pool_schedule(
    pool: StageInfo, epilogue: StageInfo | None, target: Target
) -> list[Record]:
    """Pooling over NC[D][H]W[b]c, the block one vector: a tile of output pixels along the
    row accumulates one vector each over the whole window (every tap one vector operation per
    pixel), the epilogue runs on it before the single store; the padded input is made one
    channel block at a time, while it stays in cache; parallel over channel blocks."""
    rank = len(pool.shape)
    cb, lanes = pool.loop(1), pool.loop(rank - 1)
    rows = [pool.loop(k) for k in range(2, rank - 2)]
    x = pool.loop(rank - 2)
    taps = [name for name, _ in pool.reduce_axes]
    tile = _largest_divisor(pool.shape[rank - 2], tuple(range(BLOCKED_POOL_TILE, 1, -1)))
    records: list[Record] = []
    padded = pool.note("padded")
    if padded:  # its block axis, vectorized too
        at = ComputeAt(padded, cb)
        records += [at, Vectorize(at.moved(f"{padded}_i{rank - 1}"))]
    pixels = Split(x, tile)
    cache = CacheWrite(pool.name, taps[0])
    records += [
        pixels,
        Reorder((*rows, pixels.outer, *taps, pixels.inner, lanes)),
        cache,
        Vectorize(lanes),
        Unroll(pixels.inner),
        *_vector_tile_io(cache, rank),
    ]
    if epilogue is not None:
        records.append(ReverseComputeInline(epilogue.name))
    return [*records, Parallel(cb)]


def winograd_tile(out_h: int, out_w: int, target: Target) -> int:
    """The output tile m of the Winograd F(m x m, 3 x 3) conv an untuned build runs for a conv
    that can take one (`kernels/winograd.py:conv_algorithms`), or 0 for the direct conv.
    F(4x4) takes 4x fewer multiplications than the direct conv, F(2x2) 2.25x; each of their
    alpha^2 GEMMs reads its own transformed filters for one row of tiles, so a small image
    takes the small tile: inside ResNet-18 on Zen 4 (the tuner's in-model check), 256
    channels at 14x14 ran 0.54 ms at F(2x2)'s default knobs and 0.51 at F(4x4)'s, 512 at
    7x7 0.77 at F(2x2)'s and 1.36 at F(4x4)'s fastest config alone (its 38 MB of transformed
    filters come from memory; the fastest direct configs 1.20 and 1.71 ms). Every machine's
    tuned ResNet-18 records (Zen 1, 3, 4, 5, two Xeons) run F(4x4) at 14x14 and, but on Zen
    1, F(2x2) at 7x7. Where the FMAs run at half width (`Target.fma_lanes` 4: Zen 1),
    multiplications cost twice as much against those reads, and F(4x4) takes every image
    F(2x2) would: on Zen 1, 512 channels at 7x7 2.61 -> 1.94 ms, 256 at 14x14 2.00 -> 1.59
    (ResNet-18 untuned 0.9x)."""

    def tiles(m: int) -> int:
        return -(-out_h // m) * -(-out_w // m)

    if target.fma_lanes < 8 and tiles(2) >= WINOGRAD_F2_MIN_TILES:
        return 4
    for m, least in ((4, WINOGRAD_F4_MIN_TILES), (2, WINOGRAD_F2_MIN_TILES)):
        if tiles(m) >= least:
            return m
    return 0


# Channels on both sides for a Winograd conv: its transforms cost about 1/M (input) and 1/C
# (output) of its GEMMs.
WINOGRAD_MIN_CHANNELS = 32
WINOGRAD_F4_MIN_TILES = 16
WINOGRAD_F2_MIN_TILES = 16


def winograd_input_schedule(stage: StageInfo, target: Target) -> list[Record]:
    """V[n, p, cb, tile, ci]: per tile and channel block, its window's row transforms (the
    `winograd_rows` stage, alpha^2 vectors computed in the tile's loop, kept in L1), then the
    alpha^2 positions unrolled, each a short sum of those vectors; the channels one vector;
    parallel over blocks x tiles."""
    n, p, cb, tile, ci = (stage.loop(k) for k in range(5))
    rows = ComputeAt(stage.note("winograd_rows"), tile)
    tiles = Fuse(cb, tile)
    return [
        Reorder((n, cb, tile, p, ci)),
        rows,
        *_unrolled_vectors(rows, 6),
        Unroll(p),
        Vectorize(ci),
        tiles,
        Parallel(tiles.fused),
    ]


def winograd_output_schedule(
    stage: StageInfo, epilogue: StageInfo | None, target: Target
) -> list[Record]:
    """Y[n, mb, h, w, mo] (or Y[n, mb, d, h, w, mo], a conv of frames) by m x m tiles: per
    tile its column transforms (the `winograd_columns` stage, computed in the tile's loop),
    then the tile's pixels unrolled, each a short sum of those; the channels one vector, the
    epilogue applied before the store; parallel over output blocks (x frames) x tile rows."""
    m, rank = stage.note("winograd_output"), len(stage.shape)
    n, mb = stage.loop(0), stage.loop(1)
    frames = [stage.loop(2)] if rank == 6 else []  # a conv of frames: NCDHW[b]c
    h, w, mo = (stage.loop(k) for k in range(rank - 3, rank))
    tile_rows, tile_columns = Split(h, m), Split(w, m)
    columns = ComputeAt(stage.note("winograd_columns"), tile_columns.outer)
    records: list[Record] = [
        tile_rows,
        tile_columns,
        Reorder(
            (
                n,
                mb,
                *frames,
                tile_rows.outer,
                tile_columns.outer,
                tile_rows.inner,
                tile_columns.inner,
                mo,
            )
        ),
        columns,
        *_unrolled_vectors(columns, 6),
        Unroll(tile_rows.inner),
        Unroll(tile_columns.inner),
        Vectorize(mo),
    ]
    if epilogue is not None:
        records.append(ReverseComputeInline(epilogue.name))
    fused = []
    for loop in (*frames, tile_rows.outer):
        fused.append(Fuse(fused[-1].fused if fused else mb, loop))
    return [*records, *fused, Parallel(fused[-1].fused)]


def strassen_input_schedule(stage: StageInfo, target: Target) -> list[Record]:
    """The sums of A's blocks, [7, rows/2, K/2] (kernels/strassen.py): per row and vector of
    K, the seven products unrolled (each its own sum of one or two blocks), parallel over the
    rows. One loop over K with seven sums in its body, not seven loops over K: LLVM unrolls
    each short loop of the latter, and the kernel took twice as long to build."""
    p, i, k = (stage.loop(d) for d in range(3))
    split = _vector_split(k, stage.shape[2], target)
    records: list[Record] = [Reorder((i, k, p))]
    if split is None:
        return [*records, Unroll(p), Parallel(i)]
    records += [split, Reorder((split.outer, p, split.inner)), Unroll(p), Vectorize(split.inner)]
    if isinstance(split, SplitOverlap):
        tail_p = split.in_tail(p)
        records += [Reorder((tail_p, split.tail_loop)), Unroll(tail_p)]
        records.append(Vectorize(split.tail_loop))
    return [*records, Parallel(i)]


def strassen_packed_input_schedule(stage: StageInfo, target: Target) -> list[Record]:
    """The sums of A's blocks in row-tile panels, [7, tiles, K/2, mr] (kernels/strassen.py
    `packed_input_sums`): per tile and step of K, the seven products and the tile's rows
    unrolled (each product's mr values stored side by side, from the 4 x mr values of A they
    share), parallel over the tiles. Scalar: A's values run along K, the panels' along the
    rows."""
    p, t, k, r = (stage.loop(d) for d in range(4))
    return [Reorder((t, k, p, r)), Unroll(p), Unroll(r), Parallel(t)]


def strassen_output_schedule(
    stage: StageInfo, epilogue: StageInfo | None, target: Target
) -> list[Record]:
    """C from the seven products (kernels/strassen.py), its leading loops fused into the
    GEMM's rows: per row of the top blocks and vector of a block's columns, the 2 x 2 blocks
    unrolled (each its own sum of two to four products, for the row and the one rows/2 below
    it), the epilogue applied before the store; parallel over those rows."""
    block_rows, block_columns = stage.note("strassen_output")
    rank = len(stage.shape)
    records, i = fuse_all([stage.loop(d) for d in range(rank - 1)])  # the GEMM's rows
    j = stage.loop(rank - 1)
    grid_rows, grid_columns = Split(i, block_rows), Split(j, block_columns)
    vectors = Split(grid_columns.inner, target.vector_lanes)  # blocks are whole panels
    order = (grid_rows.inner, vectors.outer, grid_rows.outer, grid_columns.outer, vectors.inner)
    records += [grid_rows, grid_columns, vectors, Reorder(order)]
    records += [Unroll(grid_rows.outer), Unroll(grid_columns.outer), Vectorize(vectors.inner)]
    if epilogue is not None:
        records.append(ReverseComputeInline(epilogue.name))
    return [*records, Parallel(grid_rows.inner)]


def _unrolled_vectors(at: ComputeAt, rank: int) -> list[Record]:
    """A stage computed at a loop (`at`): its two tile axes unrolled, its channel axis (the
    last) one vector."""
    loops = [at.moved(f"{at.stage}_i{k}") for k in range(rank)]
    return [Unroll(loops[-3]), Unroll(loops[-2]), Vectorize(loops[-1])]


def _output_row_tile(width: int, target: Target) -> int:
    """Output elements along a row held as accumulators over a whole reduction: the whole row
    when it fits the registers (a vector of any length: LLVM splits it into registers and one
    shorter piece), else its largest divisor that does."""
    most = min(MAX_VECTOR_LANES, max_accumulators(target) * target.vector_lanes)
    return _largest_divisor(width, tuple(range(min(width, most), 1, -1)))


def _reduces(stage: StageInfo) -> bool:
    """Whether a reduction stage has anything to reduce (an empty set lowers to its initial
    value alone, without a reduction loop to tile)."""
    return all(extent > 0 for _, extent in stage.reduce_axes)


def inner_vector_reduction_schedule(
    stage: StageInfo, epilogue: StageInfo | None, target: Target
) -> list[Record]:
    """A reduction that keeps the contiguous last axis (softmax or a reduce over channels):
    a tile of the output row accumulates in registers over the whole reduction, one vector
    operation per reduced element; the epilogue runs on it before the single store."""
    rank = len(stage.shape)
    x = stage.loop(rank - 1)
    reduce_loops = [name for name, _ in stage.reduce_axes]
    tile = _output_row_tile(stage.shape[-1], target)
    inner, row_tile = x, None
    records: list[Record] = []
    if tile < stage.shape[-1]:
        row_tile = Split(x, tile)
        records.append(row_tile)
        inner = row_tile.inner
    cache = CacheWrite(stage.name, reduce_loops[0])
    records += [Reorder((*reduce_loops, inner)), cache]
    records += [Vectorize(inner), *_vector_tile_io(cache, rank)]
    if epilogue is not None:
        records.append(ReverseComputeInline(epilogue.name))
    outer = next((k for k in range(rank - 1) if stage.shape[k] > 1), None)
    if outer is not None:
        records.append(Parallel(stage.loop(outer)))
    elif row_tile is not None:
        records.append(Parallel(row_tile.outer))
    return records


def _row_knobs(out: StageInfo, target: Target) -> tuple[Knob, ...]:
    return (Knob("per_row", (0, 1), 1),)


# --- an expand conv computed inside its depthwise conv ----------------------------------------

# A chained group's tile of expanded rows (a stack buffer of the thread that computes it): the
# default tile holds at most CHAIN_TILE_BYTES (L2-resident on every x86 core we target, beside
# the rows of input it reads), a tuned one at most CHAIN_MAX_TILE_BYTES. Cores with full-width
# 512-bit FMAs (Zen 5, the Xeons) have 1-2 MB of L2 a core and default to the larger budget:
# their default tiles span several channel blocks (`_default_chain_blocks`), which at 128 KB
# get too few rows (see there).
CHAIN_TILE_BYTES = 128 * 1024
CHAIN_MAX_TILE_BYTES = 256 * 1024


def chain_producer(anchor: StageInfo) -> StageInfo:
    """The expand conv a chained depthwise conv reads (see `tunable_of`)."""
    return anchor.note("producer")


def _chain_rows(dw: StageInfo) -> tuple[int, int]:
    """(stride, taps) of a chained depthwise conv along its rows: a tile of r output rows reads
    (r - 1) * stride + taps rows of the expand conv's output."""
    taps = next(extent for name, extent in dw.reduce_axes if _is_tap(dw, name))
    return int(dw.note("strides")[0]), taps


def chain_tile_bytes(dw: StageInfo, rows: int) -> int:
    """Bytes of the expand conv's output that a tile of `rows` output rows reads."""
    stride, taps = _chain_rows(dw)
    producer = chain_producer(dw)
    width, block = dw.note("in_width"), producer.shape[-1]
    return ((rows - 1) * stride + taps) * width * block * 4


def _chain_knobs(dw: StageInfo, target: Target) -> tuple[Knob, ...]:
    height, width = dw.shape[2], dw.shape[3]
    stride, taps = _chain_rows(dw)
    # Tiles of rows that fit the stack buffer and recompute at most half again the rows they
    # read (the whole height recomputes nothing: its halo lies past the edges); a row so wide
    # that no tile fits still gets tiles of one row (in the group's workspace buffer).
    rows = tuple(
        r
        for r in range(1, height + 1)
        if height % r == 0
        and chain_tile_bytes(dw, r) <= CHAIN_MAX_TILE_BYTES
        and (r == height or 2 * ((r - 1) * stride + taps) <= 3 * r * stride)
    ) or (1,)
    block = chain_producer(dw).shape[-1]
    expand_most = _expand_most(dw, target)
    blocks_choices = _chain_block_choices(dw, expand_most)
    blocks = _default_chain_blocks(dw, blocks_choices, rows[0], target)
    # The default: the tallest tile that fits the default budget and leaves two tiles of work
    # per core (groups of channel blocks x tiles of rows), else the tallest that fits.
    budget = _default_chain_bytes(target)
    fitting = [r for r in rows if blocks * chain_tile_bytes(dw, r) <= budget]
    fitting = fitting or [rows[0]]
    busy = [r for r in fitting if dw.shape[1] // blocks * (height // r) >= 2 * target.cores]
    # Default register tiles, read off MobileNetV2's measured spaces (Zen 4, every config of
    # its 8 chained workloads): the expand conv's of at most FMA_CHAINS pixels (one channel
    # block: 7 or 8 accumulators beat 14 by 0.5-4%), the depthwise conv's as long as an
    # unchained conv's (14 beat 7 or 8 on every row that offers it, by 1-5%: its input rows
    # are in cache, and a longer tile loads each weight vector for more pixels). A tile of
    # several blocks holds as many pixels as the accumulators allow.
    in_width = dw.note("in_width")
    expand_tiles = _expand_tiles(in_width, expand_most)
    if blocks == 1:
        preferred = min(FMA_CHAINS, _nchwc_preferred(False, block, target))
        _, expand_tile = _chain_tiles(in_width, preferred, expand_most)
    else:
        expand_tile = _expand_tile_of(dw, blocks, target)
    most = min(_nchwc_most(dw.shape[-1], target), CHAIN_DEPTHWISE_MOST)
    tiles, tile = _chain_tiles(width, _nchwc_preferred(False, dw.shape[-1], target), most)
    return (
        Knob("rows", rows, max(busy or fitting)),
        Knob("expand_tile", expand_tiles, expand_tile),
        Knob("tile", tiles, tile),
        Knob("blocks", blocks_choices, blocks),
    )


def _chain_block_choices(dw: StageInfo, expand_most: int) -> tuple[int, ...]:
    """Channel blocks a chain tile may span: divisors of the depthwise conv's blocks up to
    CHAIN_MOST_BLOCKS, each with an expand tile of at least two pixels in the accumulators."""
    blocks = dw.shape[1]
    return tuple(
        b for b in range(1, CHAIN_MOST_BLOCKS + 1) if blocks % b == 0 and 2 * b <= expand_most
    ) or (1,)


def _expand_most(dw: StageInfo, target: Target) -> int:
    """Accumulators the chained expand conv's register tile may hold."""
    return _nchwc_most(chain_producer(dw).shape[-1], target)


def _expand_tiles(width: int, most: int) -> tuple[int, ...]:
    """Expand tiles along a row of `width` pixels: its divisors up to `most`, and the tiles
    of CHAIN_LEAST_TILE or more that divide it not, whose last tile, moved back to end at
    the row's end (`SplitOverlap`), recomputes at most a seventh of the row (a row of 7
    in tiles of 4: pixels 0-3 and 3-6)."""
    divisors = [t for t in range(1, most + 1) if width % t == 0]
    overlapping = [
        t
        for t in range(CHAIN_LEAST_TILE, min(most, width) + 1)
        if width % t and 7 * ((width // t + 1) * t - width) <= width  # pixels done twice
    ]
    return tuple(sorted({*divisors, *overlapping}))


def _expand_tile_of(dw: StageInfo, blocks: int, target: Target) -> int:
    """The longest expand tile whose `blocks` x pixels accumulators fit the registers and
    hold `_least_expand_accumulators`: a divisor of the row, else one whose last tile
    overlaps (AVX2, a row of 7, three blocks: 4 pixels, where a divisor leaves 1); 0 when
    none does."""
    most, width = _expand_most(dw, target), dw.note("in_width")
    least = _least_expand_accumulators(dw, most)
    divisor = _largest_divisor(width, range(most // blocks, 0, -1))
    if divisor * blocks >= least:
        return divisor
    fitting = [t for t in _expand_tiles(width, most) if least <= t * blocks <= most]
    return max(fitting, default=0)


def _least_expand_accumulators(dw: StageInfo, most: int) -> int:
    """CHAIN_LEAST_TILE accumulators, or the longest one-block tile a row short of divisors
    has (a prime row of 3 pixels: 3)."""
    return min(CHAIN_LEAST_TILE, _largest_divisor(dw.note("in_width"), range(most, 0, -1)))


def _chain_on_stack(dw: StageInfo, rows: int, blocks: int) -> bool:
    """Whether the expand conv's output for a tile of `rows` output rows and `blocks` channel
    blocks fits the largest stack buffer (else it stays in the group's workspace buffers)."""
    return blocks * chain_tile_bytes(dw, rows) <= CHAIN_MAX_TILE_BYTES


def _default_chain_bytes(target: Target) -> int:
    """The default chain tile's budget (see CHAIN_TILE_BYTES)."""
    return CHAIN_MAX_TILE_BYTES if _full_width_512(target) else CHAIN_TILE_BYTES


def _full_width_512(target: Target) -> bool:
    """AVX-512 at the full rate: zmm FMAs not split in two halves (Zen 4 splits them)."""
    return not target.is_gpu and target.vector_lanes == 16 and target.fma_lanes == 16


def _default_chain_blocks(
    dw: StageInfo, choices: tuple[int, ...], rows: int, target: Target
) -> int:
    """One block on Zen 4, whose FMAs take their broadcast input from memory (AVX-512) at
    half a zmm's rate; else three blocks when they divide the channels, else two, so that
    each broadcast input of the expand conv feeds several FMAs (as `_triple_tile`), when such
    a tile fits the accumulators and its rows fit the default budget
    (`_default_chain_bytes`).

    Full-width AVX-512 (Zen 5, and the Xeons, whose tuning logs all picked two or three
    blocks for MobileNetV2's chains): one block at 128 KB -> three at 256 KB, Zen 5, us,
    MobileNetV2's nine chains: 7x7 41.9 -> 33.7 and 57.2 -> 45.3, 14x14 62.1 -> 49.4, 30.1 ->
    24.4 and 29.0 -> 23.0, 28x28 89.4 -> 73.4 and 34.6 -> 29.1, 56x56 149.5 -> 122.5 and 107.8
    -> 99.0; over the model's chains 872 -> 719 (the tuned configs 715). At 128 KB five of
    the nine took fewer rows with three blocks (2 / 8 / 4 / 14 / 7 against 4 / 14 / 7 / 28 /
    14) and ran 6-27% slower.

    AVX2, measured on Zen 1 over MobileNetV2's
    eleven chains (one block -> three, us): 14x14 and 7x7 rows 413 -> 348, 199 -> 171,
    365 -> 303, 182 -> 153; 28x28 229 -> 200, 428 -> 372; 56x56 869 -> 812, 571 -> 527 (two
    blocks 517); four blocks within 3% of three; 7-pixel rows keep one block (a tile of one
    pixel holds too few accumulators); the model untuned 0.960 of one block."""
    if target.fma_broadcasts and not _full_width_512(target):
        return 1
    for blocks in (3, 2):
        fits = blocks * chain_tile_bytes(dw, rows) <= _default_chain_bytes(target)
        if blocks in choices and fits and _expand_tile_of(dw, blocks, target):
            return blocks
    return 1


def _chain_fits(dw: StageInfo, config: Mapping[str, object], target: Target) -> bool:
    """The expand conv's tile of pixels x blocks fits the accumulators and holds at least
    `_least_expand_accumulators`; a tile of several blocks lies on the stack."""
    blocks, expand_tile = int(config["blocks"]), int(config["expand_tile"])
    accumulators = blocks * expand_tile
    most = _expand_most(dw, target)
    if not _least_expand_accumulators(dw, most) <= accumulators <= most:
        return False
    return blocks == 1 or _chain_on_stack(dw, int(config["rows"]), blocks)


# A chained depthwise conv's register tiles: at least CHAIN_LEAST_TILE pixels (fewer leave
# the FMA chains idle), at most CHAIN_DEPTHWISE_MOST (the input vectors of a row's taps
# stay live beside the accumulators).
CHAIN_LEAST_TILE = 4
CHAIN_DEPTHWISE_MOST = 16
# Channel blocks one chain tile may span (the expand conv's register tile spans them all).
CHAIN_MOST_BLOCKS = 4


def _chain_tiles(width: int, preferred: int, most: int) -> tuple[tuple[int, ...], int]:
    """(choices, default) of a register tile along a row of `width` pixels: the divisors
    from CHAIN_LEAST_TILE to `most`; the default the largest up to `preferred`, else the
    smallest above it (a prime row is one tile), else the largest that fits."""
    divisors = [t for t in range(1, most + 1) if width % t == 0]
    choices = [t for t in divisors if t >= min(CHAIN_LEAST_TILE, width)] or divisors[-1:]
    below = [t for t in choices if t <= preferred]
    default = max(below) if below else min(choices)
    return tuple(choices), default


def nchwc_chain_schedule(
    dw: StageInfo, epilogue: StageInfo | None, config: Mapping[str, object], target: Target
) -> list[Record]:
    """A depthwise conv with the 1x1 conv that expands its input computed inside it: per
    group of `blocks` channel blocks and tile of `rows` output rows (the parallel loop), the
    expand conv writes the rows of its output that the tile reads to a stack buffer (register
    tiles of `expand_tile` pixels x the group's blocks, its epilogue applied in their
    stores), then the depthwise conv reads them from cache block by block (tiles of `tile`
    pixels, the taps along the row unrolled). Neighbouring tiles recompute the rows they
    share: taps - stride rows per tile. The threads split the row tiles first when the
    chain's input outweighs its weights (`rows_before_channels`), else the groups."""
    producer = chain_producer(dw)
    n_loop, mo_loop, y_loop, x_loop, mi_loop = (dw.loop(k) for k in range(5))
    rows = Split(y_loop, int(config["rows"]))
    records: list[Record] = [rows]
    blocks = int(config["blocks"])
    group_loop = mo_loop
    rows_first = rows_before_channels(producer, dw)
    if blocks > 1:
        # A tile of `blocks` channel blocks: the expand conv computes them all for the tile's
        # rows, the depthwise conv then runs block by block.
        group = Split(mo_loop, blocks)
        records.append(group)
        group_loop = group.outer
    # The two loops the threads split, outermost first; one iteration of the inner one is a
    # tile (its rows x its group's blocks).
    split = (rows.outer, group_loop) if rows_first else (group_loop, rows.outer)
    if blocks > 1:
        records.append(Reorder((*split, group.inner, rows.inner)))
    elif rows_first:
        records.append(Reorder(split))
    # The expand conv's epilogue (bias, activation) in the tile's buffer, then the conv itself
    # before it, in its own buffer until the epilogue folds into its store (below). A tile
    # too big for the stack stays in the group's workspace buffers, indexed by the model's
    # rows: there the epilogue is a pass of its own over the tile.
    epilogue_of_producer = dw.note("producer_epilogue")
    on_stack = _chain_on_stack(dw, int(config["rows"]), blocks)
    tile_loop = split[1]
    if epilogue_of_producer:
        records.append(ComputeAt(epilogue_of_producer, tile_loop, CHAIN_MAX_TILE_BYTES))
    at = ComputeAt(producer.name, tile_loop, CHAIN_MAX_TILE_BYTES)
    records.append(at)
    # The expand conv over its tile: pixels x its channel blocks in registers over its
    # channels (the blocks innermost: each broadcast input feeds one FMA per block).
    px_loop, pmi_loop = at.moved(producer.loop(3)), at.moved(producer.loop(4))
    expand_reduce = [name for name, _ in producer.reduce_axes]
    expand_tile = int(config["expand_tile"])
    # The tile's channel blocks (several: the loop over them; one: none).
    pmo_loops = [at.moved(producer.loop(1))] if blocks > 1 else []
    if blocks > 1:
        records.append(Reorder((at.moved(producer.loop(2)), px_loop, *pmo_loops, pmi_loop)))
    if dw.note("in_width") % expand_tile == 0:
        pixels = Split(px_loop, expand_tile)
        records.append(pixels)
        nests = [_ExpandNest((pixels.outer,), pixels.inner, expand_reduce, pmo_loops, pmi_loop)]
    else:
        # Whole tiles, then one more that ends at the row's end, overlapping the last whole
        # one (its pixels computed twice, each time the same): no guard in the FMA loop.
        pixels = SplitOverlap(px_loop, expand_tile)
        records.append(pixels)
        tail = pixels.in_tail
        nests = [
            _ExpandNest((pixels.outer,), pixels.inner, expand_reduce, pmo_loops, pmi_loop),
            _ExpandNest(
                (),
                pixels.tail_loop,
                [tail(loop) for loop in expand_reduce],
                [tail(loop) for loop in pmo_loops],
                tail(pmi_loop),
                "_t",
            ),
        ]
    for nest in nests:
        records += _expand_register_tile(producer, nest)
    if epilogue_of_producer and on_stack:
        records.append(ReverseComputeInline(epilogue_of_producer))
    # The depthwise conv over the tile's rows, as an unchained one.
    taps = [name for name, _ in dw.reduce_axes]
    tile = Split(x_loop, int(config["tile"]))
    cache = CacheWrite(dw.name, taps[0])
    records += [
        tile,
        Reorder((rows.inner, tile.outer, *taps, tile.inner, mi_loop)),
        cache,
        Vectorize(mi_loop),
        Unroll(tile.inner),
        *_vector_tile_io(cache, len(dw.shape)),
    ]
    records.append(Unroll(taps[-1]))  # the row's taps: its input vectors loaded once
    if epilogue is not None:
        records.append(ReverseComputeInline(epilogue.name))
    fused, parallel = fuse_all([n_loop, *split])
    return [*records, *fused, Parallel(parallel)]


@dataclasses.dataclass(frozen=True)
class _ExpandNest:
    """The loops of one nest of a chained expand conv's register tiles (the whole tiles', or
    the overlapping last tile's): the tile loops outside the reduction, the tile's pixels,
    the reduction, its channel blocks (none for a tile of one block), the block's lanes, and
    its cache's suffix."""

    outer: Sequence[str]
    pixels: str
    reduce: Sequence[str]
    blocks: Sequence[str]
    lanes: str
    suffix: str = ""


def _expand_register_tile(producer: StageInfo, nest: _ExpandNest) -> list[Record]:
    """A chained expand conv's register tile: pixels x channel blocks (the blocks innermost:
    each broadcast input feeds one FMA per block) accumulated over the whole reduction, a
    block's lanes one vector."""
    cache = CacheWrite(producer.name, nest.reduce[0], nest.suffix)
    return [
        Reorder((*nest.outer, *nest.reduce, nest.pixels, *nest.blocks, nest.lanes)),
        cache,
        Vectorize(nest.lanes),
        Unroll(nest.pixels),
        *(Unroll(loop) for loop in nest.blocks),
        *_vector_tile_io(cache, len(producer.shape)),
    ]


# --- attention: S = Q K^T, its row softmax and Y = P V in one kernel ---------------------------

# The most query rows a block offers (its rows are both GEMMs' register tile rows: with a
# vector of columns and one of B, 16 rows are 17 of AVX-512's 32 registers).
ATTENTION_MOST_ROWS = 16


def attention_scores(y: StageInfo) -> StageInfo:
    """The scores GEMM (S = Q K^T) an attention chain's Y reads through its softmax."""
    return y.note("scores")


def attention_softmax(y: StageInfo) -> StageInfo:
    """The row softmax's output stage (P) an attention chain's Y reads."""
    return y.note("softmax")


def _attention_knobs(y: StageInfo, target: Target) -> tuple[Knob, ...]:
    """Query rows per block (divisors of Y's rows, which its builder padded to its row
    tile), the scores' column tile `nr` and Y's `y_nr` (a divisor of the head size). By
    default two vectors of columns each and Y's own row tile where the tiles fit with it,
    else the most rows that do."""
    keys, width = attention_softmax(y).shape[-1], y.shape[-1]
    lanes = target.vector_lanes
    s_nrs = tuple(n for n in (8, 16, 32, 48, 64) if n <= keys) or (keys,)
    default_s_nr = 2 * lanes if 2 * lanes <= keys else s_nrs[-1]
    y_nrs = tuple(n for n in (4, 8, 16, 32, 48, 64) if n <= width and width % n == 0)
    default_y_nr = max((n for n in y_nrs if n <= 2 * lanes), default=y_nrs[0])
    rows = tuple(r for r in range(1, ATTENTION_MOST_ROWS + 1) if y.shape[-2] % r == 0)

    def fits(r: int) -> bool:
        config = {"rows": r, "nr": default_s_nr, "y_nr": default_y_nr}
        return _attention_fits(y, config, target)

    noted = y.note("mr")
    default_rows = noted if noted in rows and fits(noted) else max(filter(fits, rows))
    return (
        Knob("rows", rows, default_rows),
        Knob("nr", s_nrs, default_s_nr),
        Knob("y_nr", y_nrs, default_y_nr),
    )


def _attention_fits(y: StageInfo, config: Mapping[str, object], target: Target) -> bool:
    """Both register tiles (rows x their column vectors, and a row of B) fit the registers."""
    rows = int(config["rows"])
    for nr in (int(config["nr"]), int(config["y_nr"])):
        vectors = -(-nr // target.vector_lanes)
        if rows * vectors + vectors > target.vector_registers:
            return False
    return True


def attention_schedule(
    y: StageInfo, epilogue: StageInfo | None, config: Mapping[str, object], target: Target
) -> list[Record]:
    """Attention in blocks of `rows` query rows (the parallel loop, with the batch and head
    loops): per block, its scores S = Q K^T into a buffer of the thread's (register tiles of
    `rows` x `nr` keys over the head size, a tail tile at the last keys), the softmax's row
    statistics and probabilities over it in cache, then the block's rows of Y = P V
    (register tiles of `rows` x `y_nr` over the keys), Y's epilogue in its store. The scores
    of a head never leave the core's caches: unfused, each was written to memory and read
    back twice."""
    scores, softmax = attention_scores(y), attention_softmax(y)
    rows = int(config["rows"])
    records: list[Record] = []
    # K^T and V read where they lie (kernel inputs, their rows contiguous; a panel's worth
    # of columns past the keys clamped, which the block's tiles never reach), not packed by
    # a pass over all heads before the blocks.
    for gemm in (scores, y):
        if gemm.note("pack"):
            records.append(ComputeInline(gemm.note("pack")))
    rank = len(y.shape)
    batch_loops = [y.loop(k) for k in range(rank - 2)]
    ((y_k, _),) = y.reduce_axes
    width, y_nr = y.shape[-1], int(config["y_nr"])
    block = Split(y.loop(rank - 2), rows)
    # y_nr divides the head size: one nest of whole tiles.
    column_records, (nest,) = _column_nests(
        y.loop(rank - 2), y.loop(rank - 1), y_k, width, y_nr, target
    )
    records += column_records
    records += _gemm_tile(y, nest, block, [block.outer, nest.column_tiles], target)
    if epilogue is not None:
        records.append(ReverseComputeInline(epilogue.name))
    # The softmax (its output first, then the statistics it reads, last to first) and the
    # scores, each computed inside the block for just its rows.
    stats = softmax.note("row_stages")
    at = {
        name: ComputeAt(name, block.outer, CHAIN_MAX_TILE_BYTES)
        for name in (softmax.name, *reversed(stats), scores.name)
    }
    records += at.values()
    # The softmax's rows are the keys (the scores' columns may be padded past them to a panel).
    keys = softmax.shape[-1]
    records += _block_scores(scores, at[scores.name], rows, keys, int(config["nr"]), target)
    records += _block_softmax(softmax, at, target)
    fused, parallel = fuse_all([*batch_loops, block.outer])
    return [*records, *fused, Parallel(parallel)]


def _block_scores(
    scores: StageInfo, at: ComputeAt, rows: int, keys: int, nr: int, target: Target
) -> list[Record]:
    """A block's scores (computed at the block by `at`): register tiles of its rows x `nr`
    keys over the head size, whole tiles then one ending at the last key."""
    rank = len(scores.shape)
    i_loop, j_loop = at.moved(scores.loop(rank - 2)), at.moved(scores.loop(rank - 1))
    ((k_loop, _),) = scores.reduce_axes
    records, nests = _column_nests(i_loop, j_loop, k_loop, keys, nr, target)
    for nest in nests:
        row_tile = Split(nest.rows, rows)  # the block's rows: one tile
        tiles = [row_tile.outer, *([nest.column_tiles] if nest.column_tiles else [])]
        records += _gemm_tile(scores, nest, row_tile, tiles, target)
    return records


def _block_softmax(softmax: StageInfo, at: Mapping[str, ComputeAt], target: Target) -> list[Record]:
    """The softmax over a block's rows of scores (its stages computed at the block): each
    row's partial maxima and sums in vector registers, folded as trees, the exponentials and
    probabilities vector by vector."""
    rows, keys = softmax.note("rows"), softmax.shape[-1]
    last = len(softmax.shape) - 1
    records: list[Record] = []
    for name in softmax.note("row_partials"):
        records += row_partial_schedule(name, rows, at[name])
    for name in softmax.note("row_folds", ()):
        records += [CacheWrite(name, f"{name}_rl"), Vectorize(f"{name}_rl")]
    for name in (*softmax.note("row_pure", ()), softmax.name):
        records += _row_vectors(at[name].moved(f"{name}_i{last}"), keys, target)
    return records


# --- templates: the default schedules with their knobs --------------------------------------


@dataclasses.dataclass(frozen=True)
class Knob:
    """A named choice of a template. A knob added to a template after records were logged
    names in `absent` the value those records' configs, which lack it, meant (what the
    schedule did before the knob existed): they keep their meaning, so the template keeps its
    version, while its default may differ."""

    name: str
    choices: tuple
    default: object
    absent: object = None


Config = Mapping[str, object]


@dataclasses.dataclass(frozen=True)
class Template:
    """A schedule with named knobs. Its default point is the untuned schedule; bump `version`
    whenever a knob's meaning changes, so old tuning records are never applied to it."""

    name: str
    version: int
    knobs: Callable[[StageInfo, Target], tuple[Knob, ...]]
    schedule: Callable[[StageInfo, StageInfo | None, Config, Target], list[Record]]
    fits: Callable[[StageInfo, Config, Target], bool] = lambda _anchor, _config, _target: True
    # Knobs that reshape the whole nest, so that a task's first batch measures each of their
    # values near each algorithm's default (see `Tuner._first_points`).
    pivots: tuple[str, ...] = ()


TEMPLATES: dict[str, Template] = {
    # v3: the algorithm knob (direct / Winograd), no inert knobs for convs without taps.
    "conv2d_nchwc": Template("conv2d_nchwc", 3, _nchwc_knobs, nchwc_conv_schedule, _nchwc_fits),
    # The loop order decides which operand streams from L2/L3: a GEMM's best order is often not
    # its default's, and no cheap neighbour of the default reaches the other (packed A's `ji`
    # also moves its packing to the root).
    "dense": Template("dense", 2, _matmul_knobs, matmul_schedule, _matmul_fits, ("order",)),
    "row_reduction": Template("row_reduction", 1, _row_knobs, row_schedule),
    # v2: the blocks knob (channel blocks per tile), expand tiles of fewer than 4 pixels.
    "conv2d_nchwc_chain": Template(
        "conv2d_nchwc_chain", 2, _chain_knobs, nchwc_chain_schedule, _chain_fits
    ),
    "attention": Template("attention", 1, _attention_knobs, attention_schedule, _attention_fits),
}


@dataclasses.dataclass(frozen=True)
class Tunable:
    """A group's heavy stage with its template, its epilogue and the knobs for its shapes."""

    template: Template
    anchor: StageInfo
    epilogue: StageInfo | None
    knobs: tuple[Knob, ...]
    target: Target

    def default_config(self) -> dict[str, object]:
        return {knob.name: knob.default for knob in self.knobs}

    def check(self, config: Config) -> dict[str, object]:
        """The config with every knob, or ValueError naming what is wrong with it."""
        names = {knob.name for knob in self.knobs}
        unknown = set(config) - names
        if unknown:
            raise ValueError(f"{self.template.name}: unknown knob(s) {sorted(unknown)}")
        absent = {knob.name: knob.absent for knob in self.knobs if knob.absent is not None}
        full = {**self.default_config(), **absent, **config}
        for knob in self.knobs:
            if full[knob.name] not in knob.choices:
                raise ValueError(
                    f"{self.template.name}: knob {knob.name}={full[knob.name]!r} is not one "
                    f"of {list(knob.choices)}"
                )
        if not self.fits(full):
            raise ValueError(f"{self.template.name}: config {full} does not fit the registers")
        return full

    def fits(self, config: Config) -> bool:
        return self.template.fits(self.anchor, config, self.target)

    def records(self, config: Config | None = None) -> list[Record]:
        full = self.check(self.default_config() if config is None else config)
        return self.template.schedule(self.anchor, self.epilogue, full, self.target)


def generic_schedule(stage: StageInfo, target: Target) -> list[Record]:
    """Parallel outermost loop with work; vectorize the innermost loop of a pure stage (a
    remainder is one more vector ending at the loop's end)."""
    records: list[Record] = []
    rank = len(stage.shape)
    if rank == 0:
        return records
    inner, vectors = rank - 1, None
    if stage.pure and stage.name not in stage.reads:
        vectors = _vector_split(stage.loop(inner), stage.shape[inner], target)
        records += _vectorized(vectors)
    outer = next((k for k in range(rank) if stage.shape[k] > 1), None)
    if outer is not None and not (stage.pure and outer == inner and vectors is not None):
        records.append(Parallel(stage.loop(outer)))
    elif outer is not None and vectors is not None:
        records.append(Parallel(vectors.outer))
    return records


def _vector_nest(func: PrimFunc) -> list[For] | None:
    """The outermost perfect nest of loops that ends in a vectorized loop, outermost first."""
    for stmt in walk_stmts(func.body):
        if not isinstance(stmt, For):
            continue
        nest = [stmt]
        while isinstance(nest[-1].body, For):
            nest.append(nest[-1].body)
        if nest[-1].kind == ForKind.VECTORIZED:
            return nest
    return None


def transposed_read_tiles(func: PrimFunc, target: Target, records: list[Record]) -> list[Record]:
    """`records` (which made `func`) with a transposing copy tiled: when a vector of lanes
    that stores consecutive elements loads elements a cache line or more apart (a column of
    the input), and a loop outside it walks that input's rows contiguously, that loop is
    split by the vector width and its inner part moved just outside the vector loop. Each
    vector then gathers from the same lanes-many lines as the one before, from L1, where the
    whole row of gathers (every line of a column strip) fell out of L1 before the loop came
    back to it: keys laid out for Q K^T read 2x faster. Where the vector loop is one vector,
    the tile is square and unrolled: the codegen then loads its rows whole and transposes
    them in registers (`_transposed_tile`), no gathers at all. A ragged vector loop (a row of
    197 tokens: `SplitOverlap`) gets square tiles in its whole vectors and its last one
    (`_ragged_tiles`). `records` unchanged where there is no such loop."""
    ragged = _ragged_tiles(func, target, records)
    if ragged is not None:
        return ragged
    nest = _vector_nest(func)
    if nest is None or len(nest) < 2:
        return records
    vector, lanes = nest[-1], target.vector_lanes
    for load in _column_loads(vector, lanes):
        for position in range(len(nest) - 2, -1, -1):
            rows = nest[position]
            if not _walks_rows(rows, load, lanes):
                continue
            between = nest[position + 1 : -1]
            if math.prod(loop.extent for loop in between) == 1:
                return records  # one vector per row already reads the same lines again
            split = Split(rows.var.name, lanes)
            names = [loop.var.name for loop in between]
            tiles = [split, Reorder((split.outer, *names, split.inner, vector.var.name))]
            if vector.extent == lanes:  # a square tile: the codegen copies it across
                tiles.append(Unroll(split.inner))
            return [*records, *tiles]
    return records


def _column_loads(vector: For, lanes: int) -> list[Expr]:
    """The flat indices of the loads, in the vector loop's one store, whose lanes lie a
    vector or more apart while the store's are consecutive."""
    stores = [s for s in walk_stmts(vector.body) if isinstance(s, Store)]
    if len(stores) != 1 or any(isinstance(s, IfThenElse) for s in walk_stmts(vector.body)):
        return []
    store, var = stores[0], vector.var.name
    if lane_stride(flat_index(store.buffer, store.indices), var) != 1:
        return []
    flats = [
        flat_index(x.buffer, x.indices) for x in walk_exprs(store.value) if isinstance(x, Load)
    ]
    return [
        f for f in flats if (stride := lane_stride(f, var)) is not None and abs(stride) >= lanes
    ]


def _walks_rows(
    rows: For, flat: Expr, lanes: int, kinds: tuple[ForKind, ...] = (ForKind.SERIAL,)
) -> bool:
    """Whether a loop of one of `kinds` (serial by default) walks the column load's rows
    contiguously, in whole tiles of more than one."""
    walks = lane_stride(flat, rows.var.name) == 1 and rows.kind in kinds
    return walks and rows.extent % lanes == 0 and rows.extent != lanes


def _ragged_tiles(func: PrimFunc, target: Target, records: list[Record]) -> list[Record] | None:
    """For a column copy whose vector loop a `SplitOverlap` of one vector made (its whole
    vectors and a last one ending at the row's end), inside a perfect nest under the loop
    that walks the rows: the rows split by the vector width before the overlapping split and
    their inner part moved just outside it, so that both the whole vectors and the last one
    sit inside an unrolled loop of lanes rows: square tiles (ViT-B/16's key transposes, 197
    tokens a row: 90 -> 22 us alone, 120 -> 75 us in the model, Xeon, 2 threads). The rows
    loop may be the parallel one, with other loops between (ConvNeXt's NHWC -> NCHW permutes,
    channels outermost): the threads then take the rows' tiles. None where that does not
    apply."""
    lanes = target.vector_lanes
    overlaps = [r for r in records if isinstance(r, SplitOverlap) and r.factor == lanes]
    if len(overlaps) != 1 or overlaps[0].tail not in (0, lanes):
        return None
    overlap, tail = overlaps[0], overlaps[0].tail_loop
    vector, whole = find_loop(func.body, overlap.inner), find_loop(func.body, overlap.outer)
    if vector is None or whole is None or vector.kind != ForKind.VECTORIZED:
        return None
    if whole.body is not vector or vector.extent != lanes:
        return None
    above = loops_above(func.body, whole) or []
    # The loop right above holds the whole vectors' loop and the last vector's, nothing else.
    pair = above[-1].body.stmts if above and isinstance(above[-1].body, Block) else ()
    if len(pair) != 2 or pair[0] is not whole or pair[1] is not find_loop(above[-1].body, tail):
        return None
    loads = _column_loads(vector, lanes)
    # The rows loop may be the parallel one: the split keeps the threads outside the tiles.
    kinds = (ForKind.SERIAL, ForKind.PARALLEL)
    walking = [
        k for k, loop in enumerate(above) if any(_walks_rows(loop, f, lanes, kinds) for f in loads)
    ]
    if not walking:
        return None
    rows, between = above[walking[-1]], above[walking[-1] + 1 :]
    if any(outer.body is not inner for outer, inner in itertools.pairwise([rows, *between])):
        return None  # not a perfect nest down to the copy: the reorder could not move them
    split = Split(rows.var.name, lanes)
    inner, tail_inner = split.inner, overlap.in_tail(split.inner)
    vectorized = {Vectorize(overlap.inner), Vectorize(tail)}
    at = records.index(overlap)
    tiled = [
        split,
        Reorder((*(loop.var.name for loop in between), overlap.loop, inner)),
        overlap,
        Reorder((inner, overlap.inner)),
        Reorder((tail_inner, tail)),
        Vectorize(overlap.inner),
        Vectorize(tail),
        Unroll(inner),
        Unroll(tail_inner),
    ]
    threads = {Parallel(rows.var.name): Parallel(split.outer)}
    rest = [threads.get(r, r) for r in records[at + 1 :] if r not in vectorized]
    if any(rows.var.name in _names_in(r) for r in rest):
        return None  # a later record addresses the rows loop, which the split replaces
    return [*records[:at], *tiled, *rest]


def _names_in(record: Record) -> set[str]:
    """The loop and stage names a record's fields hold."""
    names: set[str] = set()
    for value in dataclasses.asdict(record).values():
        values = value if isinstance(value, tuple | list) else (value,)
        names.update(v for v in values if isinstance(v, str))
    return names


def unblock_schedule(stage: StageInfo, block: int, target: Target) -> list[Record]:
    """NC[D][H]W[b]c -> plain: per channel block and row, a tile of pixels (a vector along
    the output's row) for each of the block's channels, so every store is a whole vector; not
    the output's order, in which every read of a row skips `block` floats, nor the input's,
    which stores one float at a time to `block` rows (3x slower measured: 112x112, 32
    channels). With `block` the vector's lanes, the codegen copies each tile across in
    registers (`block` loads of whole blocks and a transpose: 3.6x faster than a gather per
    vector, measured on the same case)."""
    rank = len(stage.shape)
    channel, spatial = stage.loop(1), [stage.loop(k) for k in range(2, rank)]
    if stage.shape[1] <= block:  # part of one block (a 2-class head): channels innermost
        records = [Reorder((stage.loop(0), *spatial, channel)), Unroll(channel)]
        return [*records, Parallel(spatial[0])]
    width, lanes = spatial[-1], _tile_pixels(block, target)
    blocks = Split(channel, block)
    inner = blocks.inner
    records: list[Record] = [blocks, Reorder((stage.loop(0), blocks.outer, *spatial, inner))]
    if stage.shape[-1] >= lanes:  # else a short row: one pixel at a time, its block unrolled
        # The block's channels inside the pixel tile, not outside it with `_vector_rows` over
        # whole rows: 1.5-2x slower measured (the tile's 16 pixels x 16 channels stay in L1).
        ragged = stage.shape[-1] % lanes
        pixels = SplitOverlap(width, lanes) if ragged else Split(width, lanes)
        records += [pixels, Reorder((inner, pixels.inner)), Vectorize(pixels.inner)]
        if isinstance(pixels, SplitOverlap):  # the last vector's copy of the block's channels
            tail_inner = pixels.in_tail(inner)
            records += [Reorder((tail_inner, pixels.tail_loop)), Vectorize(pixels.tail_loop)]
            records.append(Unroll(tail_inner))
    records.append(Unroll(inner))
    if len(spatial) == 1:
        return [*records, Parallel(blocks.outer)]
    # blocks x the outermost spatial axis: work for every thread
    rows = Fuse(blocks.outer, spatial[0])
    return [*records, rows, Parallel(rows.fused)]


def _tile_pixels(block: int, target: Target) -> int:
    """The pixels of a layout transform's tile: as many as the block's channels where the
    codegen can copy the square tile across in registers (a power of two, at least 4, no
    wider than a vector), else a vector's lanes."""
    lanes = target.vector_lanes
    return block if 4 <= block <= lanes and not block & (block - 1) else lanes


def block_schedule(stage: StageInfo, target: Target) -> list[Record]:
    """NC[D][H]W -> NC[D][H]W[b]c: per channel block and row, tiles of b pixels x b channels,
    the pixels unrolled around a vector of channels, so that the codegen copies each tile
    across in registers (b loads along the input's rows, a transpose, b stores of whole
    blocks) instead of gathering every vector of channels from b rows a whole plane apart
    (5x slower measured: 112 x 112, 32 channels)."""
    rank = len(stage.shape)
    block, width = stage.shape[-1], stage.shape[-2]
    channels, spatial = stage.loop(rank - 1), [stage.loop(k) for k in range(2, rank - 1)]
    lanes = _tile_pixels(block, target)
    if block != lanes or width < lanes:
        return generic_schedule(stage, target)
    pixels = SplitOverlap(spatial[-1], lanes) if width % lanes else Split(spatial[-1], lanes)
    records: list[Record] = [pixels, Unroll(pixels.inner), Vectorize(channels)]
    if isinstance(pixels, SplitOverlap):  # the last tile's copy of the channel loop
        records += [Unroll(pixels.tail_loop), Vectorize(pixels.in_tail(channels))]
    rows = Fuse(stage.loop(1), spatial[0]) if len(spatial) > 1 else None
    if rows is None:
        return [*records, Parallel(stage.loop(1))]
    return [*records, rows, Parallel(rows.fused)]


ANCHOR_OPS = ("Conv", "MatMul", "Gemm")


def _prepared(stages: list[StageInfo]):
    # An empty stage lowers to nothing: there is nothing to schedule.
    stages = [s for s in stages if all(stages_dim > 0 for stages_dim in s.shape)]
    records, kept = _inline_intermediates(stages)
    inlined = {s.name for s in stages} - {s.name for s in kept}
    # A GEMM stage any builder made (it notes its panel width) anchors like a MatMul.
    anchor = next(
        (s for s in kept if (s.op in ANCHOR_OPS or s.note("panel")) and s.reduce_axes), None
    )
    return stages, records, kept, inlined, anchor


def _row_anchor(kept: list[StageInfo]) -> StageInfo | None:
    """The output stage of a row-wise kernel (noted by its builder), if the group has one."""
    return next((s for s in kept if s.note("row_stages") and s.output), None)


def tunable_of(stages: list[StageInfo], target: Target) -> Tunable | None:
    """The group's tunable stage, if its anchor has a template."""
    stages, _, kept, inlined, anchor = _prepared(stages)
    row = _row_anchor(kept)
    if anchor is None and row is not None:
        template = TEMPLATES["row_reduction"]
        return Tunable(template, row, None, template.knobs(row, target), target)
    if anchor is None:
        return None
    attention = _attention_chain(kept)
    if attention is not None:
        template = TEMPLATES["attention"]
        epilogue = _epilogue_of(attention, kept, inlined, stages)
        return Tunable(template, attention, epilogue, template.knobs(attention, target), target)
    chained = _chained_depthwise(anchor, kept, inlined, stages)
    if chained is not None:
        template = TEMPLATES["conv2d_nchwc_chain"]
        epilogue = _epilogue_of(chained, kept, inlined, stages)
        return Tunable(template, chained, epilogue, template.knobs(chained, target), target)
    layout = anchor.note("layout")
    if anchor.op == "Conv" and layout in ("nchwc", "nchwc_depthwise"):
        template = TEMPLATES["conv2d_nchwc"]
    elif (anchor.op in ("MatMul", "Gemm") or anchor.note("panel")) and len(anchor.shape) >= 2:
        template = TEMPLATES["dense"]
    else:
        return None
    epilogue = _epilogue_of(anchor, kept, inlined, stages)
    return Tunable(template, anchor, epilogue, template.knobs(anchor, target), target)


def _chained_depthwise(expand: StageInfo, kept: list[StageInfo], inlined: set[str], all_stages):
    """The group's depthwise conv, carrying the expand conv it reads as its `producer` note,
    when the fusion pass chained the two (`fuse_operators`); else None."""
    by_name = {s.name: s for s in kept}
    for s in kept:
        if s.note("layout") != "nchwc_depthwise" or s is expand:
            continue
        sources = _kept_sources(s, inlined, all_stages)
        source = next(iter(sources)) if len(sources) == 1 else None
        notes = {**dict(s.notes), "producer": expand}
        if source == expand.name:
            return dataclasses.replace(s, notes=tuple(sorted(notes.items())))
        epilogue = by_name.get(source)
        if epilogue is not None and _kept_sources(epilogue, inlined, all_stages) == {expand.name}:
            notes["producer_epilogue"] = epilogue.name  # its last stage, kept (see above)
            return dataclasses.replace(s, notes=tuple(sorted(notes.items())))
    return None


def _attention_chain(kept: list[StageInfo]) -> StageInfo | None:
    """The second GEMM (Y = P V) of a group the attention pass joined (`fuse_attention`),
    carrying the scores GEMM and the softmax it reads as its `scores` and `softmax` notes;
    else None."""
    gemms = [s for s in kept if s.note("panel") and s.reduce_axes]
    softmax = next((s for s in kept if s.note("row_stages") and not s.output), None)
    if len(gemms) != 2 or softmax is None:
        return None
    scores, y = gemms
    if softmax.name not in y.reads:
        return None
    notes = {**dict(y.notes), "scores": scores, "softmax": softmax}
    return dataclasses.replace(y, notes=tuple(sorted(notes.items())))


def _stage_named(stages: list[StageInfo], name: str) -> StageInfo | None:
    return next((s for s in stages if s.name == name), None) if name else None


def schedule_for(
    stages: list[StageInfo], target: Target, config: Config | None = None
) -> list[Record]:
    """The group's schedule: inline intermediates, the anchor's template at `config` (its
    default point when None), and a generic parallel/vector schedule for the other stages."""
    stages, records, kept, inlined, anchor = _prepared(stages)
    handled: set[str] = set()
    tunable = tunable_of(stages, target)
    if tunable is not None:
        anchor_records = tunable.records(config)
        records += anchor_records
        handled.add(tunable.anchor.name)
        # Stages the template inlined (an activation B's packing, with `pack=0`) or computed
        # inside its loops (an im2col conv's columns, per output row).
        handled |= {r.stage for r in anchor_records if isinstance(r, ComputeInline | ComputeAt)}
    elif anchor is not None:
        epilogue = _epilogue_of(anchor, kept, inlined, stages)
        layout = anchor.note("layout")
        if anchor.op == "Conv" and len(anchor.shape) == 4 and layout in ("packed", "depthwise"):
            if anchor.note("window") == "plain":
                padded = _stage_named(stages, anchor.note("padded"))
                if anchor.note("width_stride") == 1:
                    records += depthwise_window_schedule(anchor, epilogue, padded, target)
                else:  # strided loads: a whole row of them per tap (measured: see the note)
                    records += plain_window_schedule(anchor, epilogue, padded, target)
                handled.add(anchor.note("padded"))
            else:
                records += conv_schedule(anchor, epilogue, anchor.note("block"), target)
            handled.add(anchor.name)
            if epilogue is not None:
                handled.add(epilogue.name)
    if tunable is not None and tunable.epilogue is not None:
        handled.add(tunable.epilogue.name)
    if tunable is not None and tunable.template.name == "row_reduction":
        handled.update(tunable.anchor.note("row_stages"))
    for stage in kept:
        if stage.name in handled:
            continue
        epilogue = _epilogue_of(stage, kept, inlined, stages)
        if epilogue is not None and _kept_sources(epilogue, inlined, stages) != {stage.name}:
            epilogue = None  # it also reads another stage: not a single-store epilogue
        if stage.note("window") == "plain":
            padded = _stage_named(stages, stage.note("padded"))
            rows = _stage_named(stages, stage.note("rows", ""))
            records += plain_window_schedule(stage, epilogue, padded, target, rows)
            handled |= {stage.name, stage.note("padded"), stage.note("rows", "")}
        # The layout pass's blocks: a vector register, or 8 lanes (a ymm register) where the
        # channels allow no more (ShuffleNet's 24-channel stem pool ran 5x slower unscheduled).
        elif stage.note("pool") == "blocked" and stage.shape[-1] in (target.vector_lanes, 8):
            records += blocked_pool_schedule(stage, epilogue, target)
            handled |= {stage.name, stage.note("padded")}
        elif stage.note("winograd_input"):
            records += winograd_input_schedule(stage, target)
            handled |= {stage.name, stage.note("winograd_rows")}
            continue
        elif stage.note("winograd_output"):
            records += winograd_output_schedule(stage, epilogue, target)
            handled |= {stage.name, stage.note("winograd_columns")}
        elif stage.note("strassen_input"):
            records += strassen_input_schedule(stage, target)
            handled.add(stage.name)
            continue
        elif stage.note("strassen_packed_input"):
            records += strassen_packed_input_schedule(stage, target)
            handled.add(stage.name)
            continue
        elif stage.note("strassen_output"):
            records += strassen_output_schedule(stage, epilogue, target)
            handled.add(stage.name)
        elif stage.note("vector_inner") and stage.shape[-1] > 1 and _reduces(stage):
            records += inner_vector_reduction_schedule(stage, epilogue, target)
            handled.add(stage.name)
        else:
            continue
        handled |= {epilogue.name} if epilogue is not None else set()
    for stage in kept:
        if stage.name in handled:
            continue
        if stage.note("panel") and stage.reduce_axes:
            # Another GEMM stage of the group (a recurrence has one outside its loop and one
            # in it): the dense template at its default point; the tuner tunes the anchor.
            dense = TEMPLATES["dense"]
            records += Tunable(dense, stage, None, dense.knobs(stage, target), target).records()
        elif stage.note("row_partial"):
            records += row_partial_schedule(stage.name, len(stage.shape) - 1)
            records += _parallel_rows(stage, len(stage.shape) - 1)
        elif stage.note("unblock") and stage.pure:
            records += unblock_schedule(stage, stage.note("unblock"), target)
        elif stage.note("block") and stage.pure:
            records += block_schedule(stage, target)
        else:
            records += generic_schedule(stage, target)
    return _serial_small_step_stages(records, stages)


# Work (multiply-adds or elements) below which a stage inside a recurrence's step runs on one
# thread: it runs once per step, and a parallel region's fork and join (a few microseconds)
# would cost more than the stage itself, hundreds of times over.
STEP_PARALLEL_MIN_WORK = 1 << 16


def _serial_small_step_stages(records: list[Record], stages: list[StageInfo]) -> list[Record]:
    small = {
        s.name
        for s in stages
        if s.note("in_step")
        and math.prod(s.shape) * math.prod(e for _, e in s.reduce_axes) < STEP_PARALLEL_MIN_WORK
    }
    if not small:
        return records
    names = sorted((s.name for s in stages), key=len, reverse=True)

    def owner(loop: str) -> str | None:  # loops are named after their stage
        return next((n for n in names if loop.startswith(n + "_")), None)

    return [r for r in records if not (isinstance(r, Parallel) and owner(r.loop) in small)]


def _parallel_rows(stage: StageInfo, rows: int) -> list[Record]:
    outer = next((k for k in range(rows) if stage.shape[k] > 1), None)
    return [] if outer is None else [Parallel(stage.loop(outer))]


def default_schedule(stages: list[StageInfo], target: Target) -> list[Record]:
    return schedule_for(stages, target)
