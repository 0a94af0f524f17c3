"""Attention as the operators it is made of: two batched MatMuls around a row Softmax.

The Attention operator's own kernel (`kernels/transformer.py`) computes every stage as a
generic loop nest (0.3 GFLOP/s for 12 heads of 256 x 64), while its parts have fast kernels
of their own: the batched-GEMM template for Q K^T and P V, the row-softmax kernel, and
elementwise stages that fuse into the first GEMM's epilogue. So an Attention that needs none
of what only the kernel does (key lengths per batch, the qk_matmul output, a softmax in
another precision, a mask shorter than the keys, bfloat16) is spelled out here in the order
the spec computes it:

    [3-D: split heads]  [KV cache: K = Concat(past K, K), V likewise: the present outputs]
    [float16: cast to float32]  Q * sqrt(scale), K * sqrt(scale)  [GQA: repeat K, V heads]
    S = Q K^T   [softcap: c * tanh(S / c)]   [float mask: S + M]
    S = Where(allowed, S, -inf)   (is_causal and the windows from position past + i, and a
                                   boolean mask, as one operand)
    Y = Softmax(S) V   [3-D: merge heads]  [float16: cast back]

A row with no allowed key gives zero probabilities (the spec's convention, and the kernel's):
the Softmax is told so (`zero_empty_rows`) wherever a row may be empty: a mask known only at
run time, or constant masks that leave a row empty.
"""

from __future__ import annotations

import numpy as np

from compiler_core.graph.ir import Graph, Node, TensorType
from compiler_core.graph.ops import OP_TABLE
from compiler_core.passes.rewrite import Decomposition

NAME = "decompose_attention"
FLOATS = ("float32", "float64")
# Computed in float32 as the kernel does. bfloat16 keeps the operator: the reference executor
# rounds its every step to bfloat16, as the ONNX reference does and the node suite checks.
HALVES = ("float16",)


