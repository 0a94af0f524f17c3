"""Layout transformation: chains of convolutions keep their activations in NC[D][H]W[b]c.

A CPU convolution vectorizes over one vector of output channels; with plain activations every
vector of a depthwise convolution is a gather, and every conv reads its input with a stride
of the spatial size between channels. This pass gives each eligible Conv blocked outputs
(`out_layout`), lets it read blocked data when its producer already made them (`data_layout`),
carries the blocked layout through the elementwise ops and pooling in between (Relu, GELU,
Clip, a residual Add, MaxPool...) and inserts a `LayoutTransform` only where a consumer needs
plain data: at the edges of a chain. 1-D (NCW[b]c), 2-D (NCHW[b]c) and 3-D (NCDHW[b]c)
convolutions are all blocked the same way.

Eligible: float32 1-D, 2-D or 3-D Conv with a constant weight and no groups or a depthwise
grouping (one input and one output channel per group), with at least 8 output channels or
blocked data (a segmentation head of 2 classes after a blocked chain): when
they do not fill whole blocks (ShuffleNet's 58, the 230 of R(2+1)D's mid planes) the last block
is padded (see `graph/ops/layout.py`), so that an odd channel count never leaves the fast
path; or a conv whose groups' input and output channels are multiples of the block, or whose
groups are smaller than a block and fill it (as many inputs as outputs per group), except a
pointwise conv whose groups fill only half-vector blocks on a core whose FMAs take a whole
vector at once (ShuffleNet's groups of 136 in blocks of 8 on Zen 5): it stays plain and runs
as a MatMul over its pixels (`pointwise_matmul`; ShuffleNet x0.93). Not blocked:
a 1-D conv of plain data with a short reduction (`im2col_conv`: a raw-audio stem) whose output
no reader could take blocked; it runs as a GEMM that writes its plain output directly. Nor a
depthwise 2-D conv of plain data with few taps for its stride (up to 5x5 at stride 1, 3x3 at
stride 2) that no reader takes blocked (a graph output, a permute to channels-last): it runs
as rows of pixel vectors. The block
is the one of a vector register of float32 or 8 lanes, whichever takes the fewest FMA cycles
(`block_cost`: the least padding where a 16-lane FMA costs two 8-lane ones, else the fewest
vectors; the larger on a tie). A plain conv reads its data in whatever block its producer
wrote; a grouped one reads it in its own block, so that every input block belongs to one
group.

Padded values go only through ops that keep their padding lanes finite (`PADDING_SAFE`: the
lanes are read with zero weights, and 0 * inf would not be zero); a Concat joins only whole
blocks.
"""

from __future__ import annotations

from compiler_core.graph.ir import Graph, NameGenerator, Node, OpKind, TensorType
from compiler_core.graph.ops import OP_TABLE
from compiler_core.graph.ops.layout import (
    PLAIN,
    SPATIAL,
    block_cost,
    blocked_layout,
    to_blocked,
)
from compiler_core.graph.ops.nn import spatial_params
from compiler_core.graph.ops.reduce import reduce_axes
from compiler_core.kernels.nn import im2col_conv
from compiler_core.kernels.winograd import spatial_algorithms
from compiler_core.passes.pointwise_matmul import is_pointwise

NAME = "transform_layout"
POOLS = ("MaxPool", "AveragePool")
SPATIAL_REDUCTIONS = ("ReduceMean", "ReduceMax", "ReduceMin", "ReduceSum")
MIN_BLOCKED_CHANNELS = 8
# The most taps of a depthwise conv of plain data that stays plain, by its (square) stride.
# Each tap of a pixel vector is an unaligned load, most of them split across two cache lines
# (with a stride, a masked load and a shuffle), where the blocked conv loads whole vectors;
# blocked, the conv pays a transform on each side. Plain against blocked on Zen 5 (`bench.ab`
# over archives of one-conv models, medians of 40 block ratios): stride 1, 3x3 at 112 x 112
# 0.75, at 56 x 56 0.70, on 576 channels at 14 x 14 0.37, 5x5 at 28 x 28 0.79, but 7x7 at
# 56 x 56 1.30; stride 2, 3x3 at 56 x 56 0.74, at 112 x 112 0.85, but 5x5 at 28 x 28 1.42.
PLAIN_DEPTHWISE_MAX_TAPS = {1: 25, 2: 9}
# Elementwise ops that map finite padding lanes to finite values (no division, logarithm or
# exponential growth), so that a padded blocked value may pass through them.
PADDING_SAFE = frozenset(
    {
        "Identity", "Relu", "LeakyRelu", "Clip", "Sigmoid", "Tanh", "Erf", "Gelu",
        "HardSigmoid", "HardSwish", "Neg", "Abs", "Elu", "Celu", "Selu", "Mish", "Swish",
        "ThresholdedRelu", "Shrink", "Softsign", "Add", "Sub", "Mul", "Mean",
    }
)  # fmt: skip


