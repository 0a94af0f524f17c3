"""One or two levels of Strassen's algorithm for a GEMM by constant weights.

C = A B with A, B and C split in 2 x 2 blocks takes seven block products instead of eight
(Strassen, "Gaussian elimination is not optimal", 1969):

    M[p] = (sum_a alpha[p, a] A_a) (sum_b beta[p, b] B_b)     p = 0..6
    C_c  = sum_p gamma[p, c] M[p]

The weights are constant, so the seven sums of B's blocks are made once, at build time (in
float64, rounded once), as a Winograd conv's transformed filters are: what is left at run time
is a pass over A (`strsa`: seven sums of its blocks, 7/4 of A), the seven products (one
batched GEMM on the dense template: 7/8 of the direct GEMM's multiply-adds) and a pass that
adds each output block from two to four of them (`strout`, which also carries the bias and
the group's epilogue). It pays where the GEMM's time dwarfs those two passes (a batch of 64
through a 1024-wide layer); the tuner decides (the `algorithm` knob), checking each
candidate's output against the reference as it does every other.

On a target of few vector registers (AVX2's 16) the products' register tiles, which read the
sums' rows a row's stride apart, are held to 4 rows (rows a multiple of 4 KB apart share an L1
set); STRASSEN_PACKED writes the sums in the packed-A GEMM's row-tile panels instead, and the
products take 6-row tiles. On Zen 3 the tuner took it for GEMM 2048^3: 102.9 ms in the model
against 118.5 for Strassen's plain sums and 139.4 for the packed-A GEMM.

Two levels (STRASSEN2) split each block again: 49 products of a sixteenth of the GEMM, 49/64
of its multiply-adds, from sums of one to four of A's 16 blocks, each output block a sum of 4 to
16 products (`strassen_tables`: the one-level tables' Kronecker squares). The products are
small GEMMs at the FMA peak as long as their rows fill register tiles (16 rows or more); the
sums of B take 49/16 of B's bytes. On Zen 4 the tuner took it for GEMM 2048^3 (64.5 ms in the
model against 69.1 for one level); at 1024^3 and for the MLP's two layers at batch 64 one level
stayed ahead in the model (the output pass reads 144 product blocks, not 12).

Block indices, row-major: 0 = (top, left), 1 = (top, right), 2 = (bottom, left), 3 = (bottom,
right); with two levels, the 4 x 4 grid's blocks row-major.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from compiler_core.kernels.base import KernelContext
from compiler_core.kernels.injective import flatten, padded_row
from compiler_core.kernels.winograd import select_case, sparse_sum
from compiler_core.loop.ir import INDEX, Binary, Const
from compiler_core.te import Tensor, compute

STRASSEN = "strassen"
# Strassen's products reading the sums of A's blocks as the packed-A GEMM reads A: laid out in
# row-tile panels by the pass that makes them (`packed_input_sums`).
STRASSEN_PACKED = "strassen_packed_a"
# Two levels: each block split again, 49 products of a sixteenth of the GEMM each, 49/64 of
# its multiply-adds (`strassen_tables`).
STRASSEN2 = "strassen2"
# Each algorithm's levels. Two levels over packed sums ran GEMM 1024^3 at 17.7 ms on Zen 4
# at its default knobs, against 9.2 over plain sums: not offered.
LEVELS = {STRASSEN: 1, STRASSEN_PACKED: 1, STRASSEN2: 2}
PRODUCTS = 7

# Strassen's seven products, a row each: the blocks of A (alpha) and of B (beta) it
# multiplies, and the blocks of C (gamma) it is added to.
ALPHA = (
    (1, 0, 0, 1),  # M0 = (A0 + A3)(B0 + B3)
    (0, 0, 1, 1),  # M1 = (A2 + A3) B0
    (1, 0, 0, 0),  # M2 = A0 (B1 - B3)
    (0, 0, 0, 1),  # M3 = A3 (B2 - B0)
    (1, 1, 0, 0),  # M4 = (A0 + A1) B3
    (-1, 0, 1, 0),  # M5 = (A2 - A0)(B0 + B1)
    (0, 1, 0, -1),  # M6 = (A1 - A3)(B2 + B3)
)
BETA = (
    (1, 0, 0, 1),
    (1, 0, 0, 0),
    (0, 1, 0, -1),
    (-1, 0, 1, 0),
    (0, 0, 0, 1),
    (1, 1, 0, 0),
    (0, 0, 1, 1),
)
GAMMA = (  # C0 = M0 + M3 - M4 + M6, C1 = M2 + M4, C2 = M1 + M3, C3 = M0 - M1 + M2 + M5
    (1, 0, 0, 1),
    (0, 0, 1, -1),
    (0, 1, 0, 1),
    (1, 0, 1, 0),
    (-1, 1, 0, 0),
    (0, 0, 0, 1),
    (1, 0, 0, 0),
)

# The least multiply-adds, and the least depth, for which a GEMM offers the algorithm: the
# two extra passes cost O(rows x (depth + columns)), the eighth product it saves O(rows x
# depth x columns). Below them the passes cost about what the product saves (untuned, 1024
# rows: 256 deep, 1024 wide 1.02x the direct GEMM's time; 1024 deep, 256 wide 0.95x), and
# the tuner's time is better spent on the direct GEMM's knobs.
STRASSEN_MIN_MACS = 1 << 24
STRASSEN_MIN_DEPTH = 512


def gemm_algorithms(rows: int, depth: int, columns: int, lanes: int) -> tuple[str, ...]:
    """The algorithms of a GEMM by constant weights: "direct", "strassen" where the GEMM is
    large enough to gain from it and its rows, depth and columns halve (the columns into
    whole panels of two vectors, so that no product pads its columns), and "strassen2" where
    they quarter so, into blocks of 16 rows or more."""
    large = rows * depth * columns >= STRASSEN_MIN_MACS and min(rows, columns) >= 16
    if not (large and depth >= STRASSEN_MIN_DEPTH):
        return ("direct",)
    algorithms = ("direct",)
    for algorithm, side, least_rows in ((STRASSEN, 2, 8), (STRASSEN2, 4, 16)):
        whole = rows % side == 0 and depth % side == 0 and columns % side == 0
        if whole and (columns // side) % (2 * lanes) == 0 and rows // side >= least_rows:
            algorithms += (algorithm,)
    return algorithms


@functools.cache
def strassen_tables(levels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(alpha, beta, gamma) of `levels` levels, each [7^levels products, 4^levels blocks]: a
    block of the 2^levels x 2^levels grid (row-major) splits again at each level, so the
    tables are Kronecker powers of ALPHA, BETA and GAMMA, whose columns run over the blocks
    outer level first; each column is moved to its block's place in the grid. Computed once
    per level count (read-only: every build of a Strassen GEMM reads them)."""
    tables = [np.asarray(t, np.int64) for t in (ALPHA, BETA, GAMMA)]
    powers = tables
    block_row, block_column = np.array([0, 0, 1, 1]), np.array([0, 1, 0, 1])
    rows, columns = block_row, block_column
    for _ in range(levels - 1):
        powers = [np.kron(power, table) for power, table in zip(powers, tables, strict=True)]
        rows = np.add.outer(2 * rows, block_row).ravel()
        columns = np.add.outer(2 * columns, block_column).ravel()
    grid = rows * (1 << levels) + columns  # the grid's block of each Kronecker column
    ordered = []
    for power in powers:
        table = np.zeros_like(power)
        table[:, grid] = power
        table.setflags(write=False)
        ordered.append(table)
    return tuple(ordered)


