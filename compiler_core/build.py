"""Graph + target (+ tuning records) -> module archive.

One kernel per fused group (tensor expressions -> loop IR -> schedule -> LLVM), one entry
function that runs every kernel in order over a statically planned workspace, weights in their
final (packed) layouts, and a manifest that records what was built and how it was verified.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from collections.abc import Mapping, Sequence

import llvmlite.ir as ir
import numpy as np

from compiler_core import te
from compiler_core.codegen import llvm as codegen
from compiler_core.codegen.native import compile_kernels, emit_object
from compiler_core.graph.ir import Graph, TensorType
from compiler_core.graph.ops.tensor import BYTE_VIEWS
from compiler_core.graph.verify import groups_partition
from compiler_core.kernels import KERNELS, KernelContext, KernelError, weight_prefetch
from compiler_core.kernels.schedules import StageInfo, default_schedule, transposed_read_tiles
from compiler_core.loop.ir import Allocate, Block, For, ForKind, IfThenElse, PrimFunc, Stmt
from compiler_core.schedule.primitives import Record, apply
from compiler_core.target import Target
from compiler_core.te.lower import stages_of
from compiler_core.te.tensor import RecurrenceOp, tensor_reads

ALIGNMENT = 64
ENTRY = "kiln_main"


@dataclasses.dataclass
class GroupKernel:
    name: str
    func: PrimFunc
    inputs: list[str]  # per input parameter: a graph value, or a packed constant "value::layout"
    outputs: list[str]  # graph values the kernel writes
    schedule: list[Record]
    packed: dict[str, np.ndarray]
    stages: list[StageInfo]
    symbol: str = ""  # the function that runs it: its own, or an identical kernel's
    # Later kernels' weights it prefetches (`weight_prefetch`): their inputs after its own.
    prefetches: list[weight_prefetch.WeightPrefetch] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.symbol = self.symbol or self.name

    @property
    def workload_key(self) -> str:
        """The kernel's code without its name: equal keys compile to the same function."""
        return dataclasses.replace(self.func, name="kernel").key


def _symbol(index: int, anchor: str | None, first: str) -> str:
    base = "".join(ch if ch.isalnum() else "_" for ch in (anchor or first))[-40:]
    return f"k{index}_{base.strip('_') or 'group'}"


def _stage_infos(ctx: KernelContext, outputs: Sequence[te.Tensor]) -> list[StageInfo]:
    """What the schedule sees: every stage with its own loop nest. A recurrence's loop is
    not a stage; the stages of its step are (its updates named like their states)."""
    output_ids = {id(t) for t in outputs}
    infos, expanded = [], set()
    for t in stages_of(outputs):
        if not isinstance(t.op, RecurrenceOp):
            infos.append(_stage_info(ctx, t, id(t) in output_ids))
        elif id(t.op) not in expanded:
            expanded.add(id(t.op))
            updates = {id(u) for u in t.op.updates}
            for stage in t.op.stages:
                info = _stage_info(ctx, stage, False)
                # Every stage of the step runs once per step (`in_step`); an update writes
                # row t of its state and is never inlined (`state`).
                notes = {**dict(info.notes), "in_step": True}
                if id(stage) in updates:
                    notes["state"] = True
                infos.append(dataclasses.replace(info, notes=tuple(sorted(notes.items()))))
    return infos


def _stage_info(ctx: KernelContext, t: te.Tensor, output: bool) -> StageInfo:
    reduction = t.op.reduction
    axes = tuple((f"{t.name}_{a.name}", a.extent) for a in reduction.axes) if reduction else ()
    reads = tuple(r.name for r in tensor_reads(t.op.body) if not r.is_placeholder)
    return StageInfo(
        name=t.name,
        shape=t.shape,
        reduce_axes=axes,
        output=output,
        op=ctx.stage_ops.get(t.name, ""),
        reads=reads,
        notes=tuple(sorted(ctx.notes.get(t.name, {}).items())),
    )


def group_outputs(graph: Graph, nodes) -> list[str]:
    inside = {n.name for n in nodes}
    outputs = []
    for node in nodes:
        for value in node.outputs:
            if not value:
                continue
            used_outside = any(c.name not in inside for c in graph.consumers.get(value, ()))
            if used_outside or value in graph.outputs:
                outputs.append(value)
    return outputs


