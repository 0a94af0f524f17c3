"""Attention as the operators it is made of: two batched MatMuls around a row Softmax.

Attention has no kernel of its own: its parts have fast ones (the batched-GEMM template for
Q K^T and P V, the row-softmax kernel, elementwise stages that fuse into the first GEMM's
epilogue), where the fused kernel it had computed every stage as a generic loop nest (0.3
GFLOP/s for 12 heads of 256 x 64, 430 times slower); on CPU targets `fuse_attention` later
joins the two GEMMs and the softmax into one kernel again, on those fast templates. So every
Attention is spelled out here in the order the spec computes it:

    [3-D: split heads]  [KV cache: K = Concat(past K, K), V likewise: the present outputs]
    [16-bit floats: cast to float32]  (the scale on whichever of Q and K is transposed)
    [GQA: each K/V head's query heads stacked as rows: Q [B, kv heads, group x q_len, D]]
    S = Q K^T (few query rows: (K Q^T)^T)   [softcap: c * tanh(S / c)]   [float mask: S + M]
    S = Where(allowed, S, -inf)   (is_causal and the windows from position past + i, a
                                   boolean mask, and the keys past each batch's
                                   nonpad_kv_seqlen, as one operand)
    P = Softmax(S)  [softmax_precision: in that type]
    Y = P V   [3-D: merge heads]  [16-bit floats: cast back]
    [qk_matmul_output: the stage its mode names (S raw, soft-capped, masked; P)]

A row with no allowed key gives zero probabilities (the spec's convention): the Softmax is
told so (`zero_empty_rows`) wherever a row may be empty: a mask or key lengths known only at
run time, or constant masks that leave a row empty. With key lengths per batch (an external
cache, `nonpad_kv_seqlen`), query i of batch b sits at position nonpad[b] - q_len + i, so the
causal and window bounds are compared at run time.

A mask shorter than the keys is padded to them (the keys past it disallowed).

A causal or windowed Attention of many queries (no run-time mask or key lengths, no qk output)
is computed in blocks of queries, each block from S = Q K^T to P V over only the keys its
queries may attend (from the first any of them may to the last), the blocks' outputs
concatenated: the keys a block skips are disallowed to all its rows, so it leaves out exactly
the zeros they added (in 4 blocks, 256 causal queries compute 5/8 of the scores: 12 heads of
64 0.58 -> 0.43 ms, 32 grouped-query heads on 8 of 128 2.87 -> 1.79 ms, Zen 5, 2 threads).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from compiler_core.graph.ir import Graph, Node
from compiler_core.passes.rewrite import Decomposition

NAME = "decompose_attention"
# Computed in their own type; 16-bit floats in float32, rounded once. The ONNX reference
# rounds every step of a bfloat16 Attention instead, and the node suite's five bfloat16 cases
# expect that rounding at rtol 1e-3, below one bfloat16 step: they fail here (on both
# engines), though rounded once is twice as close to the exact result
# (test_attention_4d_causal_bf16 against float64: largest error 1.95e-3, the expected
# output's 4.35e-3).
FLOATS = ("float32", "float64")
# qk_matmul_output_mode -> the stage it exposes (the operator's reference, graph/ops/transformer.py)
QK_STAGES = ("raw", "capped", "masked", "probabilities")


class _Rewriter(Decomposition):
    def takes(self, node: Node) -> bool:
        # Every Attention: the type rule has refused what the spec does not allow.
        return node.op == "Attention"

    def decompose(self, node: Node) -> None:
        name, dtype = node.name, self.types[node.inputs[0]].dtype
        q = self.heads(node.inputs[0], node.attr("q_num_heads", None), f"{name}_q")
        k = self.heads(node.inputs[1], node.attr("kv_num_heads", None), f"{name}_k")
        v = self.heads(node.inputs[2], node.attr("kv_num_heads", None), f"{name}_v")
        k, v = self.cached(node, k, v)
        if dtype not in FLOATS:  # 16-bit floats: computed in float32, rounded once
            q, k, v = (self.emit("Cast", f"{name}_wide", [x], to="float32") for x in (q, k, v))
        batch, q_heads, q_len, _ = self.types[q].shape
        k_len = self.types[k].shape[2]
        allowed = _allowed_positions(node, q_len, k_len, _past_length(self.types, node))
        mask = node.inputs[3] if len(node.inputs) > 3 else ""
        constant = self.constant_mask(mask, q_len, k_len) if mask else None
        if constant is not None:  # a constant causal (or other) pattern: known keys to skip
            allowed, mask = allowed & constant, ""
        blocks = _query_blocks(node, allowed, mask)
        if blocks is None:
            y = self.attend(node, q, k, v, allowed, mask)
        else:  # causal or windowed: each block of queries reads only the keys it may attend
            parts = []
            for start, stop, first, end in blocks:
                rows = self.sliced(q, start, stop, f"{name}_block")
                keys, values = (self.sliced(x, first, end, f"{name}_reach") for x in (k, v))
                block = allowed[start:stop, first:end]
                parts.append(self.attend(node, rows, keys, values, block, mask))
            y = self.emit("Concat", f"{name}_blocks", parts, axis=2)
        if self.types[node.inputs[0]].rank == 3:
            v_size = self.types[y].shape[3]
            merged = self.emit("Transpose", f"{name}_merge", [y], perm=(0, 2, 1, 3))
            y = self.emit("Reshape", f"{name}_merge", [merged],
                          shape=(batch, q_len, q_heads * v_size))  # fmt: skip
        if dtype not in FLOATS:
            y = self.emit("Cast", f"{name}_narrow", [y], to=dtype)
        # The operator's output under its own name (eliminate_identity renames y's producer).
        self.emit("Identity", f"{name}_y", [y], node.outputs[0])

    def attend(self, node: Node, q: str, k: str, v: str, allowed: np.ndarray, mask: str) -> str:
        """[B, q heads, rows, Dv]: q's rows attending k and v, `allowed` ([rows, keys]) saying
        which keys is_causal, the windows and a constant mask let each row see, `mask` the
        mask input known only at run time ("": none); every stage of the spec but the heads'
        split and merge."""
        name = node.name
        batch, q_heads, q_len, head_size = self.types[q].shape
        kv_heads = self.types[k].shape[1]
        fold = _Fold(q_heads, kv_heads, q_len)
        if fold.group > 1:  # GQA: each K/V head's queries as one GEMM's rows
            q = self.emit("Reshape", f"{name}_group", [q],
                          shape=(batch, kv_heads, fold.rows, head_size))  # fmt: skip
        stages = self.scores(node, q, k)
        stages["masked"], may_be_empty = self.masked(node, stages["capped"], fold, allowed, mask)
        stages["probabilities"] = self.softmax(node, stages["masked"], may_be_empty)
        self.qk_output(node, stages, self.types[node.inputs[0]].dtype, fold)
        y = self.emit("MatMul", f"{name}_values", [stages["probabilities"], v])
        return self.unfolded(y, fold, f"{name}_ungroup")

    def sliced(self, value: str, start: int, stop: int, name: str) -> str:
        """`value`'s rows (axis 2) start..stop; `value` itself where that is all of them."""
        if start == 0 and stop == self.types[value].shape[2]:
            return value
        return self.emit("Slice", name, [value], starts=(start,), ends=(stop,), axes=(2,))

    def cached(self, node: Node, k: str, v: str) -> tuple[str, str]:
        """K and V after the cache: the past ones followed by the new (the present outputs,
        where asked for; without a cache, the new ones)."""
        inputs, outputs = node.inputs, node.outputs
        pasts = inputs[4:6] if len(inputs) > 5 and inputs[4] else ("", "")
        presents = [outputs[i] if len(outputs) > i and outputs[i] else "" for i in (1, 2)]
        result = []
        for new, past, present in zip((k, v), pasts, presents, strict=True):
            if past:
                new = self.emit("Concat", f"{node.name}_cache", [past, new], present or None,
                                axis=2)  # fmt: skip
            elif present:
                self.emit("Identity", f"{node.name}_present", [new], present)
            result.append(new)
        return result[0], result[1]

    def scores(self, node: Node, q: str, k: str) -> dict[str, str]:
        """{"raw": Q K^T scaled, "capped": soft-capped (the raw scores without a softcap)}.

        The spec scales Q and K by sqrt(scale) each, so that 16-bit products stay in range;
        computed in float32 or float64 (16-bit inputs are cast first), one operand takes the
        whole scale: the one transposed first, in the same kernel (a copy bound by memory,
        so the multiply costs nothing and Q needs no kernel of its own).

        The GEMM template reads B as [K, N], so one operand is transposed first, a kernel of
        its own: K (keys x head size values), or, as S^T = K Q^T, Q and then S^T (rows x
        (head size + keys)), whichever moves fewer values. A decode step's few rows take the
        second (32 heads on 8 of 1024 keys: the key transpose was 0.136 of 0.27 ms), and never
        multiply the cached keys."""
        name, dtype = node.name, self.types[q].dtype
        _, _, rows, size = self.types[q].shape
        keys = self.types[k].shape[2]
        scale = node.attr("scale", None)
        scale = 1.0 / np.sqrt(size) if scale is None else scale
        factor = self.constant(np.asarray(scale, dtype), f"{name}_scale")
        if rows * (size + keys) < keys * size:
            queries = self.emit("Transpose", f"{name}_queries", [q], perm=(0, 1, 3, 2))
            queries = self.emit("Mul", name, [queries, factor])
            flipped = self.emit("MatMul", f"{name}_scores", [k, queries])
            scores = self.emit("Transpose", f"{name}_scores", [flipped], perm=(0, 1, 3, 2))
        else:
            transposed = self.emit("Transpose", f"{name}_keys", [k], perm=(0, 1, 3, 2))
            transposed = self.emit("Mul", f"{name}_keys", [transposed, factor])
            scores = self.emit("MatMul", f"{name}_scores", [q, transposed])
        softcap = node.attr("softcap", 0.0)
        if softcap <= 0:
            return {"raw": scores, "capped": scores}
        inverse = self.constant(np.asarray(1.0 / softcap, dtype), f"{name}_inverse_cap")
        capped = self.emit("Tanh", name, [self.emit("Mul", name, [scores, inverse])])
        cap = self.constant(np.asarray(softcap, dtype), f"{name}_cap")
        return {"raw": scores, "capped": self.emit("Mul", f"{name}_capped", [capped, cap])}

    def softmax(self, node: Node, scores: str, may_be_empty: int) -> str:
        """The probabilities, in `softmax_precision` where it differs from the scores' type."""
        name, computed = node.name, self.types[scores].dtype
        precision = node.attr("softmax_precision", computed)
        if precision != computed:
            scores = self.emit("Cast", f"{name}_softmax_in", [scores], to=precision)
        probabilities = self.emit(
            "Softmax", f"{name}_probabilities", [scores], axis=3, zero_empty_rows=may_be_empty
        )
        if precision != computed:
            probabilities = self.emit("Cast", f"{name}_softmax_out", [probabilities], to=computed)
        return probabilities

    def qk_output(self, node: Node, stages: dict[str, str], dtype: str, fold: _Fold) -> None:
        """The optional fourth output: the stage `qk_matmul_output_mode` names, in the
        operator's type."""
        output = node.outputs[3] if len(node.outputs) > 3 else ""
        if not output:
            return
        stage = stages[QK_STAGES[node.attr("qk_matmul_output_mode", 0)]]
        stage = self.unfolded(stage, fold, f"{node.name}_qk")
        if self.types[stage].dtype != dtype:
            self.emit("Cast", f"{node.name}_qk", [stage], output, to=dtype)
        else:
            self.emit("Identity", f"{node.name}_qk", [stage], output)

    def unfolded(self, value: str, fold: _Fold, name: str) -> str:
        """[B, kv heads, group x q_len, n] back to [B, q heads, q_len, n]."""
        if fold.group == 1:
            return value
        batch, _, _, width = self.types[value].shape
        return self.emit("Reshape", name, [value], shape=(batch, fold.q_heads, fold.q_len, width))

    def folded(self, value: str, fold: _Fold, name: str) -> str:
        """A mask operand that broadcasts against [B, q heads, q_len, keys], made to broadcast
        against the grouped scores [B, kv heads, group x q_len, keys] (row g x q_len + i is
        query i of head h x group + g)."""
        t = self.types[value]
        if fold.group == 1:
            return value
        shape = (1,) * (4 - t.rank) + t.shape
        batch, heads, rows, keys = shape
        if heads == 1 and rows == 1:
            return value
        if value in self.constants:
            return self.constant(_fold_array(self.constants[value].reshape(shape), fold), name)
        if t.rank < 4:
            value = self.emit("Reshape", name, [value], shape=shape)
        if heads == 1:  # the same rows for every head: repeated for the group's heads
            return self.emit("Tile", name, [value], repeats=(1, 1, fold.group, 1))
        if rows == 1:
            value = self.emit("Expand", name, [value], shape=(batch, heads, fold.q_len, keys))
        return self.emit("Reshape", name, [value], shape=(batch, fold.kv_heads, fold.rows, keys))

    def masked(
        self, node: Node, scores: str, fold: _Fold, allowed: np.ndarray, mask: str
    ) -> tuple[str, int]:
        """The scores with the float `mask` added and every disallowed key at -inf (`allowed`:
        is_causal, the windows and a constant mask; a boolean `mask` and key lengths, in one
        Where), in the grouped rows of `fold`; and whether a row may be left with no key (1:
        a mask or key lengths known only at run time, or constant masks that empty a row)."""
        name, q_len, k_len = node.name, fold.q_len, self.types[scores].shape[3]
        is_bool = bool(mask) and self.types[mask].dtype == "bool"
        if mask and self.types[mask].shape[-1] < k_len:
            mask = self.padded_mask(node, mask, k_len)
        if mask and not is_bool:
            bias = mask
            if self.types[mask].dtype != self.types[scores].dtype:  # a float16 mask
                bias = self.emit("Cast", f"{name}_bias", [mask], to=self.types[scores].dtype)
            scores = self.emit("Add", f"{name}_biased", [scores, self.folded(bias, fold, name)])
        keep = mask if is_bool else ""
        lengths = node.inputs[6] if len(node.inputs) > 6 else ""
        if lengths:
            by_length = self.allowed_by_length(node, lengths, q_len, k_len)
            keep = self.emit("And", f"{name}_keep", [keep, by_length]) if keep else by_length
            may_be_empty = True
        else:
            if not allowed.all():
                constant = self.constant(allowed, f"{name}_allowed")
                keep = self.emit("And", f"{name}_keep", [keep, constant]) if keep else constant
            may_be_empty = bool(mask) or not allowed.any(axis=1).all()
        if keep:
            minus_inf = self.constant(np.asarray(-np.inf, self.types[scores].dtype), name)
            keep = self.folded(keep, fold, f"{name}_keep")
            scores = self.emit("Where", f"{name}_masked", [keep, scores, minus_inf])
        return scores, int(may_be_empty)

    def constant_mask(self, mask: str, q_len: int, k_len: int) -> np.ndarray | None:
        """A constant mask input as [q_len, k_len] booleans (the keys past a short one
        disallowed), where it is the same for every batch and head and only allows or
        disallows: boolean, or float of 0 and -inf (an exported causal mask); None for any
        other mask, which is applied at run time."""
        if mask not in self.constants:
            return None
        array = np.asarray(self.constants[mask])
        if any(d != 1 for d in array.shape[:-2]):
            return None
        array = array.reshape(array.shape[-2:] if array.ndim > 1 else (1, -1))
        if array.dtype != bool:
            if not np.all((array == 0) | (array == -np.inf)):
                return None
            array = array == 0
        keep = np.zeros((q_len, k_len), bool)
        keep[:, : array.shape[1]] = array
        return keep

    def padded_mask(self, node: Node, mask: str, k_len: int) -> str:
        """A mask shorter than the keys (one for the valid keys of a padded cache) padded to
        them: the keys past it are disallowed (False, or -inf)."""
        t = self.types[mask]
        pads = [0] * (2 * t.rank)
        pads[-1] = k_len - t.shape[-1]
        value = False if t.dtype == "bool" else -np.inf
        return self.emit("Pad", f"{node.name}_mask", [mask], pads=tuple(pads), value=value)

    def allowed_by_length(self, node: Node, lengths: str, q_len: int, k_len: int) -> str:
        """[B, 1, q_len, k_len] booleans, computed at run time from the key lengths per batch
        (an external cache: key j of batch b is valid below lengths[b], and query i sits at
        position lengths[b] - q_len + i): the valid keys that `_bounds` allows."""
        name = node.name
        batch = self.types[lengths].shape[0]
        lengths = self.emit("Reshape", f"{name}_lengths", [lengths], shape=(batch, 1, 1, 1))
        columns = self.constant(np.arange(k_len, dtype=np.int64).reshape(1, 1, 1, k_len), name)
        keep = self.emit("Less", f"{name}_valid", [columns, lengths])
        bounds = _bounds(node)
        if not bounds:
            return keep
        first = self.emit("Sub", f"{name}_offset", [lengths, self.constant(np.int64(q_len), name)])
        diagonal = self.constant(_diagonal(q_len, k_len, 0), f"{name}_diagonal")
        for op, shift in bounds:
            bound = first
            if shift:
                bound = self.emit(
                    "Add", f"{name}_bound", [first, self.constant(np.int64(shift), name)]
                )
            allowed = self.emit(op, f"{name}_bounded", [diagonal, bound])
            keep = self.emit("And", f"{name}_keep", [keep, allowed])
        return keep

    def heads(self, value: str, heads: int | None, name: str) -> str:
        """[B, S, H * D] split into [B, H, S, D]; a 4-D operand as it is."""
        t = self.types[value]
        if t.rank == 4:
            return value
        batch, length, width = t.shape
        split = self.emit("Reshape", name, [value], shape=(batch, length, heads, width // heads))
        return self.emit("Transpose", name, [split], perm=(0, 2, 1, 3))


@dataclasses.dataclass(frozen=True)
class _Fold:
    """Grouped-query attention without repeating K and V: the `group` query heads that share
    a K/V head are stacked as the rows of one GEMM per K/V head (Q [B, kv heads, group x
    q_len, D]), which reads each K/V head once instead of materializing `group` copies (GQA
    decode, 32 query heads on 8 of 1024 keys, 128 wide: 2.9 -> 0.29 ms, Zen 4, 2 threads)."""

    q_heads: int
    kv_heads: int
    q_len: int

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads

    @property
    def rows(self) -> int:
        return self.group * self.q_len


def _fold_array(array: np.ndarray, fold: _Fold) -> np.ndarray:
    """`_Rewriter.folded` of a constant [b, h, q, k] array."""
    batch, heads, rows, keys = array.shape
    if heads == 1:
        return np.tile(array, (1, 1, fold.group, 1))
    array = np.broadcast_to(array, (batch, heads, fold.q_len, keys))
    return np.ascontiguousarray(array).reshape(batch, fold.kv_heads, fold.rows, keys)


# How is_causal and the windows bound key j of query i, at position offset + i: through
# j - i compared with offset + shift (the comparison's ONNX op, and its numpy twin).
COMPARISONS = {"LessOrEqual": np.less_equal, "GreaterOrEqual": np.greater_equal}


def _bounds(node: Node) -> list[tuple[str, int]]:
    """[(op, shift)]: key j is allowed to query i at position offset + i where
    (j - i) op (offset + shift) holds for each."""
    bounds = []
    if node.attr("is_causal", 0):
        bounds.append(("LessOrEqual", 0))
    left, right = node.attr("left_window_size", -1), node.attr("right_window_size", -1)
    if left >= 0:
        bounds.append(("GreaterOrEqual", -left))
    if right >= 0:
        bounds.append(("LessOrEqual", right))
    return bounds


def _diagonal(q_len: int, k_len: int, offset: int) -> np.ndarray:
    """[q_len, k_len] int64: j - i - offset, key j's distance from query i at offset + i."""
    return np.arange(k_len, dtype=np.int64)[None, :] - np.arange(q_len)[:, None] - offset


def _allowed_positions(node: Node, q_len: int, k_len: int, past: int) -> np.ndarray:
    """[q_len, k_len] booleans: which keys each query may attend under `is_causal` and the
    windows; query i sits at position past + i (after a KV cache of `past` keys)."""
    allowed = np.ones((q_len, k_len), bool)
    for op, shift in _bounds(node):
        allowed &= COMPARISONS[op](_diagonal(q_len, k_len, past), shift)
    return allowed


# Causal and windowed attention in blocks of queries, each reading only the keys its queries
# may attend (`_query_blocks`): at most this many blocks (each a GEMM, softmax and GEMM of its
# own), of this many rows or more (GEMM rows enough to fill register tiles), where they skip
# this share of the scores or more. 12 heads of 64, Zen 5, 2 threads (`bench.ab`): 256
# queries in 4 blocks of 64 0.74x the whole attention's time, in 8 of 32 1.33x the 4 blocks';
# 1024 queries in 16 blocks of 64 0.95x 8 of 128, in 32 of 32 1.23x.
MAX_QUERY_BLOCKS = 16
MIN_BLOCK_ROWS = 64
MIN_SAVING = 0.2


def _query_blocks(
    node: Node, allowed: np.ndarray, mask: str
) -> list[tuple[int, int, int, int]] | None:
    """[(first row, end row, first key, end key)] of the query blocks a causal or windowed
    Attention is computed in, each block reading the keys from the first one any of its rows
    may attend to the last; or None to compute it whole. Blocks where no run-time `mask`, key
    lengths or qk_matmul_output needs the whole score matrix, every row attends some key, and
    they skip MIN_SAVING of its scores. The keys a block skips are disallowed to all its rows:
    exp(-inf) = 0 is all they added."""
    inputs, outputs = node.inputs, node.outputs
    if mask or (len(inputs) > 6 and inputs[6]) or (len(outputs) > 3 and outputs[3]):
        return None
    return query_blocks(allowed)


def query_blocks(allowed: np.ndarray) -> list[tuple[int, int, int, int]] | None:
    """`_query_blocks` of a [queries, keys] pattern of allowed keys, known to be the only
    mask: None where a row allows no key, too few rows make two blocks, or the blocks would
    skip less than MIN_SAVING of the scores (also `block_masked_attention`'s)."""
    q_len, k_len = allowed.shape
    if not allowed.any(axis=1).all():
        return None
    count = min(MAX_QUERY_BLOCKS, q_len // MIN_BLOCK_ROWS)
    if count < 2:
        return None
    # each row's keys start at its first allowed one and end after its last
    first, end = np.argmax(allowed, axis=1), k_len - np.argmax(allowed[:, ::-1], axis=1)
    edges = [q_len * b // count for b in range(count + 1)]
    blocks = [
        (a, b, int(first[a:b].min()), int(end[a:b].max()))
        for a, b in zip(edges, edges[1:], strict=False)
    ]
    read = sum((b - a) * (stop - start) for a, b, start, stop in blocks)
    return blocks if read <= (1 - MIN_SAVING) * q_len * k_len else None


def _past_length(types, node: Node) -> int:
    past = node.inputs[4] if len(node.inputs) > 4 else ""
    return types[past].shape[2] if past else 0


def run(graph: Graph) -> Graph:
    return _Rewriter(graph).run()