def block_sizes(lanes: int) -> tuple[int, ...]:
    """Channel blocks to try, largest first: one vector register of float32, else 8 lanes (a
    ymm register) when the channels allow no more."""
    return tuple(sorted({lanes, 8}, reverse=True))


class _Rewriter:
    def __init__(self, graph: Graph, blocks: tuple[int, ...], fma_lanes: int):
        self.graph = graph
        self.blocks, self.fma_lanes = blocks, fma_lanes
        self.fresh = NameGenerator(graph.names())
        self.types = dict(graph.types)
        self.constants = dict(graph.constants)
        self.nodes: list[Node] = []
        # plain value -> {block: the value's twin in NCHW[block]c}
        self.blocked: dict[str, dict[int, str]] = {}
        # (constant, rank) -> the constant reshaped to that rank (`_full_rank`)
        self.full_rank: dict[tuple[str, int], str] = {}
        self.plain: set[str] = set(graph.inputs) | set(graph.constants)  # materialized
        self.readers: dict[str, list[Node]] = {}
        for node in graph.nodes:
            for value in node.inputs:
                self.readers.setdefault(value, []).append(node)

    # --- values in either layout ------------------------------------------------------------

    def as_blocked(self, value: str, block: int) -> str:
        twins = self.blocked.setdefault(value, {})
        if block not in twins and value in self.constants:  # blocked at build time
            twin = self.fresh.unique(f"{value}_{self._layout(value, block).lower()}")
            self.constants[twin] = to_blocked(self.constants[value], block)
            self.types[twin] = TensorType(self.constants[twin].shape, self.types[value].dtype)
            twins[block] = twin
        if block not in twins:
            source_block, source = next(iter(twins.items()), (0, value))
            if not source_block:
                self.as_plain(value)
            twins[block] = self._transform(source, source_block, block, value)
        return twins[block]

    def as_plain(self, value: str) -> str:
        if value not in self.plain:
            block, source = next(iter(self.blocked[value].items()))
            self._transform(source, block, 0, value, output=value)
            self.plain.add(value)
        return value

    def _layout(self, value: str, block: int) -> str:
        """The name of `value`'s layout in `block` (from the rank of its plain form)."""
        return blocked_layout(block, self.types[value].rank)

    def _transform(self, source: str, from_block: int, to_block: int, value: str, output=None):
        target = self._layout(value, to_block)
        output = output or self.fresh.unique(f"{value}_{target.lower()}")
        attrs = {"src_layout": self._layout(value, from_block), "dst_layout": target}
        channels = self.graph.types[value].shape[1]
        if any(block and channels % block for block in (from_block, to_block)):
            attrs["channels"] = channels  # the blocked side is padded
        node = Node(
            "LayoutTransform",
            self.fresh.unique(f"{value}_to_{target.lower()}"),
            (source,),
            (output,),
            attrs,
        )
        self._emit(node)
        return output

    def _emit(self, node: Node) -> None:
        input_types = [self.types[v] if v else None for v in node.inputs]
        out_types = OP_TABLE[node.op].infer(node, input_types)
        for value, t in zip(node.outputs, out_types, strict=False):
            if value:
                self.types[value] = t
        self.nodes.append(node)

    def _produce_blocked(self, node: Node, inputs: tuple[str, ...], block: int, attrs=None):
        out = node.outputs[0]
        twin = self.fresh.unique(f"{out}_{self._layout(out, block).lower()}")
        self.blocked[out] = {block: twin}
        changes = {"inputs": inputs, "outputs": (twin, *node.outputs[1:])}
        if attrs is not None:
            changes["attrs"] = attrs
        self._emit(node.replace(**changes))

    def _block_available(self, value: str) -> int:
        return next(iter(self.blocked.get(value, {})), 0)

    # --- node rewrites -----------------------------------------------------------------------

    def visit(self, node: Node) -> None:
        data_blocked = bool(node.inputs) and node.inputs[0] in self.blocked
        block = _conv_block(self.graph, node, self.blocks, self.fma_lanes, data_blocked)
        if block and not data_blocked and (self._im2col_plain(node) or self._window_plain(node)):
            block = 0
        if block:
            self._blocked_conv(node, block)
        elif self._carried_block(node):
            self._blocked_elementwise(node, self._carried_block(node))
        elif self._pool_block(node):
            block = self._pool_block(node)
            attrs = {**node.attr_dict, "data_layout": self._layout(node.inputs[0], block)}
            self._produce_blocked(node, (self.blocked[node.inputs[0]][block],), block, attrs)
        elif self._reduce_block(node):
            block = self._reduce_block(node)
            self._produce_blocked(node, (self.blocked[node.inputs[0]][block],), block)
        elif self._concat_block(node):
            block = self._concat_block(node)
            inputs = tuple(self.as_blocked(v, block) for v in node.inputs)
            self._produce_blocked(node, inputs, block, {**node.attr_dict, "axis": 1})
        else:
            inputs = tuple(self.as_plain(v) if v in self.blocked else v for v in node.inputs)
            self._emit(node.replace(inputs=inputs))
            self.plain.update(v for v in node.outputs if v)

    def _blocked_conv(self, node: Node, block: int) -> None:
        x = node.inputs[0]
        # A grouped (or depthwise) conv reads data in its own block, as does a conv that may
        # run as Winograd (its input transform vectorizes over a block); any other conv reads
        # data in the block its producer wrote, or plain.
        own_block = node.attr("group", 1) > 1 or _winograd(self.graph, node)
        data_block = block if own_block else self._block_available(x)
        data = self.as_blocked(x, data_block) if data_block else self.as_plain(x)
        attrs = {
            **node.attr_dict,
            "data_layout": self._layout(x, data_block),
            "out_layout": self._layout(node.outputs[0], block),
        }
        self._produce_blocked(node, (data, *node.inputs[1:]), block, attrs)

    def _im2col_plain(self, node: Node) -> bool:
        """Whether a conv of plain data stays plain: it runs as a GEMM over im2col columns
        (`kernels/nn.py:im2col_conv`, vectorized along positions) and no reader of its output
        could take it blocked (a graph output, a GroupNorm): blocked, its output would only be
        unblocked again, a pass over it that can cost more than the conv."""
        x, w = self.graph.types[node.inputs[0]], self.graph.types[node.inputs[1]]
        if not im2col_conv(x.shape, w.shape, node.attr("group", 1), x.dtype):
            return False
        return not self._read_blocked_downstream(node.outputs[0])

    def _window_plain(self, node: Node) -> bool:
        """Whether a depthwise 2-D conv of plain data stays plain: few enough taps for its
        stride (`PLAIN_DEPTHWISE_MAX_TAPS`: up to 5x5 at stride 1, 3x3 at stride 2), and no
        reader down its elementwise chain could take its output blocked (a graph output, a
        permute to channels-last). It then runs as rows of pixel vectors
        (`schedules.depthwise_window_schedule`) where, blocked, it would pay a transform on
        each side."""
        x, w = self.graph.types[node.inputs[0]], self.graph.types[node.inputs[1]]
        group = node.attr("group", 1)
        if x.rank != 4 or not group == x.shape[1] == w.shape[0]:
            return False
        _, strides, _ = spatial_params(node, 2)
        most = PLAIN_DEPTHWISE_MAX_TAPS.get(strides[0], 0) if strides[0] == strides[1] else 0
        if w.shape[2] * w.shape[3] > most:
            return False
        return not self._read_blocked_downstream(node.outputs[0])

    def _read_blocked_downstream(self, value: str) -> bool:
        """Whether a reader of `value` could take it blocked: a conv, pool, spatial reduction
        or Concat, directly or behind elementwise ops (which carry a block but gain nothing
        from it). Each value is looked at once (elementwise chains may branch and rejoin)."""
        pending, seen = [value], {value}
        while pending:
            for reader in self.readers.get(pending.pop(), []):
                if not _may_read_blocked(reader):
                    continue
                if OP_TABLE[reader.op].kind > OpKind.BROADCAST:
                    return True  # a layout op
                fresh = [v for v in reader.outputs if v and v not in seen]
                seen.update(fresh)
                pending.extend(fresh)
        return False

    def _data_inputs(self, node: Node) -> list[str]:
        return [v for v in node.inputs if v and self.graph.types[v].size != 1]

    def _carried_block(self, node: Node) -> int:
        """The block an elementwise op keeps: that of its first blocked operand, when every
        other operand is a scalar, a tensor of the same shape or one that broadcasts along
        batch or spatial axes only (a squeeze-excitation's [N, C, 1, 1] scale, a per-channel
        constant of the same rank): blocked, they broadcast the same (0: stay plain)."""
        if OP_TABLE[node.op].kind > OpKind.BROADCAST or len(node.outputs) != 1:
            return 0
        shape = self.graph.types[node.outputs[0]].shape
        data = self._data_inputs(node)
        if len(shape) - 2 not in SPATIAL:
            return 0
        if not all(_channels_aligned(self._operand_shape(v, len(shape)), shape) for v in data):
            return 0
        block = next((self._block_available(v) for v in data if v in self.blocked), 0)
        if block and shape[1] % block and node.op not in PADDING_SAFE:
            return 0
        return block

    def _operand_shape(self, value: str, rank: int) -> tuple[int, ...]:
        """An operand's shape as it broadcasts against a result of `rank`: a constant of
        lower rank lines up with the result's trailing axes (the [C, 1, 1] scale that Caffe's
        exporters give a batch norm or Scale layer); other values as they are."""
        shape = self.graph.types[value].shape
        if value in self.graph.constants and len(shape) < rank:
            return (1,) * (rank - len(shape)) + shape
        return shape

    def _full_rank(self, value: str, rank: int) -> str:
        """`value`, or for a constant of lower rank its copy reshaped to `rank` (leading 1s),
        which blocks as any constant of the result's rank does."""
        shape = self._operand_shape(value, rank)
        if shape == self.graph.types[value].shape:
            return value
        if (value, rank) not in self.full_rank:
            name = self.fresh.unique(f"{value}_rank{rank}")
            self.constants[name] = self.graph.constants[value].reshape(shape)
            self.types[name] = TensorType(shape, self.types[value].dtype)
            self.full_rank[value, rank] = name
        return self.full_rank[value, rank]

    def _pool_block(self, node: Node) -> int:
        """Max and average pooling over the spatial axes run in the block of their blocked input
        (MaxPool's Indices output, which counts plain positions, keeps a pool plain)."""
        if node.op not in POOLS or any(node.outputs[1:]):
            return 0
        return self._block_available(node.inputs[0])

    def _reduce_block(self, node: Node) -> int:
        """A reduction over spatial axes that keeps them (GlobalAveragePool, the pooling of a
        squeeze-excitation) reduces the same axes of blocked data: the result is the blocked
        form of the plain one."""
        if node.op not in SPATIAL_REDUCTIONS or node.inputs[0] not in self.blocked:
            return 0
        axes = reduce_axes(node, self.graph.types[node.inputs[0]].rank)
        if not node.attr("keepdims", 1) or min(axes) < 2:
            return 0
        return self._block_available(node.inputs[0])

    def _concat_block(self, node: Node) -> int:
        """A Concat along channels keeps the block of its first blocked operand when every
        operand's channels fill whole blocks: joining NCHW[b]c tensors on their channel-block
        axis is the same concatenation (U-Net skips, DenseNet and Inception joins)."""
        if node.op != "Concat" or not any(v in self.blocked for v in node.inputs):
            return 0
        shape = self.graph.types[node.outputs[0]].shape
        axis = node.attr("axis")
        if len(shape) != 4 or axis % 4 != 1:
            return 0
        block = next(self._block_available(v) for v in node.inputs if v in self.blocked)
        if any(self.graph.types[v].shape[1] % block for v in node.inputs):
            return 0
        return block

    def _blocked_elementwise(self, node: Node, block: int) -> None:
        data, rank = set(self._data_inputs(node)), self.types[node.outputs[0]].rank
        inputs = tuple(
            self.as_blocked(self._full_rank(v, rank), block) if v in data else v
            for v in node.inputs
        )
        self._produce_blocked(node, inputs, block)


