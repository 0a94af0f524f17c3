"""Winograd convolution F(m x m, 3 x 3) over the blocked channel layout.

A 3x3 stride-1 convolution computes each m x m tile of its output from an (m + 2)^2 window
of its input with (m + 2)^2 multiplications per channel pair instead of 9 m^2 (Lavin and
Gray, "Fast Algorithms for Convolutional Neural Networks"): 2.25x fewer for m = 2, 4x for
m = 4. With alpha = m + 2 and the transform matrices B, G and A of the tile size:

    U[p] = G g G^T          the filters, once at build time (p = eps * alpha + nu)
    V[p] = B^T d B          each input tile, per input channel    (stages `wgrow`, `wgin`)
    M[p] = sum_c U[p] V[p]  alpha^2 independent GEMMs over channels     (the anchor)
    Y    = A^T M A          each output tile, per output channel  (stages `wgcol`, `wgout`)

Each transform is two stages, one per side of the tile; the first (d B, M A) is computed at
the tile's loop of the second, so its alpha^2 vectors stay in L1.

A 3-D conv of frames ((1, 3, 3), stride 1, no padding along depth: R(2+1)D's spatial convs)
runs the same stages with its frames as the batch; only its padded input and its output
pixels index depth.

The GEMM stage is shaped as a grouped 1x1 blocked conv over a row of tiles (one group of
output blocks per position p, each reading the input blocks of its own p), so it runs on the
blocked conv's register-tiled micro-kernel and template. The transforms are written as sums
over the nonzero coefficients only, chosen per position by a select on the position: the
schedules unroll the position loops, and the renderer keeps the branch a constant condition
picks, so each unrolled copy is just its own short sum.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from compiler_core.kernels.base import KernelContext
from compiler_core.kernels.schedules import WINOGRAD_MIN_CHANNELS, winograd_tile
from compiler_core.loop.ir import INDEX, Binary, Const, Expr, Select
from compiler_core.target import Target
from compiler_core.te import Tensor, compute, reduce_axis, reduce_sum


@dataclasses.dataclass(frozen=True)
class WinogradTransform:
    """The matrices of F(m x m, 3 x 3): B^T (alpha x alpha), G (alpha x 3), A^T (m x alpha)."""

    m: int
    bt: tuple[tuple[float, ...], ...]
    g: tuple[tuple[float, ...], ...]
    at: tuple[tuple[float, ...], ...]

    @property
    def alpha(self) -> int:
        return self.m + 2


# Interpolation points 0, 1, -1 (m = 2) and 0, 1, -1, 2, -2 (m = 4), with the point at
# infinity: the usual choice, whose coefficients are small integers in B and A.
TRANSFORMS: dict[int, WinogradTransform] = {
    2: WinogradTransform(
        m=2,
        bt=((1, 0, -1, 0), (0, 1, 1, 0), (0, -1, 1, 0), (0, 1, 0, -1)),
        g=((1, 0, 0), (0.5, 0.5, 0.5), (0.5, -0.5, 0.5), (0, 0, 1)),
        at=((1, 1, 1, 0), (0, 1, -1, -1)),
    ),
    4: WinogradTransform(
        m=4,
        bt=(
            (4, 0, -5, 0, 1, 0),
            (0, -4, -4, 1, 1, 0),
            (0, 4, -4, -1, 1, 0),
            (0, -2, -1, 2, 1, 0),
            (0, 2, -1, -2, 1, 0),
            (0, 4, 0, -5, 0, 1),
        ),
        g=(
            (1 / 4, 0, 0),
            (-1 / 6, -1 / 6, -1 / 6),
            (-1 / 6, 1 / 6, -1 / 6),
            (1 / 24, 1 / 12, 1 / 6),
            (1 / 24, -1 / 12, 1 / 6),
            (0, 0, 1),
        ),
        at=((1, 1, 1, 1, 1, 0), (0, 1, -1, 2, -2, 0), (0, 1, 1, 4, 4, 0), (0, 1, -1, 8, -8, 1)),
    ),
}


def transformed_filters(weights: np.ndarray, transform: WinogradTransform) -> np.ndarray:
    """[M, C, 3, 3] filters -> [alpha^2, M, C]: G g G^T per filter, computed in float64 and
    rounded once."""
    g = np.asarray(transform.g, np.float64)
    u = np.einsum("ea,mcab,nb->enmc", g, weights.astype(np.float64), g)
    alpha = transform.alpha
    return u.reshape(alpha * alpha, *weights.shape[:2]).astype(weights.dtype)


def sparse_sum(coefficients, terms: list[Expr], dtype: str) -> Expr:
    """sum(c * t) over the nonzero coefficients, with no multiply for +-1."""
    total = None
    for c, term in zip(coefficients, terms, strict=True):
        if c == 0:
            continue
        if abs(c) != 1:
            term = Const(abs(c), dtype) * term
        if total is None:
            total = -term if c < 0 else term
        else:
            total = total - term if c < 0 else total + term
    return total if total is not None else Const(0.0, dtype)


def select_case(index: Expr, cases: list[Expr]) -> Expr:
    """cases[index] as a chain of selects on a small index (constant once its loop unrolls)."""
    chosen = cases[-1]
    for k in range(len(cases) - 2, -1, -1):
        chosen = Select(Binary("eq", index, Const(k, INDEX)), cases[k], chosen)
    return chosen


@dataclasses.dataclass(frozen=True)
class TileGrid:
    """Output tiles of m x m pixels over an out_h x out_w image: rows x cols of them, computed
    as `tiles` (rows * cols, or more when the GEMM's row of tiles is padded to a good register
    tile; the extra tiles read zeros past the image)."""

    m: int
    rows: int
    cols: int
    tiles: int

    @property
    def padded_rows(self) -> int:
        return -(-self.tiles // self.cols)


def winograd_conv(
    ctx: KernelContext,
    node,
    padded_input,
    weights: np.ndarray,
    grid: TileGrid,
    data_block: int,
    block: int,
    bias: Tensor | None,
    out_shape: tuple[int, ...],
    dtype: str,
    notes: dict | None = None,
) -> list[Tensor]:
    """The stages of a blocked F(m x m, 3 x 3) conv: the input tiles' row transforms and
    their positions (V), the GEMMs, the output tiles' column transforms and their pixels (with
    the bias). `padded_input` is NCHW[ib]c data padded so that every tile's window lies inside
    it ((padded_rows * m + 2) x (cols * m + 2)); `weights` are [M, C, 3, 3] with M and C whole
    blocks; the result is NCHW[b]c. For a conv of frames (`frame_conv`) the result is
    NCDHW[b]c (`out_shape` of rank 6) and `padded_input`'s batch holds its frames, frame d of
    image n at n * D + d: every stage before the last runs on them as on a batch of images.
    `notes` go on the GEMM stage, the group's anchor (the algorithms the conv can run, and the
    one it runs)."""
    t = TRANSFORMS[grid.m]
    alpha, m, cols = t.alpha, grid.m, grid.cols
    positions = alpha * alpha
    n_batch, in_blocks = padded_input.shape[0], padded_input.shape[1]
    out_channels, in_channels = weights.shape[:2]
    out_blocks = out_channels // block

    def tile_origin(tile):
        row = Binary("floordiv", tile, Const(cols, INDEX)) * Const(m, INDEX)
        col = Binary("mod", tile, Const(cols, INDEX)) * Const(m, INDEX)
        return row, col

    def input_rows(n, cb, tile, a, nu, ci):  # (d B)[a, nu]: B's columns are B^T's rows
        row, col = tile_origin(tile)
        window = [padded_input[(n, cb, row + a, col + Const(b, INDEX), ci)] for b in range(alpha)]
        return select_case(nu, [sparse_sum(t.bt[k], window, dtype) for k in range(alpha)])

    rows = compute(
        (n_batch, in_blocks, grid.tiles, alpha, alpha, data_block),
        input_rows,
        ctx.stage_name(node, prefix="wgrow"),
        dtype,
    )

    def input_tile(n, p, cb, tile, ci):  # (B^T d B)[eps, nu]
        eps = Binary("floordiv", p, Const(alpha, INDEX))
        nu = Binary("mod", p, Const(alpha, INDEX))
        column = [rows[(n, cb, tile, Const(a, INDEX), nu, ci)] for a in range(alpha)]
        return select_case(eps, [sparse_sum(t.bt[k], column, dtype) for k in range(alpha)])

    v = compute(
        (n_batch, positions, in_blocks, grid.tiles, data_block),
        input_tile,
        ctx.stage_name(node, prefix="wgin"),
        dtype,
    )
    ctx.note(rows.name, materialize=True)
    ctx.note(v.name, materialize=True, winograd_input=m, winograd_rows=rows.name)

    # U packed as a grouped 1x1 blocked conv's filters: [alpha^2 * M/b, C/ib, ib, b].
    u = transformed_filters(weights, t).reshape(
        positions, out_blocks, block, in_channels // data_block, data_block
    )
    packed = u.transpose(0, 1, 3, 4, 2).reshape(positions * out_blocks, -1, data_block, block)
    up = ctx.packed(node.inputs[1], f"winograd{m}_oi{data_block}i{block}o", packed)
    rco, rci = reduce_axis(in_blocks, "rco"), reduce_axis(data_block, "rci")

    def product(n, mo, tile, mi):
        p = Binary("floordiv", mo, Const(out_blocks, INDEX))
        return reduce_sum(v[(n, p, rco, tile, rci)] * up[(mo, rco, rci, mi)], [rco, rci])

    gemm = compute(
        (n_batch, positions * out_blocks, grid.tiles, block), product, ctx.stage_name(node), dtype
    )
    ctx.note(
        gemm.name,
        layout="nchwc",
        weights=up.name,
        block=block,
        group_blocks=out_blocks,
        winograd=m,
        **(notes or {}),
    )

    def output_columns(n, mo, tile, eps, j, mi):  # (M A)[eps, j]
        products = [
            gemm[(n, (eps * alpha + Const(nu, INDEX)) * Const(out_blocks, INDEX) + mo, tile, mi)]
            for nu in range(alpha)
        ]
        return select_case(j, [sparse_sum(t.at[k], products, dtype) for k in range(m)])

    columns = compute(
        (n_batch, out_blocks, grid.tiles, alpha, m, block),
        output_columns,
        ctx.stage_name(node, prefix="wgcol"),
        dtype,
    )

    frames = out_shape[2] if len(out_shape) == 6 else 0

    def output_pixel(n, mo, *rest):  # (A^T M A)[i, j]
        if frames:  # frame d of image n is the batch's n * D + d
            d, h, w, mi = rest
            n = n * Const(frames, INDEX) + d
        else:
            h, w, mi = rest
        i, j = Binary("mod", h, Const(m, INDEX)), Binary("mod", w, Const(m, INDEX))
        tile = Binary("floordiv", h, Const(m, INDEX)) * Const(cols, INDEX) + Binary(
            "floordiv", w, Const(m, INDEX)
        )
        column = [columns[(n, mo, tile, Const(eps, INDEX), j, mi)] for eps in range(alpha)]
        value = select_case(i, [sparse_sum(t.at[k], column, dtype) for k in range(m)])
        return value + bias[(mo, mi)] if bias is not None else value

    out = compute(out_shape, output_pixel, ctx.stage_name(node, prefix="wgout"), dtype)
    ctx.note(columns.name, materialize=True)
    ctx.note(out.name, materialize=True, winograd_output=m, winograd_columns=columns.name)
    return [out]


def tile_grid(out_h: int, out_w: int, m: int, row_width) -> TileGrid:
    """The tile grid of an out_h x out_w output; `row_width(tiles)` pads the GEMM's row."""
    rows, cols = -(-out_h // m), -(-out_w // m)
    return TileGrid(m, rows, cols, row_width(rows * cols))


def input_padding(pads, in_h: int, in_w: int, grid: TileGrid) -> tuple[int, int, int, int]:
    """ONNX-order pads (top, left, bottom, right) that make the input cover every tile's
    window: the conv's own pads, then zeros to (padded_rows * m + 2) x (cols * m + 2)."""
    top, left = pads[0], pads[1]
    height = grid.padded_rows * grid.m + 2
    width = grid.cols * grid.m + 2
    return top, left, height - in_h - top, width - in_w - left


def conv_algorithms(
    kernel, strides, dilations, group: int, in_channels: int, out_channels: int
) -> tuple[str, ...]:
    """The algorithms a 2-D conv can run as: "direct", and for a 3x3 stride-1 conv without
    dilation or groups with WINOGRAD_MIN_CHANNELS on both sides, "winograd2" and "winograd4"
    (F(2x2, 3x3) and F(4x4, 3x3)). The tuner measures each (the `algorithm` knob); the layout
    pass gives a conv that has Winograd among them blocked data (the transforms read and write
    NCHW[b]c)."""
    dense_3x3 = tuple(kernel) == (3, 3) and group == 1
    unit = tuple(strides) == (1, 1) and tuple(dilations) == (1, 1)
    if not (dense_3x3 and unit) or min(in_channels, out_channels) < WINOGRAD_MIN_CHANNELS:
        return ("direct",)
    return ("direct", *(f"winograd{m}" for m in sorted(TRANSFORMS)))


def frame_conv(kernel, strides, dilations, pads) -> bool:
    """Whether a 3-D conv is a 2-D conv of each frame: one tap, stride 1, no dilation and no
    padding along depth (R(2+1)D's (1, 3, 3) spatial convs)."""
    if len(kernel) != 3:
        return False
    return (kernel[0], strides[0], dilations[0], pads[0], pads[3]) == (1, 1, 1, 0, 0)


def spatial_algorithms(
    kernel, strides, dilations, pads, group: int, in_channels: int, out_channels: int
) -> tuple[str, ...]:
    """`conv_algorithms` of a 2-D conv, or of a 3-D conv of frames (`frame_conv`): its frames'
    2-D conv, whose Winograd stages take the frames as a batch (`winograd_conv`)."""
    if frame_conv(kernel, strides, dilations, pads):
        kernel, strides, dilations = kernel[1:], strides[1:], dilations[1:]
    elif len(kernel) != 2:
        return ("direct",)
    return conv_algorithms(kernel, strides, dilations, group, in_channels, out_channels)


def default_algorithm(algorithms: tuple[str, ...], out_h: int, out_w: int, target: Target) -> str:
    """The untuned choice among `algorithms` on `target` (see `winograd_tile`)."""
    tile = winograd_tile(out_h, out_w, target) if len(algorithms) > 1 else 0
    return f"winograd{tile}" if tile else "direct"


def winograd_size(algorithm: str) -> int:
    """The output tile of a "winograd<m>" algorithm, 0 for "direct"."""
    return int(algorithm.removeprefix("winograd")) if algorithm.startswith("winograd") else 0
