"""Graph + cuda target -> device kernels, a launch plan, PTX and the OpenCL twin.

Each fused group is lowered as for the CPU (the same tensor expressions), scheduled by the
GPU schedules, split into device kernels (one per top-level loop nest: a kernel boundary is
the only grid-wide barrier) and checked against the target's limits. Identical kernels are
emitted once. The plan lists the launches in order with the values each argument names: a
graph value, a weight, or a group's scratch buffer (`<group>/<buffer>`), all placed in one
device workspace by the same liveness-based planner as the CPU's; a view of an intermediate
in its group of its own (`build.view_aliases`) is launched as nothing, its value placed in the
bytes it views.
"""

from __future__ import annotations

import dataclasses
import time

from compiler_core.build import (
    LoweredGroup,
    MemoryPlan,
    WeightsBlob,
    WeightsLayout,
    lower_group,
    plan_buffers,
    view_aliases,
    weight_arrays,
)
from compiler_core.gpu.kernels import device_kernels
from compiler_core.gpu.launch import launch_dims
from compiler_core.gpu.schedules import gpu_schedule_for
from compiler_core.gpu.verify import GpuScheduleError, verify_device
from compiler_core.graph.ir import Graph
from compiler_core.loop.ir import Buffer, PrimFunc, Store
from compiler_core.loop.transform import walk_stmts
from compiler_core.loop.verify import LoopVerificationError
from compiler_core.schedule.primitives import Record, ScheduleError, apply
from compiler_core.target import Target, TargetError

# Device buffers start on 256-byte boundaries: coalesced loads, and OpenCL sub-buffers (the
# twin's workspace views) need the device's base-address alignment (128 bytes on PoCL).
DEVICE_ALIGNMENT = 256


@dataclasses.dataclass(frozen=True)
class Launch:
    kernel: str  # the device function's symbol (shared by identical kernels)
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: tuple[str, ...]  # per parameter: a graph value, a weight or `<group>/<scratch>`


@dataclasses.dataclass
class GpuModel:
    graph: Graph
    target: Target
    launches: list[Launch]
    functions: list[PrimFunc]  # the distinct device kernels
    memory: MemoryPlan
    weights: WeightsLayout
    schedules: dict[str, list[Record]]  # group name -> its schedule
    compile_seconds: float = 0.0


def _value_of(lowered: LoweredGroup, arg: tuple[str, object]) -> str:
    kind, what = arg
    if kind == "scratch":
        return f"{lowered.name}/{what}"
    index = int(what)  # type: ignore[arg-type]
    values = lowered.inputs + lowered.outputs
    return values[index]


def build_group_kernels(graph: Graph, group, index: int, target: Target, schedule=None):
    """(lowered group, its schedule, [(device function, argument values)], scratch sizes)."""
    lowered = lower_group(graph, group, index, target)
    if any(stage.note("state") for stage in lowered.stages):
        # A device kernel ends at each top-level loop nest; a loop over time steps around
        # several nests would need the host to launch the step's kernels once per step.
        raise TargetError(
            f"group {lowered.name!r}: a recurrence (RNN, GRU, LSTM, LinearAttention, Scan, "
            "Loop) has no GPU kernel yet; compile this model for the CPU (--target llvm)"
        )
    if schedule is not None:
        records = list(schedule)
        kernels, scratch = _scheduled(lowered, records, target)
    else:
        records = gpu_schedule_for(lowered.stages, target, func=lowered.func)
        try:
            kernels, scratch = _scheduled(lowered, records, target)
        except (ScheduleError, GpuScheduleError, LoopVerificationError):
            # A refined template's default point that fails here (a tile the shapes do not
            # allow, a limit) falls back to one thread per element, which always fits.
            records = gpu_schedule_for(lowered.stages, target, plain=True)
            kernels, scratch = _scheduled(lowered, records, target)
    launches = [(k.func, tuple(_value_of(lowered, a) for a in k.args)) for k in kernels]
    sizes = {f"{lowered.name}/{b.name}": b.nbytes for b in scratch}
    return lowered, records, launches, sizes


def _scheduled(lowered: LoweredGroup, records: list[Record], target: Target):
    kernels, scratch = device_kernels(apply(lowered.func, records))
    for kernel in kernels:
        verify_device(kernel.func, target)
    return kernels, scratch


def build_gpu_graph(graph: Graph, target: Target, schedules=None) -> GpuModel:
    started = time.perf_counter()
    lowered_groups, launches, steps, sizes = [], [], [], {}
    symbols: dict[str, str] = {}  # code key -> the first kernel's name
    functions: list[PrimFunc] = []
    applied: dict[str, list[Record]] = {}
    aliases = view_aliases(graph)
    for index, group in enumerate(graph.groups):
        first = graph.node_by_name[group.nodes[0]]  # an alias's group is that one view
        if first.outputs[0] in aliases:
            # A view that lives in the bytes it views: no launch, only its place in the plan.
            steps.append(([first.inputs[0]], [first.outputs[0]]))
            continue
        override = (schedules or {}).get(group.name)
        lowered, records, kernels, scratch = build_group_kernels(
            graph, group, index, target, override
        )
        lowered_groups.append(lowered)
        applied[group.name] = records
        sizes.update(scratch)
        for func, args in kernels:
            key = dataclasses.replace(func, name="kernel").key
            if key not in symbols:
                symbols[key] = func.name
                functions.append(func)
            grid, block = launch_dims(func)
            launches.append(Launch(symbols[key], grid, block, args))
            written = {args[k] for k, p in enumerate(func.params) if _writes(func, p)}
            steps.append(([a for a in args if a not in written], sorted(written)))
    sizes.update({v: graph.types[v].nbytes for v in graph.types})
    external = set(graph.inputs) | set(graph.outputs) | set(graph.constants)
    packed = {name for g in lowered_groups for name in g.packed}
    memory = plan_buffers(steps, sizes, external | packed, DEVICE_ALIGNMENT, aliases)
    arrays = weight_arrays(graph, lowered_groups)  # type: ignore[arg-type]
    weights = WeightsBlob(DEVICE_ALIGNMENT).layout(arrays)
    return GpuModel(
        graph,
        target,
        launches,
        functions,
        memory,
        weights,
        applied,
        time.perf_counter() - started,
    )


def _writes(func: PrimFunc, buffer: Buffer) -> bool:
    return any(isinstance(s, Store) and s.buffer == buffer for s in walk_stmts(func.body))
