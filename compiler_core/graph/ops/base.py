"""The shape of an op-table entry, and the small helpers most entries are built from."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from compiler_core.errors import UserError
from compiler_core.graph.ir import Node, OpKind, TensorType

# A type rule maps the node and its input types (None for an omitted optional input)
# to the output types. A compute function is the numpy reference implementation.
TypeRule = Callable[[Node, Sequence[TensorType | None]], Sequence[TensorType]]
Compute = Callable[[Node, Sequence[np.ndarray | None]], Sequence[np.ndarray]]


class ShapeError(UserError):
    """A node whose inputs or attributes make no valid output type."""


@dataclasses.dataclass(frozen=True)
class OpDef:
    name: str
    kind: OpKind
    infer: TypeRule
    compute: Compute
    # Pure on shapes only: evaluate from the input types alone (Shape, Size).
    from_types: Callable[[Node, Sequence[TensorType]], Sequence[np.ndarray]] | None = None


def opdef(name: str, kind: OpKind, infer: TypeRule, compute: Compute, **kw) -> OpDef:
    return OpDef(name=name, kind=kind, infer=infer, compute=compute, **kw)


# --- type-rule helpers ---------------------------------------------------------------------


def same_as(index: int = 0) -> TypeRule:
    def rule(node, types):
        return [types[index]]

    return rule


def broadcast_shapes(*shapes: Sequence[int]) -> tuple[int, ...]:
    try:
        return tuple(int(d) for d in np.broadcast_shapes(*[tuple(s) for s in shapes]))
    except ValueError:
        raise ShapeError(f"shapes {', '.join(map(str, shapes))} do not broadcast") from None


def broadcast_rule(dtype: str | None = None) -> TypeRule:
    """Numpy broadcasting of every present input; dtype of input 0 unless given."""

    def rule(node, types):
        present = [t for t in types if t is not None]
        shape = broadcast_shapes(*[t.shape for t in present])
        return [TensorType(shape, dtype or present[0].dtype)]

    return rule


def by_evaluation(node: Node, types: Sequence[TensorType | None], compute: Compute):
    """Run the reference on zero-filled inputs of the given types.

    Valid because every shape-deciding parameter of a Kiln op is a static attribute: output
    types depend on input types only. Used by small, rarely heavy ops; heavy ops have explicit
    rules so that inference never allocates model-sized tensors.
    """
    zeros = [None if t is None else np.zeros(t.shape, t.dtype) for t in types]
    with np.errstate(all="ignore"):
        outs = compute(node, zeros)
    return [TensorType.of(np.asarray(o)) for o in outs]


def evaluated(compute: Compute) -> TypeRule:
    def rule(node, types):
        return by_evaluation(node, types, compute)

    return rule


def normalize_axis(axis: int, rank: int, node: Node | None = None) -> int:
    if not -rank <= axis < max(rank, 1):
        where = f" in node {node.name!r} ({node.op})" if node else ""
        raise ShapeError(f"axis {axis} out of range for rank {rank}{where}")
    return axis % rank if rank else 0


def single(fn: Callable[..., np.ndarray]) -> Compute:
    """Wrap f(node, *inputs) -> array as a compute that returns one output."""

    def compute(node, inputs):
        return [np.asarray(fn(node, *inputs))]

    return compute
