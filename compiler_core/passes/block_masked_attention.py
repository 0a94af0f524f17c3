"""Exported attention under a constant mask, in blocks of queries.

The ONNX Attention operator is computed in blocks of queries where is_causal, a window or a
constant mask leaves keys out (`decompose_attention`). Models exported before it spell
attention out instead, with the mask a constant after fold_constants (torch's GPT-2 slices a
causal buffer and puts the dtype's lowest value where it disallows a key):

    S = MatMul(A, B)   [* or / a constant scalar]
    M = Where(mask, S, lowest)        mask: constant booleans, one [queries, keys] pattern
    P = Softmax(M, axis=-1)
    Y = MatMul(P, V)

Each intermediate read once. Here that chain is computed in the same blocks of queries
(`decompose_attention.query_blocks`): each block's rows of A against the keys its rows may
attend (B's columns, V's rows, the mask's block), the blocks' outputs concatenated along the
queries. Exact where every query attends some key: a disallowed score is `lowest` (-inf, or
a finite value whose exp(lowest - max) is 0 for any finite max), so the keys a block skips
added nothing but zeros; a row with no allowed key (a uniform row with a finite `lowest`)
keeps the chain whole.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from compiler_core.graph.ir import Graph, Node
from compiler_core.passes.decompose_attention import query_blocks
from compiler_core.passes.rewrite import Decomposition

NAME = "block_masked_attention"
# A disallowed score at or below this (torch writes finfo(float32).min) adds exp(lowest - max)
# = 0 to its row's sum, as -inf would, wherever the row's max is an allowed, finite score: exp
# is 0 in float32 below about -104.
LOWEST = -1e30
SCALES = ("Mul", "Div")


@dataclasses.dataclass(frozen=True)
class _Chain:
    """One matched attention: its nodes in order, operands and the mask as booleans."""

    scores: Node  # MatMul(A, B)
    scale: Node | None  # Mul / Div by a constant scalar
    masked: Node  # Where(mask, S, lowest)
    softmax: Node
    values: Node  # MatMul(P, V)
    allowed: np.ndarray  # [queries, keys]


class _Rewriter(Decomposition):
    """Takes each blocked chain's nodes: its last MatMul becomes the blocks, the others go."""

    def __init__(self, graph: Graph):
        super().__init__(graph)
        matched = [c for c in map(self.match, graph.nodes) if c is not None]
        self.chains = {
            chain.values.name: (chain, blocks)
            for chain in matched
            if (blocks := query_blocks(chain.allowed)) is not None
        }
        self.replaced = {
            node.name
            for chain, _ in self.chains.values()
            for node in (chain.scores, chain.scale, chain.masked, chain.softmax)
            if node is not None
        }

    def takes(self, node: Node) -> bool:
        return node.name in self.chains or node.name in self.replaced

    def decompose(self, node: Node) -> None:
        if node.name in self.chains:
            self.blocked(*self.chains[node.name])

    # --- matching ------------------------------------------------------------------------

    def match(self, softmax: Node) -> _Chain | None:
        """The chain around `softmax`, or None where it is not one (see the module doc)."""
        if softmax.op != "Softmax" or not self.single_consumer(softmax.outputs[0]):
            return None
        rank = self.types[softmax.inputs[0]].rank
        if rank < 2 or softmax.attr("axis", -1) % rank != rank - 1:
            return None
        (values,) = self.graph.consumers[softmax.outputs[0]]
        if values.op != "MatMul" or values.inputs[0] != softmax.outputs[0]:
            return None
        masked = self.producer(softmax.inputs[0])
        if masked is None or masked.op != "Where" or not self.single_consumer(masked.outputs[0]):
            return None
        condition, scores_value, lowest = masked.inputs
        allowed = self.pattern(condition, self.types[softmax.inputs[0]].shape)
        if allowed is None or not self.is_lowest(lowest):
            return None
        scale, scores = None, self.producer(scores_value)
        if scores is not None and scores.op in SCALES and self.is_scalar(scores.inputs[1]):
            if not self.single_consumer(scores.outputs[0]):
                return None
            scale, scores = scores, self.producer(scores.inputs[0])
        if scores is None or scores.op != "MatMul" or not self.single_consumer(scores.outputs[0]):
            return None
        if self.types[scores.outputs[0]].shape != self.types[softmax.inputs[0]].shape:
            return None  # the Where broadcast the scores: not one score per mask entry
        return _Chain(scores, scale, masked, softmax, values, allowed)

    def producer(self, value: str) -> Node | None:
        return self.graph.producers.get(value)

    def pattern(self, condition: str, shape) -> np.ndarray | None:
        """A constant boolean condition as one [queries, keys] pattern for every leading
        index of the scores `shape`; None otherwise."""
        if condition not in self.constants:
            return None
        mask = np.asarray(self.constants[condition])
        if mask.dtype != bool or any(d != 1 for d in mask.shape[:-2]):
            return None
        return np.broadcast_to(mask.reshape(mask.shape[-2:]), shape[-2:])

    def is_lowest(self, value: str) -> bool:
        if value not in self.constants:
            return False
        lowest = np.asarray(self.constants[value])
        floating = np.issubdtype(lowest.dtype, np.floating)
        return lowest.size == 1 and floating and float(lowest.reshape(())) <= LOWEST

    def is_scalar(self, value: str) -> bool:
        return value in self.constants and np.asarray(self.constants[value]).size == 1

    # --- rewriting -----------------------------------------------------------------------

    def sliced(self, value: str, axis: int, start: int, stop: int, name: str) -> str:
        """`value` from start to stop along `axis` (negative: from the end), where that is
        less than all of it and the axis is not broadcast (size 1)."""
        size = self.types[value].shape[axis]
        if size == 1 or (start == 0 and stop == size):
            return value
        return self.emit("Slice", name, [value], starts=(start,), ends=(stop,), axes=(axis,))

    def blocked(self, chain: _Chain, blocks) -> None:
        """The chain's output from its blocks of queries, concatenated."""
        a, b = chain.scores.inputs
        v = chain.values.inputs[1]
        lowest = chain.masked.inputs[2]
        name = chain.softmax.name
        parts = []
        for start, stop, first, end in blocks:
            rows = self.sliced(a, -2, start, stop, f"{name}_block")
            keys = self.sliced(b, -1, first, end, f"{name}_keys")
            scores = self.emit("MatMul", f"{name}_scores", [rows, keys])
            if chain.scale is not None:
                scores = self.emit(chain.scale.op, f"{name}_scale", [scores, chain.scale.inputs[1]])
            block = np.ascontiguousarray(chain.allowed[start:stop, first:end])
            condition = self.constant(block, f"{name}_allowed")
            masked = self.emit("Where", f"{name}_masked", [condition, scores, lowest])
            axis = chain.softmax.attr("axis", -1)
            probabilities = self.emit("Softmax", name, [masked], axis=axis)
            values = self.sliced(v, -2, first, end, f"{name}_values")
            parts.append(self.emit("MatMul", f"{name}_values", [probabilities, values]))
        self.emit("Concat", f"{name}_blocks", parts, chain.values.outputs[0], axis=-2)


def run(graph: Graph) -> Graph:
    return _Rewriter(graph).run()
