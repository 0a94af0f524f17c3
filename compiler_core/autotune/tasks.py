"""Tuning tasks: a model's fused groups whose heavy stage has a schedule template.

A task's workload key is taken before scheduling: the sha256 of the template's name and
version and the canonical text of the group's lowered loop program (stage and buffer names
inside a group do not depend on the group's position, so two models that share a conv shape
and its epilogue share a key, and their tuning).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import math
from collections.abc import Callable

from compiler_core.build import LoweredGroup, lower_group
from compiler_core.gpu.schedules import gpu_schedule_for, gpu_tunable_of
from compiler_core.graph.ir import Graph
from compiler_core.kernels.schedules import Config, Tunable, schedule_for, tunable_of
from compiler_core.loop.printer import format_func
from compiler_core.schedule.primitives import Record
from compiler_core.target import Target, host_target

# The knob that picks a group's algorithm (a conv's direct or Winograd form): it changes the
# compute, so each of its values has a lowering (a variant) and the other knobs of its own.
ALGORITHM = "algorithm"
DIRECT = "direct"


@dataclasses.dataclass
class Variant:
    """The group computed by one algorithm: its lowering and its template's knobs."""

    lowered: LoweredGroup
    tunable: Tunable


@dataclasses.dataclass
class Task:
    key: str
    workload: str  # short and readable: template, op, shapes, layout
    lowered: LoweredGroup  # of the first group with this key (untuned: the default algorithm)
    tunable: Tunable
    groups: list[str]  # names of the graph's groups that share the key
    flops: float  # of the group's direct algorithm: GFLOP/s compare across algorithms
    # The algorithms the group can run, when it has more than one (configs then name theirs
    # under ALGORITHM), the untuned one, and how to lower the group with one of them: each is
    # lowered when first asked for (a build applying one record lowers one).
    algorithms: tuple[str, ...] = ()
    default_algorithm: str = ""
    lower: Callable[[str], Variant] | None = dataclasses.field(default=None, repr=False)
    # The builders' name for the choice (`KernelContext.choice`): a conv's or a GEMM's.
    choice: str = "conv_algorithm"
    _lowered: dict[str, Variant] = dataclasses.field(default_factory=dict, repr=False)

    @property
    def variants(self) -> dict[str, Variant]:
        """Algorithm -> variant, every one lowered (empty for a group of one algorithm)."""
        return {algorithm: self._variant_of(algorithm) for algorithm in self.algorithms}

    def _variant_of(self, algorithm: str) -> Variant:
        if algorithm not in self._lowered:
            self._lowered[algorithm] = self.lower(algorithm)
        return self._lowered[algorithm]

    @property
    def template(self) -> str:
        return self.tunable.template.name

    @property
    def template_version(self) -> int:
        return self.tunable.template.version

    @property
    def weight(self) -> int:
        return len(self.groups)

    def variant(self, config: Config | None) -> tuple[Variant, dict[str, object]]:
        """The variant a config runs (None: the default config), and the config of its
        template's knobs. A config without ALGORITHM (a record from before the knob) ran the
        direct algorithm."""
        rest = dict(self.default_config() if config is None else config)
        algorithm = rest.pop(ALGORITHM, None)
        if not self.algorithms:
            if algorithm is not None:
                raise ValueError(f"{self.workload}: one algorithm only, no {ALGORITHM!r} knob")
            return Variant(self.lowered, self.tunable), rest
        algorithm = algorithm or DIRECT
        if algorithm not in self.algorithms:
            raise ValueError(
                f"{self.workload}: {ALGORITHM}={algorithm!r} is not one of {list(self.algorithms)}"
            )
        return self._variant_of(algorithm), rest

    def lowered_for(self, config: Config | None) -> LoweredGroup:
        return self.variant(config)[0].lowered

    def choices(self, config: Config | None) -> dict[str, object]:
        """What the group's builders must be told to compute `config`'s variant."""
        if not self.algorithms:
            return {}
        algorithm = dict(config or self.default_config()).get(ALGORITHM) or DIRECT
        return {self.choice: algorithm}

    def default_config(self) -> dict[str, object]:
        """The untuned point: the default algorithm and its template's default knobs."""
        default = self.tunable.default_config()
        return {ALGORITHM: self.default_algorithm, **default} if self.algorithms else default

    def algorithm_default(self, algorithm: str) -> dict[str, object]:
        """`algorithm` at its own template's default knobs (a task of several algorithms)."""
        return {ALGORITHM: algorithm, **self._variant_of(algorithm).tunable.default_config()}

    def builds(self, config: Config) -> bool:
        """Whether the task's templates build `config` today (a logged config of knob values
        since dropped does not; one that lacks a knob added later, whose `absent` value says
        what it meant, does)."""
        try:
            self.records(config)
        except ValueError:
            return False
        return True

    def records(self, config: Config | None = None) -> list[Record]:
        """The whole group's schedule with the template at `config` (for its variant)."""
        variant, rest = self.variant(config)
        lowered = variant.lowered
        target = lowered.target
        if not target.is_gpu:
            return schedule_for(lowered.stages, target, rest)
        full = variant.tunable.check(rest)
        return gpu_schedule_for(
            lowered.stages, target, {variant.tunable.anchor.name: full}, func=lowered.func
        )

    def space(self) -> list[dict[str, object]]:
        """Every config of every variant's knobs that fits the registers, default first."""
        default = self.default_config()
        configs = [default]
        variants = self.variants or {"": Variant(self.lowered, self.tunable)}
        for algorithm, variant in variants.items():
            knobs = variant.tunable.knobs
            for values in itertools.product(*(knob.choices for knob in knobs)):
                config = dict(zip((knob.name for knob in knobs), values, strict=True))
                if self.algorithms:
                    config = {ALGORITHM: algorithm, **config}
                if config != default and variant.tunable.fits(config_of_knobs(config)):
                    configs.append(config)
        return configs


