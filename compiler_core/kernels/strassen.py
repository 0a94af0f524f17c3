"""One level of Strassen's algorithm for a GEMM by constant weights.

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

Block indices, row-major: 0 = (top, left), 1 = (top, right), 2 = (bottom, left), 3 = (bottom,
right).
"""

from __future__ import annotations

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
    """The algorithms of a GEMM by constant weights: "direct", and "strassen" where the GEMM
    is large enough to gain from it and its rows, depth and columns halve (the columns into
    whole panels of two vectors, so that no product pads its columns)."""
    halves = rows % 2 == 0 and depth % 2 == 0 and columns % 2 == 0
    halves = halves and (columns // 2) % (2 * lanes) == 0
    large = rows * depth * columns >= STRASSEN_MIN_MACS and min(rows, columns) >= 16
    large = large and depth >= STRASSEN_MIN_DEPTH
    return ("direct", STRASSEN) if halves and large else ("direct",)


def combined_weights(b: np.ndarray) -> np.ndarray:
    """[K, N] weights -> [7, K/2, N/2]: each product's sum of B's blocks."""
    k, n = b.shape
    blocks = b.astype(np.float64).reshape(2, k // 2, 2, n // 2).transpose(0, 2, 1, 3)
    blocks = blocks.reshape(4, k // 2, n // 2)
    combined = np.einsum("pb,bkn->pkn", np.asarray(BETA, np.float64), blocks)
    return combined.astype(b.dtype)


def input_sums(ctx: KernelContext, node, a_at, rows: int, depth: int, dtype: str) -> Tensor:
    """[7, rows/2, depth/2]: each product's sum of A's blocks; `a_at(i, k)` reads A. Its own
    stage (read by every column tile of the products), scheduled by `strassen_input_schedule`
    with the product loop unrolled, so each copy is its own one- or two-term sum."""
    half_rows, half_depth = rows // 2, depth // 2

    def body(p, i, k):
        return _block_sums(a_at, p, i, k, half_rows, half_depth, dtype)

    sums = compute((PRODUCTS, half_rows, half_depth), body, ctx.stage_name(node, "strsa"), dtype)
    ctx.note(sums.name, materialize=True, strassen_input=True)
    return sums


def packed_input_sums(
    ctx: KernelContext, node, a_at, rows: int, depth: int, mr: int, dtype: str
) -> Tensor:
    """[7, tiles, depth/2, mr]: `input_sums` laid out as the packed-A GEMM's row-tile panels
    (a reduction step's mr values of a tile side by side), so that each product's register
    tile reads one stream, not mr rows a row's stride apart (which share an L1 set when the
    stride is a multiple of 4 KB, and cap the direct tile's rows). The pass that makes the
    sums writes them packed at no extra cost. Rows past the real ones repeat the last; their
    products are cropped. Scheduled by `strassen_packed_input_schedule`."""
    half_rows, half_depth = rows // 2, depth // 2
    tiles = -(-half_rows // mr)

    def body(p, t, k, r):
        i = padded_row(t * Const(mr, INDEX) + r, half_rows, tiles * mr)
        return _block_sums(a_at, p, i, k, half_rows, half_depth, dtype)

    shape = (PRODUCTS, tiles, half_depth, mr)
    sums = compute(shape, body, ctx.stage_name(node, "strsa"), dtype)
    ctx.note(sums.name, materialize=True, strassen_packed_input=True)
    return sums


def _block_sums(a_at, p, i, k, half_rows: int, half_depth: int, dtype: str):
    """Product p's sum of A's blocks at (i, k) of a block (a select over p: constant once the
    product loop unrolls)."""
    blocks = [
        a_at(i + Const(r * half_rows, INDEX), k + Const(c * half_depth, INDEX))
        for r in (0, 1)
        for c in (0, 1)
    ]
    return select_case(p, [sparse_sum(ALPHA[q], blocks, dtype) for q in range(PRODUCTS)])


def output_sums(ctx: KernelContext, node, product: Tensor, out_shape, bias_at, dtype) -> Tensor:
    """C at the output's shape ([..., columns]: the GEMM's rows are its leading axes, flat)
    from the seven products ([7, >= rows/2, columns/2]), plus `bias_at(i, j)` when given.
    Scheduled by `strassen_output_schedule`: the block loops unrolled, so each copy reads
    its own two to four products."""
    rows, columns = math.prod(out_shape[:-1]), out_shape[-1]
    half_rows, half_columns = rows // 2, columns // 2

    def body(*index):
        i, j = flatten(index[:-1], out_shape[:-1]), index[-1]
        block_row = Binary("floordiv", i, Const(half_rows, INDEX))
        block_column = Binary("floordiv", j, Const(half_columns, INDEX))
        row = Binary("mod", i, Const(half_rows, INDEX))
        column = Binary("mod", j, Const(half_columns, INDEX))
        products = [product[(Const(p, INDEX), row, column)] for p in range(PRODUCTS)]
        cases = [sparse_sum([g[c] for g in GAMMA], products, dtype) for c in range(4)]
        value = select_case(block_row * Const(2, INDEX) + block_column, cases)
        return value + bias_at(i, j) if bias_at is not None else value

    out = compute(tuple(out_shape), body, ctx.stage_name(node, "strout"), dtype)
    ctx.note(out.name, materialize=True, strassen_output=(half_rows, half_columns))
    return out