class _Rewriter(Decomposition):
    def takes(self, node: Node) -> bool:
        return _eligible(self.graph, node)

    def emit(self, op: str, name: str, inputs, output: str | None = None, **attrs) -> str:
        """One node, its output type inferred by the operator's own rule."""
        output = output or self.fresh(f"{name}_out")
        node = Node(op, self.fresh(name), tuple(inputs), (output,), attrs)
        (self.types[output],) = OP_TABLE[op].infer(node, [self.types[i] for i in inputs])[:1]
        self.nodes.append(node)
        return output

    def decompose(self, node: Node) -> None:
        name, dtype = node.name, self.types[node.inputs[0]].dtype
        q = self.heads(node.inputs[0], node.attr("q_num_heads", None), f"{name}_q")
        k = self.heads(node.inputs[1], node.attr("kv_num_heads", None), f"{name}_k")
        v = self.heads(node.inputs[2], node.attr("kv_num_heads", None), f"{name}_v")
        k, v = self.cached(node, k, v)
        if dtype not in FLOATS:  # half precision: computed in float32, as the kernel does
            q, k, v = (self.emit("Cast", f"{name}_wide", [x], to="float32") for x in (q, k, v))
        batch, q_heads, q_len, _ = self.types[q].shape
        kv_heads = self.types[k].shape[1]
        if q_heads != kv_heads:
            k, v = (self.repeat_heads(x, q_heads // kv_heads, name) for x in (k, v))
        scores, may_be_empty = self.masked(node, self.scores(node, q, k))
        probabilities = self.emit(
            "Softmax", f"{name}_probabilities", [scores], axis=3, zero_empty_rows=may_be_empty
        )
        y = self.emit("MatMul", f"{name}_values", [probabilities, v])
        if self.types[node.inputs[0]].rank == 3:
            v_size = self.types[y].shape[3]
            merged = self.emit("Transpose", f"{name}_merge", [y], perm=(0, 2, 1, 3))
            y = self.emit("Reshape", f"{name}_merge", [merged],
                          shape=(batch, q_len, q_heads * v_size))  # fmt: skip
        if dtype not in FLOATS:
            y = self.emit("Cast", f"{name}_narrow", [y], to=dtype)
        # The last node emitted writes the operator's output under its own name.
        self.nodes[-1] = self.nodes[-1].replace(outputs=(node.outputs[0],))
        self.types[node.outputs[0]] = self.types.pop(y)

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

    def scores(self, node: Node, q: str, k: str) -> str:
        """Q K^T, Q and K each scaled by sqrt(scale) first (the spec's order), soft-capped."""
        name, dtype = node.name, self.types[q].dtype
        scale = node.attr("scale", None)
        scale = 1.0 / np.sqrt(self.types[q].shape[3]) if scale is None else scale
        root = self.constant(np.asarray(np.sqrt(scale), dtype), f"{name}_root_scale")
        keys = self.emit("Mul", name, [k, root])
        keys = self.emit("Transpose", f"{name}_keys", [keys], perm=(0, 1, 3, 2))
        scores = self.emit("MatMul", f"{name}_scores", [self.emit("Mul", name, [q, root]), keys])
        softcap = node.attr("softcap", 0.0)
        if softcap <= 0:
            return scores
        inverse = self.constant(np.asarray(1.0 / softcap, dtype), f"{name}_inverse_cap")
        capped = self.emit("Tanh", name, [self.emit("Mul", name, [scores, inverse])])
        cap = self.constant(np.asarray(softcap, dtype), f"{name}_cap")
        return self.emit("Mul", f"{name}_capped", [capped, cap])

    def masked(self, node: Node, scores: str) -> tuple[str, int]:
        """The scores with the float mask added and every disallowed key at -inf (is_causal,
        the windows and a boolean mask in one Where); and whether a row may be left with no
        key (1: a mask known only at run time, or constant masks that empty a row)."""
        name, (_, _, q_len, k_len) = node.name, self.types[scores].shape
        mask = node.inputs[3] if len(node.inputs) > 3 else ""
        is_bool = bool(mask) and self.types[mask].dtype == "bool"
        if mask and not is_bool:
            bias = mask
            if self.types[mask].dtype != self.types[scores].dtype:  # a float16 mask
                bias = self.emit("Cast", f"{name}_bias", [mask], to=self.types[scores].dtype)
            scores = self.emit("Add", f"{name}_biased", [scores, bias])
        allowed = _allowed_positions(node, q_len, k_len, _past_length(self.types, node))
        keep = mask if is_bool else ""
        if not allowed.all():
            constant = self.constant(allowed, f"{name}_allowed")
            keep = self.emit("And", f"{name}_keep", [mask, constant]) if keep else constant
        if keep:
            minus_inf = self.constant(np.asarray(-np.inf, self.types[scores].dtype), name)
            scores = self.emit("Where", f"{name}_masked", [keep, scores, minus_inf])
        return scores, int(bool(mask) or not allowed.any(axis=1).all())

    def heads(self, value: str, heads: int | None, name: str) -> str:
        """[B, S, H * D] split into [B, H, S, D]; a 4-D operand as it is."""
        t = self.types[value]
        if t.rank == 4:
            return value
        batch, length, width = t.shape
        split = self.emit("Reshape", name, [value], shape=(batch, length, heads, width // heads))
        return self.emit("Transpose", name, [split], perm=(0, 2, 1, 3))

    def repeat_heads(self, value: str, group: int, name: str) -> str:
        """[B, H, S, D] -> [B, H * group, S, D], each head repeated `group` times in place (query
        head h reads key/value head h // group)."""
        batch, heads, length, size = self.types[value].shape
        lifted = self.emit("Reshape", name, [value], shape=(batch, heads, 1, length, size))
        wide = self.emit("Expand", name, [lifted], shape=(batch, heads, group, length, size))
        return self.emit("Reshape", name, [wide], shape=(batch, heads * group, length, size))


def _allowed_positions(node: Node, q_len: int, k_len: int, past: int) -> np.ndarray:
    """[q_len, k_len] booleans: which keys each query may attend under `is_causal` and the
    windows; query i sits at position past + i (after a KV cache of `past` keys)."""
    rows, cols = np.arange(q_len)[:, None] + past, np.arange(k_len)[None, :]
    allowed = np.ones((q_len, k_len), bool)
    if node.attr("is_causal", 0):
        allowed &= cols <= rows
    left, right = node.attr("left_window_size", -1), node.attr("right_window_size", -1)
    if left >= 0:
        allowed &= cols >= rows - left
    if right >= 0:
        allowed &= cols <= rows + right
    return allowed


def _eligible(graph: Graph, node: Node) -> bool:
    """An Attention without what only its kernel does: key lengths per batch
    (nonpad_kv_seqlen), the qk_matmul output, half of a KV cache, a softmax in another
    precision than the one it computes in, or a mask shorter than the keys (padded inside
    the kernel)."""
    if node.op != "Attention" or (len(node.outputs) > 3 and node.outputs[3]):
        return False
    inputs = [*node.inputs, "", "", "", ""]
    if inputs[6] or bool(inputs[4]) != bool(inputs[5]):
        return False
    q: TensorType = graph.types[node.inputs[0]]
    computed = q.dtype if q.dtype in FLOATS else "float32"
    if q.dtype not in (*FLOATS, *HALVES) or node.attr("softmax_precision", computed) != computed:
        return False
    mask = inputs[3]
    if not mask:
        return True
    # The keys after the cache: the operator's present_key type says how many.
    present_key = OP_TABLE["Attention"].infer(node, [graph.types.get(i) for i in node.inputs])[1]
    return graph.types[mask].shape[-1] == present_key.shape[2]


def _past_length(types, node: Node) -> int:
    past = node.inputs[4] if len(node.inputs) > 4 else ""
    return types[past].shape[2] if past else 0


def run(graph: Graph) -> Graph:
    return _Rewriter(graph).run()
