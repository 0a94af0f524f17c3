"""What a kernel builder sees, and the helpers most builders use.

A builder turns one graph node into tensor expressions: `build(ctx, node) -> list[Tensor]`.
It reads its operands with `ctx.tensor(value)`, and a constant operand's data with
`ctx.constant(value)`; a builder that wants a weight in another layout registers the packed
array with `ctx.packed(...)`, which happens once, when the module is built.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from compiler_core.graph.ir import Graph, Node, TensorType
from compiler_core.loop.ir import INDEX, Const, Expr
from compiler_core.target import Target
from compiler_core.te import Tensor, placeholder


class KernelError(ValueError):
    """No kernel rule for a node (names the node and what is missing)."""


class KernelContext:
    def __init__(
        self, graph: Graph, prefix: str, target: Target, choices: Mapping[str, object] | None = None
    ):
        self.graph = graph
        self.target = target  # its vector width decides packing blocks and panels
        # Decisions the tuner made for the group's compute (its conv algorithm, say): what a
        # builder would otherwise take from its default rule.
        self.choices = dict(choices or {})
        self.prefix = prefix
        self.tensors: dict[str, Tensor] = {}
        self.inputs: list[tuple[str, Tensor]] = []  # (graph value or packed name, placeholder)
        self.packed_arrays: dict[str, np.ndarray] = {}
        self.stage_ops: dict[str, str] = {}  # stage name -> the graph op it computes
        self.notes: dict[str, dict[str, object]] = {}  # stage name -> facts for schedules
        self._count = 0

    def stage_name(self, node: Node, prefix: str = "") -> str:
        self._count += 1
        name = f"{prefix}{node.op.lower()}{self._count}"
        self.stage_ops[name] = node.op
        return name

    def choice(self, name: str, default: object = None) -> object:
        """The tuner's choice `name` for this group, or `default` (the builder's rule)."""
        return self.choices.get(name, default)

    def note(self, stage: str, **facts) -> None:
        """Facts a default schedule needs about a stage (its weight layout, say)."""
        self.notes.setdefault(stage, {}).update(facts)

    def type(self, value: str) -> TensorType:
        return self.graph.types[value]

    def is_constant(self, value: str) -> bool:
        return value in self.graph.constants

    def constant(self, value: str) -> np.ndarray:
        return np.asarray(self.graph.constants[value])

    def tensor(self, value: str) -> Tensor:
        """The tensor for a value: computed in this group, or a new kernel input."""
        if value not in self.tensors:
            t = self.type(value)
            tensor = placeholder(t.shape, t.dtype, f"in{len(self.inputs)}")
            self.tensors[value] = tensor
            self.inputs.append((value, tensor))
        return self.tensors[value]

    def view(self, value: str, dtype: str, shape: Sequence[int]) -> Tensor:
        """A kernel input reading the bytes of `value` as another element type and shape
        (BitCast): the same memory, passed a second time, with no conversion."""
        name = f"{value}::view:{dtype}"
        if name not in self.tensors:
            tensor = placeholder(tuple(shape), dtype, f"in{len(self.inputs)}")
            self.tensors[name] = tensor
            self.inputs.append((value, tensor))
        return self.tensors[name]

    def reshaped(self, value: str, shape: Sequence[int]) -> Tensor:
        """A kernel input reading `value` in another shape of the same size (row-major, no
        copy): a row reduction reads the trailing axes as one flat axis, so its index stays
        affine in the vector lane."""
        t = self.type(value)
        name = f"{value}::reshape:{'x'.join(map(str, shape))}"
        if name not in self.tensors:
            tensor = placeholder(tuple(shape), t.dtype, f"in{len(self.inputs)}")
            self.tensors[name] = tensor
            self.inputs.append((value, tensor))
        return self.tensors[name]

    def packed(self, source: str, label: str, array: np.ndarray) -> Tensor:
        """A kernel input holding `array`, a build-time transform of constant `source`."""
        name = f"{source}::{label}"
        if name not in self.tensors:
            array = np.ascontiguousarray(array).reshape(np.shape(array))  # 0-d stays 0-d
            tensor = placeholder(array.shape, array.dtype.name, f"in{len(self.inputs)}")
            self.tensors[name] = tensor
            self.inputs.append((name, tensor))
            self.packed_arrays[name] = array
        return self.tensors[name]


Builder = Callable[[KernelContext, Node], Sequence[Tensor]]


def broadcast_index(shape: Sequence[int], out_shape: Sequence[int], index: Sequence[Expr]):
    """Index into a tensor of `shape` broadcast (numpy rules) to `out_shape`."""
    offset = len(out_shape) - len(shape)
    return tuple(
        Const(0, INDEX) if dim == 1 and out_shape[offset + k] != 1 else index[offset + k]
        for k, dim in enumerate(shape)
    )
