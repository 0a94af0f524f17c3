"""Batch buckets: one archive holding a plan per batch size, sharing kernels and weights.

A static-shape compiler builds code for one batch size. For serving, `compile(...,
batch_buckets=[1, 2, 4, 8, 16])` builds one plan per bucket into one library: kernels that come
out identical across buckets compile once (dedupe by workload), equal weights are stored once,
and each bucket has its own entry (`kiln_main_b<N>`) and workspace plan. The runtime runs the
smallest bucket that holds a request's batch, padding the rest with zeros and cutting the
outputs back (`compiler_core.runtime`).

The batch is axis 0 of every input and every output. A model whose outputs do not follow the
batch (a Reshape with the batch baked in, say) is refused with the output named.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import llvmlite.ir as ir
import onnx

from compiler_core.build import (
    ENTRY,
    GroupKernel,
    MemoryPlan,
    WeightsBlob,
    WeightsLayout,
    build_kernels,
    dedupe,
    emit_entry,
    plan_memory,
    weight_arrays,
)
from compiler_core.codegen.native import compile_kernels, emit_object
from compiler_core.errors import UserError
from compiler_core.graph.ir import Graph
from compiler_core.target import Target

MAX_BUCKET = 4096


class BatchBucketError(UserError):
    """Batch buckets that are malformed, or a model whose batch cannot be varied."""


def check_buckets(buckets: Sequence[int]) -> tuple[int, ...]:
    values = []
    for bucket in buckets:
        if isinstance(bucket, bool) or not isinstance(bucket, int) or not 0 < bucket <= MAX_BUCKET:
            raise BatchBucketError(
                f"batch bucket {bucket!r} is not a whole number between 1 and {MAX_BUCKET}"
            )
        values.append(bucket)
    if not values:
        raise BatchBucketError("batch_buckets is empty: give at least one batch size")
    return tuple(sorted(set(values)))


def with_symbolic_batch(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` whose graph inputs and outputs have a symbolic axis 0 ("batch")."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    constants = {t.name for t in model.graph.initializer}
    for value in [*model.graph.input, *model.graph.output]:
        if value.name in constants or not value.type.HasField("tensor_type"):
            continue
        dims = value.type.tensor_type.shape.dim
        if not len(dims):
            raise BatchBucketError(f"{value.name!r} is a scalar: it has no batch axis to vary")
        dims[0].Clear()
        dims[0].dim_param = "batch"
    return model


def bucket_shapes(
    model: onnx.ModelProto, shapes: Mapping[str, Sequence[int]] | None, batch: int
) -> dict[str, list[int]]:
    """Every data input's shape at `batch`: axis 0 is the bucket, the other axes come from
    `shapes` when it names the input, else from the declared (static) dims."""
    shapes = dict(shapes or {})
    constants = {t.name for t in model.graph.initializer}
    bound = {}
    for value in model.graph.input:
        if value.name in constants:
            continue
        if value.name in shapes:
            rest = [int(d) for d in shapes[value.name]][1:]
        else:
            dims = value.type.tensor_type.shape.dim[1:]
            if any(not d.HasField("dim_value") for d in dims):
                labels = [d.dim_param or "?" for d in dims if not d.HasField("dim_value")]
                raise BatchBucketError(
                    f"input {value.name!r} has symbolic dimensions {labels} besides the batch; "
                    f"bind its shape with shapes={{{value.name!r}: [...]}}"
                )
            rest = [d.dim_value for d in dims]
        bound[value.name] = [batch, *rest]
    return bound


def check_batch_major(graph: Graph, batch: int) -> None:
    for name in graph.outputs:
        shape = graph.types[name].shape
        if not shape or shape[0] != batch:
            raise BatchBucketError(
                f"output {name!r} has shape {list(shape)} at batch {batch}: its axis 0 does not "
                "follow the batch, so batch buckets cannot apply to this model"
            )


@dataclasses.dataclass
class BucketPlan:
    batch: int
    graph: Graph
    kernels: list[GroupKernel]
    memory: MemoryPlan
    weight_offsets: dict[str, int]

    @property
    def entry(self) -> str:
        return f"{ENTRY}_b{self.batch}"


@dataclasses.dataclass
class BucketedModel:
    target: Target
    plans: list[BucketPlan]
    weights: bytes
    objects: list[bytes]  # the entries' object, then one per distinct kernel


def build_buckets(
    graphs: Mapping[int, Graph],
    target: Target,
    schedules: Mapping[int, dict[str, list]] | None = None,
    choices: Mapping[int, dict[str, dict]] | None = None,
) -> BucketedModel:
    """Build every bucket's plan into one set of objects: kernels identical across buckets
    compile once, equal weights are stored once. `schedules` and `choices` (the tuner's, per
    batch) as for `build_kernels`."""
    blob = WeightsBlob()
    plans = []
    for batch, graph in sorted(graphs.items()):
        check_batch_major(graph, batch)
        kernels = build_kernels(
            graph, target, (schedules or {}).get(batch), f"b{batch}_", (choices or {}).get(batch)
        )
        memory = plan_memory(graph, kernels)
        offsets = blob.layout(weight_arrays(graph, kernels)).offsets
        plans.append(BucketPlan(batch, graph, kernels, memory, offsets))
    distinct = dedupe([kernel for plan in plans for kernel in plan.kernels])
    weights = b"".join(blob.chunks)
    entry = ir.Module(name="buckets_entry")
    entry.triple = target.triple
    for plan in plans:
        layout = WeightsLayout(plan.weight_offsets, weights)
        emit_entry(entry, plan.graph, plan.kernels, plan.memory, layout, name=plan.entry)
    objects = [emit_object(entry, target), *compile_kernels(distinct, target)]
    return BucketedModel(target, plans, weights, objects)
