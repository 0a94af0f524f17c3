"""Run a graph op by op with the op table's numpy implementations.

This is what constant folding evaluates with and what compiled modules are checked against.
It is deliberately simple and never serves inference.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from compiler_core.graph.ir import Graph, TensorType
from compiler_core.graph.ops import OP_TABLE


class ReferenceExecutionError(RuntimeError):
    """The reference executor could not run a node (names the node)."""


def check_inputs(graph: Graph, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    missing = [name for name in graph.inputs if name not in inputs]
    unknown = [name for name in inputs if name not in graph.inputs]
    if missing or unknown:
        raise ValueError(
            f"inputs do not match the graph: missing {missing}, unknown {unknown}; "
            f"expected {list(graph.inputs)}"
        )
    checked = {}
    for name in graph.inputs:
        array = np.asarray(inputs[name])
        expected = graph.types[name]
        if TensorType.of(array) != expected:
            raise ValueError(f"input {name!r} is {TensorType.of(array)}, expected {expected}")
        checked[name] = array
    return checked


def run_graph(graph: Graph, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Execute `graph` on `inputs`; returns every graph output by name."""
    env: dict[str, np.ndarray] = dict(graph.constants)
    env.update(check_inputs(graph, inputs))
    remaining_uses = _use_counts(graph)
    for node in graph.nodes:
        args = [env[name] if name else None for name in node.inputs]
        try:
            with np.errstate(all="ignore"):
                results = OP_TABLE[node.op].compute(node, args)
        except Exception as err:  # noqa: BLE001 - re-raised with the node named
            raise ReferenceExecutionError(f"node {node.name!r} ({node.op}) failed: {err}") from err
        for name, value in zip(node.outputs, results, strict=False):
            if name:
                env[name] = _as_declared(np.asarray(value), graph.types[name], node)
        _release(env, node, remaining_uses, graph)
    return {name: env[name] for name in graph.outputs}


def _as_declared(value: np.ndarray, declared: TensorType, node) -> np.ndarray:
    if value.shape != declared.shape:
        raise ReferenceExecutionError(
            f"node {node.name!r} ({node.op}) produced shape {value.shape}, its type says {declared}"
        )
    return value.astype(declared.dtype, copy=False)


def _use_counts(graph: Graph) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in graph.nodes:
        for name in node.inputs:
            if name:
                counts[name] = counts.get(name, 0) + 1
    return counts


def _release(env, node, remaining_uses, graph: Graph) -> None:
    """Drop intermediates after their last use, so large models fit in memory."""
    for name in node.inputs:
        if not name:
            continue
        remaining_uses[name] -= 1
        if remaining_uses[name] == 0 and name not in graph.outputs and name not in graph.constants:
            env.pop(name, None)
