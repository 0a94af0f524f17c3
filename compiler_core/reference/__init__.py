"""Numpy reference executor for the graph IR: the oracle, never the product's inference path."""

from compiler_core.reference.executor import ReferenceError_, run_graph

__all__ = ["ReferenceError_", "run_graph"]
