"""A built GPU model -> archive members: PTX (and a cubin where ptxas is here), the OpenCL
twin, weights, the launch plan and what the manifest says about them."""

from __future__ import annotations

import json

from compiler_core.build import describe_types
from compiler_core.codegen import nvptx, opencl
from compiler_core.gpu.build import GpuModel, Launch
from compiler_core.loop.ir import Allocate, PrimFunc
from compiler_core.loop.transform import walk_stmts

# A launch's weights of at least this size are streamed into L2 just before it (the plan's
# `prefetch` lists; `nvptx.PREFETCH_KERNEL` does it) when its kernel reads them thread by
# thread. A direct conv's weights otherwise arrive by its threads' own first-touch misses,
# each thread waiting on its own: on an H200, resnet18's launches took 3.34 ms in sequence,
# 2.12 with its 19 weights of 64 KB or more prefetched (46.7 MB a run; a run's weights do not
# stay in the 60 MB L2 from one run to the next). A kernel with shared memory (operands
# staged by the whole block, or a block folding a reduction) already reads its weights
# coalesced, many loads in flight: prefetching them too cost more than it saved there
# (encoder4's tiled GEMMs 1.08 -> 1.20 ms a run, the batch-1 MLP's dot products 0.089 ->
# 0.121 ms).
PREFETCH_MIN_BYTES = 64 * 1024


def plan_of(model: GpuModel) -> dict:
    graph = model.graph
    staging = {f.name for f in model.functions if _uses_shared_memory(f)}
    named = {a for launch in model.launches for a in launch.args}
    named |= set(model.weights.offsets)
    sizes = _value_sizes(model)
    copied = {
        name: name for name in graph.outputs if name in graph.inputs or name in graph.constants
    }
    return {
        "inputs": describe_types(graph, graph.inputs),
        "outputs": describe_types(graph, graph.outputs),
        "workspace_bytes": model.memory.workspace_bytes,
        "workspace_offsets": model.memory.offsets,
        "weight_offsets": model.weights.offsets,
        "values": [{"name": v, "nbytes": sizes[v]} for v in sorted(named)],
        "launches": [
            {
                "kernel": l.kernel,
                "grid": list(l.grid),
                "block": list(l.block),
                "args": list(l.args),
                "prefetch": [] if l.kernel in staging else _large_weights(model, sizes, l),
            }
            for l in model.launches
        ],
        "prefetch_kernel": nvptx.PREFETCH_KERNEL,
        "copied_outputs": copied,
    }


def _uses_shared_memory(func: PrimFunc) -> bool:
    """Whether a kernel stages operands or folds a reduction through shared memory: it then
    reads its weights coalesced already, and is not prefetched for (see PREFETCH_MIN_BYTES)."""
    allocations = (s for s in walk_stmts(func.body) if isinstance(s, Allocate))
    return any(s.buffer.scope == "shared" for s in allocations)


def _large_weights(model: GpuModel, sizes: dict[str, int], launch: Launch) -> list[str]:
    """The launch's weights worth streaming into L2 before it, each once."""
    weights = dict.fromkeys(a for a in launch.args if a in model.weights.offsets)
    return [w for w in weights if sizes[w] >= PREFETCH_MIN_BYTES]


def _value_sizes(model: GpuModel) -> dict[str, int]:
    """Bytes of every value the launches pass: a graph value's from its type, a packed weight's
    or a scratch buffer's from the parameter of the first kernel it is passed to."""
    params = {func.name: func.params for func in model.functions}
    sizes = {}
    for launch in model.launches:
        for param, value in zip(params[launch.kernel], launch.args, strict=True):
            sizes.setdefault(value, param.nbytes)
    sizes.update((v, t.nbytes) for v, t in model.graph.types.items())
    return sizes


def members_of(model: GpuModel) -> dict[str, bytes]:
    """Every member except the manifest."""
    arch = model.target.arch
    ptx = nvptx.emit_ptx(model.functions, arch)
    members = {
        "model.ptx": ptx.encode(),
        "kernels.cl": opencl.render_opencl(model.functions).encode(),
        "weights.bin": model.weights.blob,
        "plan.json": json.dumps(plan_of(model), indent=1).encode(),
    }
    cubin = nvptx.assemble(ptx, arch)
    if cubin is not None:
        members["model.cubin"] = cubin
    return members


def manifest_fields(model: GpuModel, tuned: dict[str, dict] | None = None) -> dict:
    """`tuned`: what the tuning log supplied, by group (the rest use the default schedule)."""
    tuned = tuned or {}
    return {
        "kernels": {name: tuned.get(name, "default schedule") for name in model.schedules},
        "launches": len(model.launches),
        "distinct_kernels": len(model.functions),
        "memory": {
            "workspace_bytes": model.memory.workspace_bytes,
            "naive_bytes": model.memory.naive_bytes,
        },
    }
