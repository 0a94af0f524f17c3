"""The one ordered pass pipeline. Each entry is (name, run); any stage can be dumped by name."""

from __future__ import annotations

from collections.abc import Callable

from compiler_core.graph.ir import Graph
from compiler_core.graph.verify import verify
from compiler_core.passes import (
    eliminate_common_subexpressions,
    eliminate_dead_code,
    eliminate_identity,
    fold_constants,
    fuse_operators,
    simplify_inference,
    transform_layout,
)

Pass = Callable[[Graph], Graph]

PIPELINE: tuple[tuple[str, Pass], ...] = (
    ("fold_constants", fold_constants.run),
    ("eliminate_identity", eliminate_identity.run),
    ("simplify_inference", simplify_inference.run),
    ("fold_constants_again", fold_constants.run),
    ("eliminate_common_subexpressions", eliminate_common_subexpressions.run),
    ("eliminate_identity_again", eliminate_identity.run),
    ("eliminate_dead_code", eliminate_dead_code.run),
    ("transform_layout", transform_layout.run),
    ("fuse_operators", fuse_operators.run),
)

PASS_NAMES = tuple(name for name, _ in PIPELINE)


def optimize(graph: Graph, stop_after: str | None = None, check: bool = True) -> Graph:
    """Run the pipeline (up to and including `stop_after`), verifying after every pass."""
    if stop_after is not None and stop_after not in PASS_NAMES:
        raise ValueError(f"unknown pass {stop_after!r}; passes: {', '.join(PASS_NAMES)}")
    if check:
        verify(graph, stage="import")
    for name, run in PIPELINE:
        graph = run(graph)
        if check:
            verify(graph, stage=name)
        if name == stop_after:
            break
    return graph


def stages(graph: Graph) -> list[tuple[str, Graph]]:
    """Every pass's output, in order, for dumping and for tests."""
    result = [("import", graph)]
    for name, run in PIPELINE:
        graph = run(graph)
        result.append((name, graph))
    return result