@dataclasses.dataclass
class LoweredGroup:
    """A fused group as tensor expressions lowered to loop IR, before any schedule."""

    name: str
    func: PrimFunc
    inputs: list[str]
    outputs: list[str]
    packed: dict[str, np.ndarray]
    stages: list[StageInfo]
    target: Target  # the target it was lowered for (its vector width shaped the packing)


def lower_group(
    graph: Graph, group, index: int, target: Target, choices: Mapping[str, object] | None = None
) -> LoweredGroup:
    """The group's tensor expressions lowered to loop IR; `choices` are the tuner's decisions
    about its compute (`KernelContext.choice`), the builders' rules where absent."""
    nodes = _nodes(graph, group)
    ctx = KernelContext(graph, f"g{index}", target, choices)
    for node in nodes:
        builder = KERNELS.get(node.op)
        if builder is None:
            raise KernelError(f"node {node.name!r}: no CPU kernel for operator {node.op}")
        produced = [v for v in node.outputs if v]
        tensors = builder(ctx, node)
        for value, tensor in zip(produced, tensors, strict=True):
            ctx.tensors[value] = tensor
    outputs = group_outputs(graph, nodes)
    out_tensors = [ctx.tensors[v] for v in outputs]
    # A value computed as a plain copy of an input still needs its own stage.
    for k, tensor in enumerate(out_tensors):
        if tensor.is_placeholder:
            out_tensors[k] = te.compute(tensor.shape, lambda *i, t=tensor: t[i], f"copy{k}")
    name = _symbol(index, group.anchor, group.nodes[0])
    func = te.lower([t for _, t in ctx.inputs], out_tensors, name)
    stages = _stage_infos(ctx, out_tensors)
    inputs = [value for value, _ in ctx.inputs]
    return LoweredGroup(name, func, inputs, outputs, ctx.packed_arrays, stages, target)


def build_group(
    graph: Graph,
    group,
    index: int,
    target: Target,
    schedule=None,
    prefix: str = "",
    choices: Mapping[str, object] | None = None,
) -> GroupKernel:
    """The group's kernel; `prefix` keeps its symbol apart from other plans' in one library
    (a batch bucket's kernels, say); `choices` as for `lower_group`."""
    lowered = lower_group(graph, group, index, target, choices)
    default = schedule is None
    records = list(default_schedule(lowered.stages, target) if default else schedule)
    func = apply(lowered.func, records)
    if default and (tiled := transposed_read_tiles(func, target, records)) != records:
        records = tiled
        func = apply(lowered.func, records)
    if prefix:
        func = dataclasses.replace(func, name=prefix + func.name)
    return GroupKernel(
        prefix + lowered.name,
        func,
        lowered.inputs,
        lowered.outputs,
        records,
        lowered.packed,
        lowered.stages,
    )


# --- memory planning ---------------------------------------------------------------------------


