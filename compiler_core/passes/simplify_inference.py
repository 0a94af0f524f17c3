"""Inference simplification.

- BatchNormalization after a Conv or Gemm with constant weights folds into those weights;
  any other BatchNormalization becomes a constant Mul and Add (which fusion then absorbs).
- Algebraic identities: x*1, x/1, x+0, x-0 (when broadcasting changes nothing). Reshapes and
  Transposes are simplify_views' business.
- GELU as exporters spell it, x * 0.5 * (1 + erf(x / sqrt(2))) in any order of its products,
  becomes one Gelu node: a single-input elementwise op, which the GEMM before it then takes
  as its epilogue (the spelled-out form reads x twice, so it stayed a kernel of its own). So
  does its tanh approximation (GPT-2's and HF's "gelu_new", PyTorch's approximate="tanh"
  before opset 20): x * 0.5 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))), with x^3 as a
  Pow or a product, which becomes Gelu(approximate="tanh").
- A float Pow by a constant 1, 2, 3 or -1 becomes x, x*x, x*x*x or Reciprocal(x): the
  exponent is a weight read at run time, so LLVM calls powf once per lane (RMSNorm's
  `x.pow(2)` as exported ran 16 calls a vector).
"""

from __future__ import annotations

import math

import numpy as np

from compiler_core.graph.ir import Graph, Node
from compiler_core.passes.rewrite import Rewrite, forward_values

NAME = "simplify_inference"
SQRT_HALF = math.sqrt(0.5)
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
GELU_CUBIC = 0.044715


class _Rewriter(Rewrite):
    def __init__(self, graph: Graph):
        super().__init__(graph)
        self.replaced: dict[str, Node] = {}  # node name -> new node (same position)
        self.removed: set[str] = set()
        self.forward: dict[str, str] = {}
        self.after: dict[str, Node] = {}  # node name -> a node inserted right after it

    def value(self, name: str) -> np.ndarray | None:
        return self.constants.get(name) if name else None

    def result(self) -> Graph:
        nodes = []
        for node in self.graph.nodes:
            if node.name in self.removed:
                continue
            nodes.append(self.replaced.get(node.name, node))
            if node.name in self.after:
                nodes.append(self.after[node.name])
        graph = self.graph.replace(nodes=tuple(nodes), constants=self.constants, types=self.types)
        if self.forward:
            graph = forward_values(graph, graph.nodes, self.forward)
        return graph


def _bn_params(rw: _Rewriter, bn: Node):
    params = [rw.value(name) for name in bn.inputs[1:5]]
    if any(p is None for p in params):
        return None
    scale, bias, mean, var = (p.astype(np.float64) for p in params)
    factor = scale / np.sqrt(var + bn.attr("epsilon", 1e-5))
    return factor, bias - mean * factor


def _fold_bn_into_producer(rw: _Rewriter, bn: Node, factor, shift) -> bool:
    producer = rw.graph.producers.get(bn.inputs[0])
    if producer is None or producer.name in rw.replaced or producer.name in rw.removed:
        return False
    if producer.op not in ("Conv", "Gemm") or not rw.single_consumer(bn.inputs[0]):
        return False
    weight = rw.value(producer.inputs[1])
    bias_name = producer.inputs[2] if len(producer.inputs) > 2 else ""
    bias = rw.value(bias_name) if bias_name else None
    if weight is None or (bias_name and bias is None):
        return False
    dtype = weight.dtype
    if producer.op == "Conv":
        new_weight = weight * factor.reshape((-1,) + (1,) * (weight.ndim - 1))
        old_bias = bias if bias is not None else np.zeros(weight.shape[0])
        new_bias = old_bias * factor + shift
        attrs = producer.attrs
    else:
        columns = rw.types[producer.outputs[0]].shape[1]
        if factor.size not in (1, columns):
            return False
        trans_b = producer.attr("transB", 0)
        scale_shape = (-1, 1) if trans_b else (1, -1)
        new_weight = weight * factor.reshape(scale_shape) * producer.attr("alpha", 1.0)
        old_bias = (bias * producer.attr("beta", 1.0)) if bias is not None else 0.0
        new_bias = np.asarray(old_bias * factor + shift)
        if new_bias.ndim == 0:
            new_bias = np.broadcast_to(new_bias, (columns,))
        attrs = dict(producer.attrs) | {"alpha": 1.0, "beta": 1.0}
    weight_name = rw.constant(new_weight.astype(dtype), f"{producer.name}_bn_weight")
    bias_value = np.asarray(new_bias).astype(dtype)
    bias_const = rw.constant(bias_value, f"{producer.name}_bn_bias")
    rw.replaced[producer.name] = producer.replace(
        inputs=(producer.inputs[0], weight_name, bias_const),
        outputs=(bn.outputs[0],),
        attrs=attrs,
    )
    rw.removed.add(bn.name)
    return True


