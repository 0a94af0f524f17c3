"""Tuning tasks: a model's fused groups whose heavy stage has a schedule template.

A task's workload key is taken before scheduling: the sha256 of the template's name and
version and the canonical text of the group's lowered loop program (stage and buffer names
inside a group do not depend on the group's position, so two models that share a conv shape
and its epilogue share a key, and their tuning).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math

from compiler_core.build import LoweredGroup, lower_group
from compiler_core.gpu.schedules import gpu_schedule_for, gpu_tunable_of
from compiler_core.graph.ir import Graph
from compiler_core.kernels.schedules import Config, Tunable, schedule_for, tunable_of
from compiler_core.loop.printer import format_func
from compiler_core.schedule.primitives import Record
from compiler_core.target import Target, host_target


@dataclasses.dataclass
class Task:
    key: str
    workload: str  # short and readable: template, op, shapes, layout
    lowered: LoweredGroup  # of the first group with this key
    tunable: Tunable
    groups: list[str]  # names of the graph's groups that share the key
    flops: float

    @property
    def template(self) -> str:
        return self.tunable.template.name

    @property
    def template_version(self) -> int:
        return self.tunable.template.version

    @property
    def weight(self) -> int:
        return len(self.groups)

    def records(self, config: Config | None = None) -> list[Record]:
        """The whole group's schedule with the template at `config`."""
        target = self.lowered.target
        if not target.is_gpu:
            return schedule_for(self.lowered.stages, target, config)
        full = self.tunable.check(config or {})
        return gpu_schedule_for(
            self.lowered.stages, target, {self.tunable.anchor.name: full}, func=self.lowered.func
        )

    def space(self) -> list[dict[str, object]]:
        """Every config of the template's knobs that fits the registers, default first."""
        knobs = self.tunable.knobs
        default = self.tunable.default_config()
        configs = [default]
        for values in itertools.product(*(knob.choices for knob in knobs)):
            config = dict(zip((knob.name for knob in knobs), values, strict=True))
            if config != default and self.tunable.fits(config):
                configs.append(config)
        return configs


def config_key(config: Config) -> str:
    return json.dumps(dict(config), sort_keys=True, separators=(",", ":"))


def workload_of(lowered: LoweredGroup, tunable: Tunable) -> tuple[str, str]:
    """(key, readable description) of a group's workload."""
    template = tunable.template
    text = format_func(dataclasses.replace(lowered.func, name="kernel"))
    key = hashlib.sha256(f"{template.name}/v{template.version}\n{text}".encode()).hexdigest()
    anchor = tunable.anchor
    reduce = "x".join(str(extent) for _, extent in anchor.reduce_axes)
    layout = anchor.note("layout") or ""
    epilogue = "+epilogue" if tunable.epilogue is not None else ""
    shape = "x".join(map(str, anchor.shape))
    return key, f"{template.name} {anchor.op} {shape} r{reduce} {layout}{epilogue}".strip()


def flops_of(tunable: Tunable) -> float:
    anchor = tunable.anchor
    return 2.0 * math.prod(anchor.shape) * math.prod(e for _, e in anchor.reduce_axes)


def extract_tasks(graph: Graph, target: Target | None = None) -> list[Task]:
    """The graph's tuning tasks for `target` (default: the host CPU), heaviest (FLOPs x
    occurrences) first. A GPU target's tasks are its groups whose heaviest stage has a
    refined GPU template (dense, conv, row reductions); one thread per element is not tuned."""
    target = target or host_target()
    tasks: dict[str, Task] = {}
    for index, group in enumerate(graph.groups):
        lowered = lower_group(graph, group, index, target)
        if target.is_gpu:
            tunable = gpu_tunable_of(lowered.stages, target, lowered.func)
        else:
            tunable = tunable_of(lowered.stages, target)
        if tunable is None:
            continue
        key, workload = workload_of(lowered, tunable)
        if key in tasks:
            tasks[key].groups.append(group.name)
        else:
            tasks[key] = Task(key, workload, lowered, tunable, [group.name], flops_of(tunable))
    return sorted(tasks.values(), key=lambda t: -t.flops * t.weight)