def _aligned(size: int) -> int:
    return -(-max(size, 1) // ALIGNMENT) * ALIGNMENT


@dataclasses.dataclass
class MemoryPlan:
    offsets: dict[str, int]  # intermediate value -> workspace offset
    workspace_bytes: int
    naive_bytes: int  # what one buffer per intermediate would take


def scratch_bytes(stmt: Stmt, threads: int) -> int:
    """The most bytes a kernel holds at once in blocks of its own, outside the workspace plan
    (an `Allocate` of a non-local buffer: a Winograd conv's transformed tiles, a GEMM's packed
    panels, taken from the process's cache of blocks, codegen/kiln_workspace.c, and given
    back before the kernel returns): nested blocks together, one after another in turn, and
    a parallel loop's blocks once for each of the `threads` that run its iterations."""
    if isinstance(stmt, Allocate):
        own = 0 if stmt.buffer.scope == "local" else stmt.buffer.nbytes
        return own + scratch_bytes(stmt.body, threads)
    if isinstance(stmt, For):
        inner = scratch_bytes(stmt.body, threads)
        return inner * min(stmt.extent, threads) if stmt.kind == ForKind.PARALLEL else inner
    if isinstance(stmt, Block):
        return max((scratch_bytes(s, threads) for s in stmt.stmts), default=0)
    if isinstance(stmt, IfThenElse):
        branches = (stmt.then, stmt.otherwise) if stmt.otherwise else (stmt.then,)
        return max(scratch_bytes(s, threads) for s in branches)
    return 0  # stores, prefetches and barriers hold nothing


def largest_scratch(kernels: Sequence[GroupKernel], threads: int) -> tuple[int, str]:
    """(bytes, kernel) of the kernel that holds the most scratch in one call (`scratch_bytes`):
    what a run needs beyond its planned workspace, the kernels running one at a time."""
    sizes = [(scratch_bytes(k.func.body, threads), k.name) for k in kernels]
    return max(sizes, key=lambda size: size[0], default=(0, ""))


def plan_memory(graph: Graph, kernels: Sequence[GroupKernel]) -> MemoryPlan:
    """Liveness-based reuse: an intermediate's bytes are free once its last reader ran; the
    operands of a Concat joined in place live inside its output (`concat_aliases`), and a
    view of an intermediate in the bytes it views (`view_aliases`)."""
    external = set(graph.inputs) | set(graph.outputs) | set(graph.constants)
    sizes = {value: graph.types[value].nbytes for k in kernels for value in k.outputs}
    steps = [(k.inputs, k.outputs) for k in kernels]
    joins = _concat_joins(graph)
    aliases = {**concat_aliases(graph, joins), **view_aliases(graph, joins)}
    return plan_buffers(steps, sizes, external, aliases=aliases)


def view_aliases(
    graph: Graph, joins: Mapping[str, tuple[str, int]] | None = None
) -> dict[str, tuple[str, int]]:
    """{view: (the value it views, 0)} for the groups that are one view op of an intermediate
    (`BYTE_VIEWS`): a view read by several kernels, or by a kernel that reads no fused
    producer (a GEMM's operand), is a group of its own, and a copy of it would move every
    byte through memory for nothing (ShuffleNet's pointwise convs as MatMuls read a reshape
    of a value a residual Add reads too). Values a Concat joins in place are left to it
    (`joins`: `_concat_joins(graph)`, when the caller has them)."""
    external = set(graph.inputs) | set(graph.outputs) | set(graph.constants)
    joins = _concat_joins(graph) if joins is None else joins
    in_joins = set(joins) | {joined for joined, _ in joins.values()}
    direct: dict[str, str] = {}
    for group in graph.groups:
        if len(group.nodes) != 1 or graph.node_by_name[group.nodes[0]].op not in BYTE_VIEWS:
            continue
        node = graph.node_by_name[group.nodes[0]]
        source, view = node.inputs[0], node.outputs[0]
        if {source, view} & (external | in_joins):
            continue
        direct[view] = source
    aliases = {}
    for view, source in direct.items():
        while source in direct:  # a view of a view lives in the first one's source
            source = direct[source]
        aliases[view] = (source, 0)
    return aliases


def concat_aliases(
    graph: Graph, joins: Mapping[str, tuple[str, int]] | None = None
) -> dict[str, tuple[str, int]]:
    """{operand: (the value it lives in, byte offset)} for the Concats joined in place
    (`joins`: `_concat_joins(graph)`, computed when not given), a join's operands inside the
    outermost join that holds it."""
    direct = _concat_joins(graph) if joins is None else joins

    def outermost(value: str) -> tuple[str, int]:
        joined, start = direct[value]
        while joined in direct:
            joined, outer = direct[joined]
            start += outer
        return joined, start

    return {value: outermost(value) for value in direct}


def _concat_joins(graph: Graph) -> dict[str, tuple[str, int]]:
    """{operand: (its Concat's output, byte offset)} for the Concats joined in place: each
    operand is written by its producer straight into its slice of the joined value, and the
    Concat's kernel copies nothing (DenseNet's growing joins copied every earlier layer's
    features again at each layer). A Concat qualifies when it is a group of its own, its
    slices are contiguous (every axis before the joined one of extent 1: batch 1, NCHW or
    NCHW[b]c on channels) and start on ALIGNMENT, and its operands are intermediates, all
    different, that no earlier Concat took (a join's output may be one: joins nest)."""
    external = set(graph.inputs) | set(graph.outputs) | set(graph.constants)
    direct: dict[str, tuple[str, int]] = {}
    for group in graph.groups:
        if len(group.nodes) != 1 or graph.node_by_name[group.nodes[0]].op != "Concat":
            continue
        node = graph.node_by_name[group.nodes[0]]
        joined, operands = node.outputs[0], node.inputs
        shape = graph.types[joined].shape
        sizes = [graph.types[value].nbytes for value in operands]
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        if (
            joined in external
            or math.prod(shape[: node.attr("axis") % len(shape)]) != 1
            or len(set(operands)) != len(operands)
            or any(value in external or value in direct for value in operands)
            or any(start % ALIGNMENT for start in starts)
        ):
            continue
        direct.update(zip(operands, ((joined, start) for start in starts), strict=True))
    return direct


def plan_buffers(
    steps: Sequence[tuple[Sequence[str], Sequence[str]]],
    sizes: dict[str, int],
    external: set[str],
    alignment: int = ALIGNMENT,
    aliases: Mapping[str, tuple[str, int]] | None = None,
) -> MemoryPlan:
    """Offsets in one workspace for the values `steps` (inputs, outputs) define, except the
    `external` ones; a value's bytes are reused once its last reader ran. An aliased value
    (`aliases`: value -> (host value, byte offset)) lives inside its host, whose bytes are
    held from the first of its parts' definitions to the last of their reads."""
    aliases = aliases or {}
    defined_at, last_use = {}, {}
    for step, (inputs, outputs) in enumerate(steps):
        for value in inputs:
            last_use[value] = step
        for value in outputs:
            defined_at.setdefault(value, step)
    for value, (host, _) in aliases.items():
        defined_at[host] = min(defined_at[host], defined_at[value])
        last_use[host] = max(last_use.get(host, -1), last_use.get(value, -1))
    live: list[tuple[int, int, str]] = []  # (offset, size, value)
    offsets, peak, naive = {}, 0, 0
    for value, step in sorted(defined_at.items(), key=lambda item: item[1]):
        if value in external or value in aliases:
            continue
        live = [(o, s, v) for o, s, v in live if last_use.get(v, defined_at[v]) >= step]
        size = -(-max(sizes[value], 1) // alignment) * alignment
        naive += size
        offset = _first_fit(live, size)
        live.append((offset, size, value))
        offsets[value] = offset
        peak = max(peak, offset + size)
    for value, (host, start) in aliases.items():
        offsets[value] = offsets[host] + start
    return MemoryPlan(offsets, peak, naive)


def _first_fit(live, size: int) -> int:
    cursor = 0
    for offset, used, _ in sorted(live):
        if offset - cursor >= size:
            return cursor
        cursor = max(cursor, offset + used)
    return cursor


# --- the entry function ------------------------------------------------------------------------


@dataclasses.dataclass
class WeightsLayout:
    offsets: dict[str, int]
    blob: bytes


def weight_arrays(graph: Graph, kernels: Sequence[GroupKernel]) -> dict[str, np.ndarray]:
    """Every constant the plan reads, in its final (packed) layout, by name."""
    arrays: dict[str, np.ndarray] = {}
    for kernel in kernels:
        for name in kernel.inputs:
            if name in graph.constants:
                arrays[name] = np.ascontiguousarray(graph.constants[name])
            elif name in kernel.packed:
                arrays[name] = kernel.packed[name]
    for name in graph.outputs:
        if name in graph.constants:
            arrays[name] = np.ascontiguousarray(graph.constants[name])
    return arrays


class WeightsBlob:
    """Weights laid out one after another, each aligned; equal contents are stored once (the
    plans of several batch buckets read the same packed weights)."""

    def __init__(self, alignment: int = ALIGNMENT):
        self.alignment = alignment
        self.chunks: list[bytes] = []
        self.size = 0
        self._offsets: dict[str, int] = {}  # sha256 of the bytes -> offset

    def add(self, array: np.ndarray) -> int:
        data = array.tobytes()
        digest = hashlib.sha256(data).hexdigest()
        if digest not in self._offsets:
            self._offsets[digest] = self.size
            padded = -(-max(len(data), 1) // self.alignment) * self.alignment
            self.chunks.append(data + b"\0" * (padded - len(data)))
            self.size += padded
        return self._offsets[digest]

    def layout(self, arrays: dict[str, np.ndarray]) -> WeightsLayout:
        """Add `arrays`; their offsets, with the blob as it stands."""
        offsets = {name: self.add(array) for name, array in arrays.items()}
        return WeightsLayout(offsets, b"".join(self.chunks))


def layout_weights(graph: Graph, kernels: Sequence[GroupKernel]) -> WeightsLayout:
    return WeightsBlob().layout(weight_arrays(graph, kernels))


def _declare_kernel(module: ir.Module, kernel: GroupKernel) -> ir.Function:
    """A kernel defined in another object: void kernel(ptr, ptr, ...)."""
    arity = len(kernel.inputs) + len(kernel.outputs)
    return ir.Function(module, ir.FunctionType(ir.VoidType(), [codegen.PTR] * arity), kernel.symbol)


def emit_entry(
    module: ir.Module,
    graph: Graph,
    kernels: Sequence[GroupKernel],
    memory: MemoryPlan,
    weights: WeightsLayout,
    name: str = ENTRY,
) -> None:
    """void kiln_main(ptr inputs[], ptr outputs[], ptr workspace, ptr weights)."""
    ptr, i64 = codegen.PTR, codegen.I64
    entry = ir.Function(module, ir.FunctionType(ir.VoidType(), [ptr] * 4), name=name)
    inputs, outputs, workspace, blob = entry.args
    b = ir.IRBuilder(entry.append_basic_block("entry"))

    def slot(array, index):
        return b.load(b.gep(array, [i64(index)], source_etype=ptr), typ=ptr)

    def pointer(value: str):
        if value in graph.inputs:
            return slot(inputs, graph.inputs.index(value))
        if value in graph.outputs:
            return slot(outputs, graph.outputs.index(value))
        if value in weights.offsets:
            return b.gep(blob, [i64(weights.offsets[value])], source_etype=ir.IntType(8))
        return b.gep(workspace, [i64(memory.offsets[value])], source_etype=ir.IntType(8))

    for kernel in kernels:
        fn = module.globals.get(kernel.symbol) or _declare_kernel(module, kernel)
        b.call(fn, [pointer(value) for value in kernel.inputs + kernel.outputs])
    memcpy = module.globals.get("llvm.memcpy.p0.p0.i64") or ir.Function(
        module,
        ir.FunctionType(ir.VoidType(), [ptr, ptr, i64, ir.IntType(1)]),
        name="llvm.memcpy.p0.p0.i64",
    )
    # Outputs that are constants or inputs themselves are copied into place.
    for index, value in enumerate(graph.outputs):
        if value in graph.constants or value in graph.inputs:
            if value in weights.offsets:  # not pointer(): that names the output slot itself
                source = b.gep(blob, [i64(weights.offsets[value])], source_etype=ir.IntType(8))
            else:
                source = slot(inputs, graph.inputs.index(value))
            size = i64(graph.types[value].nbytes)
            b.call(memcpy, [slot(outputs, index), source, size, ir.IntType(1)(0)])
    b.ret_void()


@dataclasses.dataclass
class CompiledModel:
    graph: Graph
    target: Target
    kernels: list[GroupKernel]
    memory: MemoryPlan
    weights: WeightsLayout
    objects: list[bytes]  # the entry function's, then one per distinct kernel
    compile_seconds: float

    def kernel_key(self, kernel: GroupKernel) -> str:
        return hashlib.sha256(kernel.func.key.encode()).hexdigest()


def dedupe(kernels: Sequence[GroupKernel]) -> list[PrimFunc]:
    """One function per distinct workload: a kernel whose code equals an earlier one's (the
    repeated blocks of a ResNet or MobileNet) calls that one's function with its own buffers."""
    first: dict[str, GroupKernel] = {}
    funcs = []
    for kernel in kernels:
        original = first.setdefault(kernel.workload_key, kernel)
        kernel.symbol = original.name
        if original is kernel:
            funcs.append(kernel.func)
    return funcs


def build_kernels(
    graph: Graph,
    target: Target,
    schedules: dict[str, list] | None = None,
    prefix: str = "",
    choices: dict[str, dict] | None = None,
    prefetch_weights: bool = True,
) -> list[GroupKernel]:
    """One kernel per fused group, with the schedule `schedules` gives it or the default, and
    the compute choices `choices` gives it (tuned: see `lower_group`); with
    `prefetch_weights`, kernels prefetch the next kernels' weights (`weight_prefetch`)."""
    # A node outside every group would get no kernel and leave its outputs unwritten.
    problems = list(groups_partition(graph)) if graph.groups else ["no fusion groups"]
    if graph.nodes and problems:
        raise ValueError(
            f"{problems[0]}: build a graph the pipeline fused (passes.pipeline.optimize)"
        )
    joins = _concat_joins(graph)
    in_place = {joined for joined, _ in joins.values()} | set(view_aliases(graph, joins))
    kernels = []
    for index, group in enumerate(graph.groups):
        override = (schedules or {}).get(group.name)
        chosen = (choices or {}).get(group.name)
        if set(group_outputs(graph, _nodes(graph, group))) & in_place:
            kernels.append(_written_in_place(graph, group, index, target, prefix))
            continue
        kernels.append(build_group(graph, group, index, target, override, prefix, chosen))
    if prefetch_weights:
        add_weight_prefetches(graph, kernels)
    return kernels


def _nodes(graph: Graph, group) -> list:
    return [graph.node_by_name[name] for name in group.nodes]


def _written_in_place(graph: Graph, group, index: int, target: Target, prefix: str):
    """The kernel of a Concat whose operands the memory plan puts in place inside its output
    (`concat_aliases`), or of a view that lives in the bytes it views (`view_aliases`): the
    producers wrote its value already, so it does nothing. It keeps its place in the plan
    (one kernel per group, as the profile and manifest read)."""
    lowered = lower_group(graph, group, index, target)
    func = dataclasses.replace(lowered.func, name=prefix + lowered.func.name, body=Block(()))
    return GroupKernel(prefix + lowered.name, func, lowered.inputs, lowered.outputs, [], {}, [])


def add_weight_prefetches(graph: Graph, kernels: Sequence[GroupKernel]) -> None:
    """Each kernel prefetches (part of) the large weights of the kernels just after it
    (`weight_prefetch.plan`): the weights value becomes one more input of the kernel."""
    weights = set(graph.constants) | {name for k in kernels for name in k.packed}
    flops = [sum(_stage_flops(stage) for stage in k.stages) for k in kernels]
    funcs, inputs = [k.func for k in kernels], [k.inputs for k in kernels]
    for p in weight_prefetch.plan(funcs, inputs, flops, weights):
        by, source = kernels[p.by], kernels[p.of]
        buffer = source.func.params[source.inputs.index(p.value)]
        position = len(by.inputs)
        by.func = weight_prefetch.add_prefetch(by.func, position, buffer, p.start, p.nbytes)
        by.inputs = [*by.inputs, p.value]
        by.prefetches.append(p)


def _stage_flops(stage: StageInfo) -> float:
    return 2.0 * math.prod(stage.shape) * math.prod(extent for _, extent in stage.reduce_axes)


def build_graph(
    graph: Graph,
    target: Target,
    schedules: dict[str, list] | None = None,
    choices: dict[str, dict] | None = None,
):
    started = time.perf_counter()
    kernels = build_kernels(graph, target, schedules, choices=choices)
    memory = plan_memory(graph, kernels)
    weights = layout_weights(graph, kernels)
    distinct = dedupe(kernels)  # first: the entry calls each kernel's shared function
    entry = ir.Module(name=f"{graph.name}_entry")
    entry.triple = target.triple
    emit_entry(entry, graph, kernels, memory, weights)
    # One module per distinct kernel, so that they can be built in parallel.
    objects = [emit_object(entry, target), *compile_kernels(distinct, target)]
    return CompiledModel(
        graph, target, kernels, memory, weights, objects, time.perf_counter() - started
    )


def describe_types(graph: Graph, names: Sequence[str]) -> list[dict]:
    return [_type_record(name, graph.types[name]) for name in names]


def _type_record(name: str, t: TensorType) -> dict:
    return {"name": name, "shape": list(t.shape), "dtype": t.dtype}