def _decompose_bn(rw: _Rewriter, bn: Node, factor, shift) -> None:
    x_type = rw.types[bn.inputs[0]]
    shape = (-1,) + (1,) * (x_type.rank - 2)
    scale = rw.constant(factor.reshape(shape).astype(x_type.dtype), f"{bn.name}_scale")
    offset = rw.constant(shift.reshape(shape).astype(x_type.dtype), f"{bn.name}_shift")
    scaled = rw.fresh(f"{bn.name}_scaled")
    rw.types[scaled] = x_type
    mul = Node("Mul", rw.fresh(f"{bn.name}_mul"), (bn.inputs[0], scale), (scaled,))
    add = Node("Add", rw.fresh(f"{bn.name}_add"), (scaled, offset), (bn.outputs[0],))
    rw.replaced[bn.name] = mul
    rw.after[bn.name] = add


def _neutral(rw: _Rewriter, node: Node):
    """The input an x*1 / x+0 style node reduces to, or None."""
    if node.op not in ("Add", "Sub", "Mul", "Div") or len(node.inputs) != 2:
        return None
    out_type = rw.types[node.outputs[0]]
    neutral = 1 if node.op in ("Mul", "Div") else 0
    candidates = [(0, 1)] if node.op in ("Sub", "Div") else [(0, 1), (1, 0)]
    for keep, other in candidates:
        value = rw.value(node.inputs[other])
        if value is None or rw.types[node.inputs[keep]] != out_type:
            continue
        if value.size and np.all(value == neutral):
            return node.inputs[keep]
    return None


def _scalar(rw: _Rewriter, value: str, kinds: str = "f") -> float | None:
    """A one-element constant of a dtype kind in `kinds` (float by default), as a float."""
    constant = rw.value(value)
    if constant is None or constant.size != 1 or constant.dtype.kind not in kinds:
        return None
    return float(constant.reshape(()))


def _factors(rw: _Rewriter, value: str, root: bool = False) -> list[str]:
    """The operands of the tree of Muls that computes `value` (through intermediates no one
    else reads)."""
    producer = rw.graph.producers.get(value)
    if producer is None or producer.op != "Mul" or not (root or rw.single_consumer(value)):
        return [value]
    return [f for operand in producer.inputs for f in _factors(rw, operand)]


def _producer(rw: _Rewriter, value: str, op: str) -> Node | None:
    producer = rw.graph.producers.get(value)
    return producer if producer is not None and producer.op == op else None


def _one_plus(rw: _Rewriter, value: str, op: str) -> Node | None:
    """The `op` node where `value` = 1 + op(...), either order."""
    add = _producer(rw, value, "Add")
    if add is None or len(add.inputs) != 2:
        return None
    for one, other in (add.inputs, add.inputs[::-1]):
        node = _producer(rw, other, op)
        if node is not None and _scalar(rw, one) == 1.0:
            return node
    return None


def _erf_argument_of(rw: _Rewriter, value: str) -> str | None:
    """x where `value` = 1 + erf(x / sqrt(2)) (or erf(x * sqrt(1/2)), either order)."""
    erf = _one_plus(rw, value, "Erf")
    if erf is None:
        return None
    scaled = rw.graph.producers.get(erf.inputs[0])
    if scaled is None or scaled.op not in ("Div", "Mul") or len(scaled.inputs) != 2:
        return None
    x, c = scaled.inputs
    factor = _scalar(rw, c)
    if factor is None or scaled.op == "Div" and factor == 0.0:
        return None
    factor = 1.0 / factor if scaled.op == "Div" else factor
    return x if _near(factor, SQRT_HALF) else None


def _tanh_argument_of(rw: _Rewriter, value: str) -> str | None:
    """x where `value` = 1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)), either order."""
    tanh = _one_plus(rw, value, "Tanh")
    if tanh is None:
        return None
    values, scale = _split_product(rw, tanh.inputs[0])
    if len(values) == 1 and _near(scale, SQRT_2_OVER_PI):
        return _cubic_sum_argument(rw, values[0])
    return None