def _may_read_blocked(node: Node) -> bool:
    """Whether the pass may give `node` blocked data: a conv, a pool, a spatial reduction, a
    Concat or an elementwise op (which carries its operand's block)."""
    layout_ops = ("Conv", "Concat", *POOLS, *SPATIAL_REDUCTIONS)
    return node.op in layout_ops or OP_TABLE[node.op].kind <= OpKind.BROADCAST


def _channels_aligned(operand: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Whether an operand of an elementwise op with output `shape` has its channels and
    broadcasts along the other axes only."""
    if len(operand) != len(shape) or operand[1] != shape[1]:
        return False
    return all(d in (1, full) for d, full in zip(operand, shape, strict=True))


def _winograd(graph: Graph, node: Node) -> bool:
    """Whether the conv's kernel may run as Winograd (`kernels/winograd.py`), untuned or
    tuned."""
    w = graph.types[node.inputs[1]].shape
    pads, strides, dilations = spatial_params(node, len(w) - 2)
    group = node.attr("group", 1)
    algorithms = spatial_algorithms(w[2:], strides, dilations, pads, group, w[1], w[0])
    return len(algorithms) > 1


def _conv_block(
    graph: Graph, node: Node, blocks: tuple[int, ...], fma_lanes: int, data_blocked=False
) -> int:
    """The channel block an eligible Conv writes (0: not eligible). A conv of blocked data is
    blocked whatever its output channels (a segmentation head's 2 classes): padded to a block,
    the fast kernel and a crop beat a plain conv behind a transform of its input."""
    if node.op != "Conv" or node.attr("out_layout", PLAIN) != PLAIN:
        return 0
    x, w = graph.types[node.inputs[0]], graph.types[node.inputs[1]]
    if x.rank - 2 not in SPATIAL or x.dtype != "float32" or node.inputs[1] not in graph.constants:
        return 0
    group, out_channels = node.attr("group", 1), w.shape[0]
    if group == 1 or group == x.shape[1] == out_channels:
        if out_channels < MIN_BLOCKED_CHANNELS and not (data_blocked and group == 1):
            return 0
        # The fewest FMA cycles; the larger block on a tie (`blocks` runs largest first).
        return min(blocks, key=lambda b: block_cost(out_channels, b, fma_lanes))
    # Grouped: every channel block lies inside one group, on the input side and the output;
    in_per_group, out_per_group = w.shape[1], out_channels // group
    inside = next((b for b in blocks if in_per_group % b == 0 and out_per_group % b == 0), 0)
    if inside and inside < min(blocks[0], fma_lanes) and is_pointwise(node, graph.types):
        return 0  # half a vector a block: a MatMul over its pixels (`pointwise_matmul`)
    if inside or in_per_group != out_per_group:
        return inside
    # or, for groups smaller than a block (ResNeXt's 4 channels per group), a block holds whole
    # groups, input and output alike, and its filters are block-diagonal: the smallest block
    # wastes least on the zeros between groups.
    return next((b for b in reversed(blocks) if b % in_per_group == 0 and out_channels % b == 0), 0)


def run(graph: Graph, lanes: int = 16, fma_lanes: int = 8) -> Graph:
    """Block the graph's conv chains for a target with `lanes` float32 lanes per vector, of
    which its FMAs handle `fma_lanes` at the full rate (`Target.fma_lanes`)."""
    blocks = block_sizes(lanes)
    if not any(_conv_block(graph, node, blocks, fma_lanes) for node in graph.nodes):
        return graph  # no chain starts
    rewriter = _Rewriter(graph, blocks, fma_lanes)
    for node in graph.nodes:
        rewriter.visit(node)
    for value in graph.outputs:
        if value in rewriter.blocked:
            rewriter.as_plain(value)
    # A constant whose readers all take its blocked twin is dropped (stored once).
    used = {v for node in rewriter.nodes for v in node.inputs} | set(graph.outputs)
    constants = {k: v for k, v in rewriter.constants.items() if k in used}
    dropped = set(rewriter.constants) - set(constants)
    types = {
        k: v for k, v in rewriter.types.items() if isinstance(v, TensorType) and k not in dropped
    }
    return graph.replace(nodes=tuple(rewriter.nodes), types=types, constants=constants)
