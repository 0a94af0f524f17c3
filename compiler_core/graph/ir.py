"""Graph IR: one immutable node type, static tensor types, and the graph that holds them.

Every value in a graph has a concrete `TensorType` (shape and dtype). Operators are
Kiln operators: they carry the ONNX operator's name where the meaning is the same, but all
shape-deciding parameters (a Reshape's target shape, a Slice's bounds, a Reduce's axes) are
static attributes, resolved by the frontend. That is what makes the IR static.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from collections.abc import Iterable, Mapping
from functools import cached_property
from types import MappingProxyType
from typing import Any

import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy, so np.dtype("bfloat16") works
import numpy as np

# The element types the graph IR knows, by numpy name.
DTYPES = frozenset(
    {
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "bfloat16",
    }
)
FLOAT_DTYPES = frozenset({"bfloat16", "float16", "float32", "float64"})


class OpKind(enum.IntEnum):
    """Operator pattern kinds, ordered as TVM orders them: fusion compares them."""

    ELEMWISE = 0
    BROADCAST = 1
    INJECTIVE = 2
    REDUCTION = 3
    OUT_ELEMWISE_FUSABLE = 4
    OPAQUE = 8


@dataclasses.dataclass(frozen=True)
class TensorType:
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported element type {self.dtype!r}")
        shape = tuple(int(d) for d in self.shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"negative dimension in shape {shape}")
        object.__setattr__(self, "shape", shape)

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize

    @classmethod
    def of(cls, array: np.ndarray) -> TensorType:
        return cls(tuple(array.shape), array.dtype.name)

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"


@dataclasses.dataclass(frozen=True)
class ArrayAttr:
    """A tensor-valued attribute (e.g. ConstantOfShape's fill value), hashable by content."""

    array: np.ndarray

    def __post_init__(self) -> None:
        frozen = np.array(self.array, copy=True)
        frozen.flags.writeable = False
        object.__setattr__(self, "array", frozen)

    @cached_property
    def digest(self) -> str:
        return _array_digest(self.array)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ArrayAttr) and self.digest == other.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        if self.array.size <= 8:
            return f"array({self.array.tolist()}, {self.array.dtype.name})"
        return f"array({TensorType.of(self.array)}, sha={self.digest[:12]})"


class GraphAttr:
    """A subgraph-valued attribute (a loop's body), hashable by the body's structural key."""

    __slots__ = ("graph",)

    def __init__(self, graph: Graph):
        self.graph = graph

    @property
    def key(self) -> str:
        return self.graph.key

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GraphAttr) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return f"graph({self.graph.name}, key={self.key[:16]})"


def _normalize_attr(value: Any) -> Any:
    if isinstance(value, Graph):
        return GraphAttr(value)
    if isinstance(value, np.ndarray):
        return ArrayAttr(value)
    if isinstance(value, (list, tuple)):
        return tuple(_normalize_attr(v) for v in value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, bytes):
        return value.decode()
    return value


_MISSING = object()


@dataclasses.dataclass(frozen=True)
class Node:
    """One operator application. Inputs and outputs are value names; '' marks an omitted input."""

    op: str
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        attrs = self.attrs.items() if isinstance(self.attrs, Mapping) else self.attrs
        normalized = tuple(sorted((k, _normalize_attr(v)) for k, v in attrs))
        object.__setattr__(self, "attrs", normalized)

    def attr(self, key: str, default: Any = _MISSING) -> Any:
        for name, value in self.attrs:
            if name == key:
                return value
        if default is _MISSING:
            raise KeyError(f"node {self.name!r} ({self.op}) has no attribute {key!r}")
        return default

    @property
    def attr_dict(self) -> dict[str, Any]:
        return dict(self.attrs)

    def replace(self, **changes: Any) -> Node:
        return dataclasses.replace(self, **changes)

    @property
    def signature(self) -> tuple:
        """What the node computes, independent of its name and output names (for CSE)."""
        return (self.op, self.inputs, self.attrs, tuple(bool(o) for o in self.outputs))


@dataclasses.dataclass(frozen=True)
class FusionGroup:
    """A set of nodes that later becomes one kernel; `anchor` is its heavy operator, if any."""

    name: str
    nodes: tuple[str, ...]
    kind: OpKind
    anchor: str | None = None