def _cubic_sum_argument(rw: _Rewriter, value: str) -> str | None:
    """x where `value` = x + 0.044715 * x^3 (either order; x^3 a Pow or a product)."""
    add = _producer(rw, value, "Add")
    if add is None or len(add.inputs) != 2:
        return None
    for x, term in (add.inputs, add.inputs[::-1]):
        values, scale = _split_product(rw, term)
        if _near(scale, GELU_CUBIC) and _power_of(rw, values, x) == 3:
            return x
    return None


def _power_of(rw: _Rewriter, values: list[str], x: str) -> int | None:
    """n where the product of `values` is x^n (each x itself or a Pow of x by an integer)."""
    power = 0
    for value in values:
        pow_node = _producer(rw, value, "Pow")
        exponent = _scalar(rw, pow_node.inputs[1]) if pow_node is not None else None
        if value == x:
            power += 1
        elif pow_node is not None and pow_node.inputs[0] == x and exponent in (2.0, 3.0):
            power += int(exponent)
        else:
            return None
    return power


def _split_product(rw: _Rewriter, value: str) -> tuple[list[str], float]:
    """(the non-constant factors, the product of the scalar constant ones) of `value`."""
    factors = _factors(rw, value, root=True)
    constants = [_scalar(rw, f) for f in factors]
    values = [f for f, c in zip(factors, constants, strict=True) if c is None]
    return values, float(np.prod([c for c in constants if c is not None]))


def _near(value: float, expected: float) -> bool:
    """Equal but for float32 rounding of a constant an exporter wrote."""
    return abs(value - expected) <= 1e-6 * abs(expected)


def _gelu(rw: _Rewriter, node: Node) -> Node | None:
    """Gelu(x) for a Mul that computes x * 0.5 * (1 + erf(x / sqrt(2))), or the tanh form."""
    values, scale = _split_product(rw, node.outputs[0])
    if len(values) != 2 or abs(scale - 0.5) > 1e-7:
        return None
    for x, other in (values, values[::-1]):
        if _erf_argument_of(rw, other) == x:
            approximate = "none"
        elif _tanh_argument_of(rw, other) == x:
            approximate = "tanh"
        else:
            continue
        if rw.types[x] != rw.types[node.outputs[0]]:
            return None  # a factor broadcast the result: not GELU of x alone
        return Node("Gelu", node.name, (x,), node.outputs, {"approximate": approximate})
    return None


# Exponents a Pow by a constant is spelled out for: as products, which round like powf's
# results (x*x exactly; x*x*x within an ulp), or as the correctly rounded 1/x.
SPELLED_POWERS = (1, 2, 3, -1)


def _spelled_power(rw: _Rewriter, node: Node) -> bool:
    """Rewrite `node`, a Pow of a float by a constant in SPELLED_POWERS that broadcasts
    nothing, as products or a Reciprocal; whether it did."""
    if len(node.inputs) != 2:
        return False
    x, out = node.inputs[0], node.outputs[0]
    power = _scalar(rw, node.inputs[1], kinds="fiu")
    if power not in SPELLED_POWERS or rw.types[x] != rw.types[out]:
        return False
    if rw.types[x].dtype not in ("float16", "bfloat16", "float32", "float64"):
        return False
    if power == 1:
        rw.removed.add(node.name)
        rw.forward[out] = x
    elif power == -1:
        rw.replaced[node.name] = Node("Reciprocal", node.name, (x,), (out,))
    elif power == 2:
        rw.replaced[node.name] = Node("Mul", node.name, (x, x), (out,))
    else:
        square = rw.fresh(f"{node.name}_square")
        rw.types[square] = rw.types[x]
        rw.replaced[node.name] = Node("Mul", node.name, (x, x), (square,))
        rw.after[node.name] = Node("Mul", rw.fresh(f"{node.name}_cube"), (square, x), (out,))
    return True


def run(graph: Graph) -> Graph:
    rw = _Rewriter(graph)
    for node in graph.nodes:
        if node.op == "BatchNormalization":
            params = _bn_params(rw, node)
            if params is None:
                continue
            if not _fold_bn_into_producer(rw, node, *params):
                _decompose_bn(rw, node, *params)
        elif (source := _neutral(rw, node)) is not None:
            rw.removed.add(node.name)
            rw.forward[node.outputs[0]] = source
        elif node.op == "Mul" and (gelu := _gelu(rw, node)) is not None:
            rw.replaced[node.name] = gelu
        elif node.op == "Pow":
            _spelled_power(rw, node)
    return rw.result()