def config_of_knobs(config: Config) -> dict[str, object]:
    """A config without its ALGORITHM: the knobs of one template."""
    return {k: v for k, v in config.items() if k != ALGORITHM}


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
    """Multiply-adds x 2 of the anchor and, for a chained group, of the conv it computes
    inside itself (an expand conv's, over its whole output), or for attention of its scores
    GEMM (the softmax's exponentials are not counted)."""
    stages = [tunable.anchor]
    for inner in ("producer", "scores"):
        if tunable.anchor.note(inner) is not None:
            stages.append(tunable.anchor.note(inner))
    return sum(2.0 * math.prod(s.shape) * math.prod(e for _, e in s.reduce_axes) for s in stages)


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
        algorithms = () if target.is_gpu else tuple(tunable.anchor.note("algorithms", ()))
        if len(algorithms) < 2:
            algorithms = ()
        choice = tunable.anchor.note("algorithm_choice", "conv_algorithm")
        lower = functools.partial(_lower_variant, graph, group, index, target, choice)
        default = tunable.anchor.note("algorithm", "") if algorithms else ""
        # A group's identity is its direct algorithm's lowering: a change of the default
        # algorithm keeps its key, and its records.
        direct = lower(DIRECT) if algorithms and default != DIRECT else Variant(lowered, tunable)
        key, workload = workload_of(direct.lowered, direct.tunable)
        if key in tasks:
            tasks[key].groups.append(group.name)
            continue
        task = Task(key, workload, lowered, tunable, [group.name], flops_of(direct.tunable),
                    algorithms, default, lower, choice=choice)  # fmt: skip
        if algorithms:  # the two lowerings made here are the variants of their algorithms
            task._lowered.update({default: Variant(lowered, tunable), DIRECT: direct})
        tasks[key] = task
    return sorted(tasks.values(), key=lambda t: -t.flops * t.weight)


def _lower_variant(
    graph: Graph, group, index: int, target: Target, choice: str, algorithm: str
) -> Variant:
    """The group lowered with its anchor's builder told (its `choice`) to run `algorithm`."""
    lowered = lower_group(graph, group, index, target, {choice: algorithm})
    tunable = tunable_of(lowered.stages, target)
    if tunable is None:
        raise ValueError(f"{lowered.name}: no template for its {algorithm} form")
    return Variant(lowered, tunable)
