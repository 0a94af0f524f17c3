"""The one ordered pass pipeline. Each entry is (name, run); any stage can be dumped by name.

Three passes depend on the target: the layout pass blocks channels by the target's vector width,
the 1x1 convs it leaves on plain data become MatMuls over their pixels, and attention's two
GEMMs and softmax join one kernel that computes a block of queries at a time. `pipeline(target)`
binds the first and keeps all three for CPU targets only (a GPU target keeps NCHW: threads of a
warp read consecutive positions of one channel, and channel blocks for vector registers are a
CPU decision; its attention keeps three kernels, which the GPU templates schedule); every other
pass is target-independent.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from compiler_core.graph.ir import Graph
from compiler_core.graph.verify import verify
from compiler_core.passes import (
    block_masked_attention,
    clone_shared_views,
    decompose_attention,
    decompose_conv_transpose,
    eliminate_common_subexpressions,
    eliminate_dead_code,
    eliminate_identity,
    fold_constants,
    fuse_attention,
    fuse_operators,
    hoist_gathers,
    pointwise_matmul,
    simplify_inference,
    simplify_views,
    split_gemm_columns,
    transform_layout,
)
from compiler_core.target import Target, host_target

Pass = Callable[[Graph], Graph]


def _unchanged(graph: Graph) -> Graph:
    return graph


def pipeline(target: Target) -> tuple[tuple[str, Pass], ...]:
    if target.is_gpu:
        bound: dict[Pass, Pass] = dict.fromkeys(CPU_ONLY, _unchanged)
    else:
        layout = functools.partial(
            transform_layout.run, lanes=target.vector_lanes, fma_lanes=target.fma_lanes
        )
        bound = {transform_layout.run: layout}
    return tuple((name, bound.get(run, run)) for name, run in PIPELINE)


# The passes in order (the layout pass unbound: `pipeline(target)` gives the runnable list).
PIPELINE: tuple[tuple[str, Pass], ...] = (
    ("fold_constants", fold_constants.run),
    ("decompose_attention", decompose_attention.run),
    ("block_masked_attention", block_masked_attention.run),
    ("eliminate_identity", eliminate_identity.run),
    ("simplify_inference", simplify_inference.run),
    ("simplify_views", simplify_views.run),
    ("hoist_gathers", hoist_gathers.run),
    ("split_gemm_columns", split_gemm_columns.run),
    ("hoist_gathers_again", hoist_gathers.run),
    ("fold_constants_again", fold_constants.run),
    ("eliminate_common_subexpressions", eliminate_common_subexpressions.run),
    ("eliminate_identity_again", eliminate_identity.run),
    ("eliminate_dead_code", eliminate_dead_code.run),
    ("decompose_conv_transpose", decompose_conv_transpose.run),
    ("transform_layout", transform_layout.run),
    ("pointwise_matmul", pointwise_matmul.run),
    ("clone_shared_views", clone_shared_views.run),
    ("fuse_operators", fuse_operators.run),
    ("fuse_attention", fuse_attention.run),
)

# The passes a GPU target skips (its graph stays in NCHW, its convs as convs).
CPU_ONLY: tuple[Pass, ...] = (transform_layout.run, pointwise_matmul.run, fuse_attention.run)

PASS_NAMES = tuple(name for name, _ in PIPELINE)


def optimize(
    graph: Graph,
    stop_after: str | None = None,
    check: bool = True,
    target: Target | None = None,
) -> Graph:
    """Run the pipeline for `target` (default: the host CPU) up to and including
    `stop_after`, verifying after every pass."""
    if stop_after is not None and stop_after not in PASS_NAMES:
        raise ValueError(f"unknown pass {stop_after!r}; passes: {', '.join(PASS_NAMES)}")
    if check:
        verify(graph, stage="import")
    for name, run in pipeline(target or host_target()):
        graph = run(graph)
        if check:
            verify(graph, stage=name)
        if name == stop_after:
            break
    return graph


def stages(graph: Graph, target: Target | None = None) -> list[tuple[str, Graph]]:
    """Every pass's output, in order, for dumping and for tests."""
    result = [("import", graph)]
    for name, run in pipeline(target or host_target()):
        graph = run(graph)
        result.append((name, graph))
    return result
