"""Numpy reference executor for the graph IR: the oracle, never the product's inference path."""

from compiler_core.reference.executor import ReferenceExecutionError, run_graph

__all__ = ["ReferenceExecutionError", "run_graph"]
