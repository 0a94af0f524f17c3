"""The in-model check: each tuned task's kernels timed inside the whole model, tuned and
untuned, as records that then decide the task's best.

A search times each candidate alone, its weights and inputs hot from the previous pass. Inside
a model a kernel starts where the kernels before it left the caches, and two configs can rank
the other way round there (resnet18's 14x14 3x3 convs on a Xeon: Winograd F(4x4) 0.38 ms
alone and 0.73 ms in the model, F(2x2) 0.43 and 0.46). So once the search is done, the model
is built twice, with the log's best config of every task and with none, and both builds'
kernels are profiled over their own workspace (`Module.profile`), the builds taking turns
round after round. Each task gets two records, its tuned config and its default timed in the
model (per occurrence: the task's kernels summed over its groups, divided by their count);
records flagged `in_model` alone decide a workload's best until a later search measures it
again (`TuningLog.ranked`), so a task whose tuned config loses in the model is built with its
default. The other tasks run as each build has them: tuned in one, default in the other.

A task whose tuned config runs another algorithm than its default, at knobs other than that
algorithm's defaults, gets a third candidate in a third build: its algorithm at its
template's default knobs. Knobs that tie alone can part in the model (MLP's 64 x 784 x 1024
layer as Strassen's algorithm: 8 x 16 tiles 402 us alone against 8 x 32 ones at 405, and 7%
slower in the model, where the weights come from L3).
"""

from __future__ import annotations

import dataclasses
import statistics

from compiler_core.autotune.apply import tuned_schedules
from compiler_core.autotune.measure import Result
from compiler_core.autotune.records import TuningLog
from compiler_core.autotune.search import measured_record
from compiler_core.autotune.tasks import ALGORITHM, DIRECT, Task, config_key
from compiler_core.graph.ir import Graph
from compiler_core.runtime.module import load, random_inputs
from compiler_core.target import Target

IN_MODEL_ROUNDS = 5  # rounds of both builds, in alternating order
IN_MODEL_REPEATS = 10  # runs of each kernel per round (Module.profile takes their median)


@dataclasses.dataclass
class InModelTiming:
    """A task's tuned config and its default, each timed in the model (seconds per run of
    one of its kernels: the rounds' medians)."""

    task: Task
    tuned_config: dict
    tuned: tuple[float, ...]
    default: tuple[float, ...]
    # The tuned algorithm at its template's default knobs, when that is a third config.
    alternative_config: dict | None = None
    alternative: tuple[float, ...] = ()

    @property
    def tuned_ms(self) -> float:
        return statistics.median(self.tuned) * 1e3

    @property
    def default_ms(self) -> float:
        return statistics.median(self.default) * 1e3

    @property
    def alternative_ms(self) -> float | None:
        return statistics.median(self.alternative) * 1e3 if self.alternative else None

    @property
    def kept_default(self) -> bool:
        return self.default_ms <= min(self.tuned_ms, self.alternative_ms or self.tuned_ms)

    def candidates(self) -> list[tuple[dict, tuple[float, ...]]]:
        """(config, in-model times) of each config timed."""
        timed = [(self.tuned_config, self.tuned), (self.task.default_config(), self.default)]
        if self.alternative_config is not None:
            timed.append((self.alternative_config, self.alternative))
        return timed


def check_in_model(
    graph: Graph,
    target: Target,
    tasks: list[Task],
    log: TuningLog,
    measurer,
    compiler_version: str = "",
    threads: int | None = None,
    rounds: int = IN_MODEL_ROUNDS,
) -> list[InModelTiming]:
    """Time the tasks `log` tunes (those whose best config is not the default, and not yet
    checked in the model since their last search measurement) inside the model, tuned and
    untuned, and append the timings to `log` as in-model records (keyed like `measurer`'s).
    Returns what was timed, heaviest task first."""
    from compiler_core.compiler import compile_graph

    fingerprint = measurer.fingerprint
    _, notes, _ = tuned_schedules(graph, target, log, fingerprint)
    tuned = {
        task.key: notes[task.groups[0]]["config"]
        for task in tasks
        if task.groups[0] in notes
        and config_key(notes[task.groups[0]]["config"]) != config_key(task.default_config())
        and not log.checked_in_model(task.key, fingerprint, task.template_version)
    }
    if not tuned:
        return []
    builds = [
        load(compile_graph(graph, target, verify=False, tuning=log), num_threads=threads),
        load(compile_graph(graph, target, verify=False), num_threads=threads),
    ]
    alternatives = _algorithm_defaults(tasks, tuned)
    if alternatives:
        builds.append(_alternatives_build(graph, target, alternatives, threads))
    per_group = _profile_rounds(graph, builds, rounds)
    timings = []
    for task in tasks:
        if task.key not in tuned:
            continue
        tuned_times, default_times, *alternative_times = (
            tuple(sum(r[g] for g in task.groups) / task.weight for r in per_group[k])
            for k in range(len(builds))
        )
        timing = InModelTiming(task, tuned[task.key], tuned_times, default_times)
        if task.key in alternatives:
            timing.alternative_config = alternatives[task.key][1]
            timing.alternative = alternative_times[0]
        timings.append(timing)
    log.extend(_records(timings, measurer, compiler_version))
    return timings


def _algorithm_defaults(tasks: list[Task], tuned: dict[str, dict]) -> dict[str, tuple]:
    """{task key: (task, its tuned config's algorithm at its template's default knobs)} for
    the tuned tasks where that is neither the tuned config nor the task's default."""
    alternatives = {}
    for task in tasks:
        config = tuned.get(task.key)
        if config is None or not task.algorithms:
            continue
        variant, _ = task.variant(config)
        algorithm = config.get(ALGORITHM) or DIRECT
        alternative = {ALGORITHM: algorithm, **variant.tunable.default_config()}
        if config_key(alternative) not in (config_key(config), config_key(task.default_config())):
            alternatives[task.key] = (task, alternative)
    return alternatives


def _alternatives_build(graph: Graph, target: Target, alternatives, threads):
    """The model built with each alternative config and every other task at its default."""
    from compiler_core.compiler import compile_graph

    configs = {task.key: config for task, config in alternatives.values()}
    return load(compile_graph(graph, target, verify=False, configs=configs), num_threads=threads)


def _profile_rounds(graph: Graph, builds, rounds: int) -> list[list[dict[str, float]]]:
    """Per build, per round: {group name: its kernel's median seconds}. Kernels run in the
    graph's group order (the plan's), so a profile's rows are the groups'."""
    feeds = random_inputs(graph.input_signature())
    groups = [group.name for group in graph.groups]
    for module in builds:  # warm-up: first-touch pages, lazy symbol binding
        module.profile(feeds, 1)
    taken: list[list[dict[str, float]]] = [[] for _ in builds]
    for round_ in range(rounds):
        order = range(len(builds))
        for k in reversed(order) if round_ % 2 else order:
            rows = builds[k].profile(feeds, IN_MODEL_REPEATS)
            taken[k].append({g: seconds for g, (_, seconds) in zip(groups, rows, strict=True)})
    return taken


def _records(timings: list[InModelTiming], measurer, compiler_version: str):
    records = []
    for timing in timings:
        task = timing.task
        for config, costs in timing.candidates():
            record = measured_record(task, config, Result(costs), measurer, compiler_version)
            records.append(dataclasses.replace(record, retimed=True, in_model=True))
    return records