def _frozen_array(array: np.ndarray) -> np.ndarray:
    if not array.flags.writeable:
        return array
    frozen = np.array(array, copy=True)
    frozen.flags.writeable = False
    return frozen


def _array_digest(array: np.ndarray) -> str:
    h = hashlib.sha256()
    h.update(f"{array.dtype.name}{array.shape}".encode())
    # Hashed in place, not copied to bytes; as raw bytes, since a dtype such as bfloat16
    # (ml_dtypes) has no buffer format to export.
    h.update(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
    return h.hexdigest()


@dataclasses.dataclass(frozen=True, eq=False)
class Graph:
    """A static dataflow graph. `types` covers every value; `constants` holds read-only arrays."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    nodes: tuple[Node, ...]
    types: Mapping[str, TensorType]
    constants: Mapping[str, np.ndarray]
    groups: tuple[FusionGroup, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        object.__setattr__(self, "nodes", tuple(self.nodes))
        object.__setattr__(self, "groups", tuple(self.groups))
        object.__setattr__(self, "types", MappingProxyType(dict(self.types)))
        constants = {k: _frozen_array(v) for k, v in self.constants.items()}
        object.__setattr__(self, "constants", MappingProxyType(constants))

    def replace(self, **changes: Any) -> Graph:
        """A new graph with some fields changed; types and constants of unused values dropped."""
        return dataclasses.replace(self, **changes).pruned()

    def pruned(self) -> Graph:
        used = set(self.inputs) | set(self.outputs)
        for node in self.nodes:
            used.update(node.inputs)
            used.update(node.outputs)
        used.discard("")
        if used >= set(self.types) and used >= set(self.constants):
            return self
        return dataclasses.replace(
            self,
            types={k: v for k, v in self.types.items() if k in used},
            constants={k: v for k, v in self.constants.items() if k in used},
        )

    # --- derived views -------------------------------------------------------------------

    def input_signature(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(name, shape, dtype) of each graph input, in order."""
        return [(n, self.types[n].shape, self.types[n].dtype) for n in self.inputs]

    @cached_property
    def producers(self) -> Mapping[str, Node]:
        return MappingProxyType({out: n for n in self.nodes for out in n.outputs if out})

    @cached_property
    def consumers(self) -> Mapping[str, tuple[Node, ...]]:
        table: dict[str, list[Node]] = {}
        for node in self.nodes:
            for name in dict.fromkeys(node.inputs):
                if name:
                    table.setdefault(name, []).append(node)
        return MappingProxyType({k: tuple(v) for k, v in table.items()})

    @cached_property
    def node_by_name(self) -> Mapping[str, Node]:
        return MappingProxyType({n.name: n for n in self.nodes})

    def type_of(self, value: str) -> TensorType:
        try:
            return self.types[value]
        except KeyError:
            raise KeyError(f"graph {self.name!r} has no value named {value!r}") from None

    def is_constant(self, value: str) -> bool:
        return value in self.constants

    def op_histogram(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for node in self.nodes:
            counts[node.op] = counts.get(node.op, 0) + 1
        return dict(sorted(counts.items()))

    @cached_property
    def key(self) -> str:
        """Structural sha256: the printed graph plus the content of every constant."""
        from compiler_core.graph.printer import format_graph

        h = hashlib.sha256(format_graph(self, show_groups=True).encode())
        for name in sorted(self.constants):
            h.update(f"{name}={_array_digest(self.constants[name])}".encode())
        return h.hexdigest()

    def names(self) -> set[str]:
        """Every value and node name in use, for generating fresh ones."""
        taken = set(self.types) | {n.name for n in self.nodes}
        return taken


class NameGenerator:
    """Fresh, readable names that collide with nothing already in a graph."""

    def __init__(self, taken: Iterable[str]):
        self._taken = set(taken)
        self._counters: dict[str, int] = {}

    def __call__(self, prefix: str) -> str:
        count = self._counters.get(prefix, 0)
        while True:
            candidate = f"{prefix}_{count}"
            count += 1
            if candidate not in self._taken:
                self._counters[prefix] = count
                self._taken.add(candidate)
                return candidate

    def unique(self, name: str) -> str:
        """`name` itself when it is free, otherwise a fresh variant of it."""
        if name and name not in self._taken:
            self._taken.add(name)
            return name
        return self(name or "node")

    def reserve(self, name: str) -> None:
        self._taken.add(name)