def combined_weights(b: np.ndarray, levels: int = 1) -> np.ndarray:
    """[K, N] weights -> [7^levels, K/s, N/s] (s = 2^levels): each product's sum of B's
    blocks, in float64, rounded once."""
    k, n = b.shape
    side = 1 << levels
    blocks = b.astype(np.float64).reshape(side, k // side, side, n // side).transpose(0, 2, 1, 3)
    blocks = blocks.reshape(side * side, k // side, n // side)
    beta = strassen_tables(levels)[1].astype(np.float64)
    return np.einsum("pb,bkn->pkn", beta, blocks).astype(b.dtype)


def input_sums(
    ctx: KernelContext, node, a_at, rows: int, depth: int, dtype: str, levels: int = 1
) -> Tensor:
    """[7^levels, rows/s, depth/s] (s = 2^levels): each product's sum of A's blocks; `a_at(i,
    k)` reads A. Its own stage (read by every column tile of the products), scheduled by
    `strassen_input_schedule` with the product loop unrolled, so each copy is its own sum of
    one to four blocks."""
    side = 1 << levels
    block_rows, block_depth = rows // side, depth // side

    def body(p, i, k):
        return _block_sums(a_at, p, i, k, block_rows, block_depth, dtype, levels)

    shape = (PRODUCTS**levels, block_rows, block_depth)
    sums = compute(shape, body, ctx.stage_name(node, "strsa"), dtype)
    ctx.note(sums.name, materialize=True, strassen_input=True)
    return sums


def packed_input_sums(
    ctx: KernelContext, node, a_at, rows: int, depth: int, mr: int, dtype: str, levels: int = 1
) -> Tensor:
    """[7^levels, tiles, depth/s, mr]: `input_sums` laid out as the packed-A GEMM's row-tile
    panels (a reduction step's mr values of a tile side by side), so that each product's
    register tile reads one stream, not mr rows a row's stride apart (which share an L1 set
    when the stride is a multiple of 4 KB, and cap the direct tile's rows). The pass that
    makes the sums writes them packed at no extra cost. Rows past the real ones repeat the
    last; their products are cropped. Scheduled by `strassen_packed_input_schedule`."""
    side = 1 << levels
    block_rows, block_depth = rows // side, depth // side
    tiles = -(-block_rows // mr)

    def body(p, t, k, r):
        i = padded_row(t * Const(mr, INDEX) + r, block_rows, tiles * mr)
        return _block_sums(a_at, p, i, k, block_rows, block_depth, dtype, levels)

    shape = (PRODUCTS**levels, tiles, block_depth, mr)
    sums = compute(shape, body, ctx.stage_name(node, "strsa"), dtype)
    ctx.note(sums.name, materialize=True, strassen_packed_input=True)
    return sums


def _block_sums(a_at, p, i, k, block_rows: int, block_depth: int, dtype: str, levels: int):
    """Product p's sum of A's blocks at (i, k) of a block (a select over p: constant once the
    product loop unrolls)."""
    side = 1 << levels
    blocks = [
        a_at(i + Const(r * block_rows, INDEX), k + Const(c * block_depth, INDEX))
        for r in range(side)
        for c in range(side)
    ]
    alpha = strassen_tables(levels)[0]
    return select_case(p, [sparse_sum(row, blocks, dtype) for row in alpha])


def output_sums(
    ctx: KernelContext, node, product: Tensor, out_shape, bias_at, dtype, levels: int = 1
) -> Tensor:
    """C at the output's shape ([..., columns]: the GEMM's rows are its leading axes, flat)
    from the products ([7^levels, >= rows/s, columns/s]), plus `bias_at(i, j)` when given.
    Scheduled by `strassen_output_schedule`: the block loops unrolled, so each copy reads
    its own two to four products (4 to 16 with two levels)."""
    rows, columns = math.prod(out_shape[:-1]), out_shape[-1]
    side = 1 << levels
    block_rows, block_columns = rows // side, columns // side
    gamma = strassen_tables(levels)[2]

    def body(*index):
        i, j = flatten(index[:-1], out_shape[:-1]), index[-1]
        block_row = Binary("floordiv", i, Const(block_rows, INDEX))
        block_column = Binary("floordiv", j, Const(block_columns, INDEX))
        row = Binary("mod", i, Const(block_rows, INDEX))
        column = Binary("mod", j, Const(block_columns, INDEX))
        products = [product[(Const(p, INDEX), row, column)] for p in range(len(gamma))]
        cases = [sparse_sum(gamma[:, c], products, dtype) for c in range(side * side)]
        value = select_case(block_row * Const(side, INDEX) + block_column, cases)
        return value + bias_at(i, j) if bias_at is not None else value

    out = compute(tuple(out_shape), body, ctx.stage_name(node, "strout"), dtype)
    ctx.note(out.name, materialize=True, strassen_output=(block_rows, block_columns))
    return out
