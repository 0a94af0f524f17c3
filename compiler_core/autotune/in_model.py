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

A task of several algorithms gets more candidates, each in a build of its own (a task's k-th
candidate in the k-th extra build): its tuned algorithm at its template's default knobs, when
that is another config (knobs that tie alone can part in the model: MLP's 64 x 784 x 1024
layer as Strassen's algorithm, 8 x 16 tiles 402 us alone against 8 x 32 ones at 405, and 7%
slower in the model, where the weights come from L3), and each other algorithm's fastest
config alone (the same layer on Zen 3: Strassen's 159 GFLOP/s alone and 36% slower than the
direct default in the model, where the packed-A form, 5% behind Strassen alone, was never
built).

A task checked in an earlier session also gets what builds applied before this search (the
winner of its last check, `TuningLog.previous_choice`): a search compares the configs it
measures with each other, but isolated costs logged on another day do not compare with
today's, and a re-tune that trusted them could replace a config that ran faster in the model
(MobileNetV2 re-tuned on the AMX Xeon: its new configs mostly measured 5-30% faster alone
than the old ones' nine-day-old costs, and the build ran 4% slower than the one it replaced).
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
    # More configs of a task of several algorithms (see the module's docstring), each with
    # its in-model times.
    alternatives: list[tuple[dict, tuple[float, ...]]] = dataclasses.field(default_factory=list)
    # Which of them builds applied before this search (`TuningLog.previous_choice`), if any.
    previous: dict | None = None

    @property
    def tuned_ms(self) -> float:
        return statistics.median(self.tuned) * 1e3

    @property
    def default_ms(self) -> float:
        return statistics.median(self.default) * 1e3

    @property
    def kept_default(self) -> bool:
        """Whether the default ran fastest in the model (it wins a tie)."""
        return config_key(self._fastest()) == config_key(self.task.default_config())

    @property
    def kept_previous(self) -> bool:
        """Whether what builds applied before this search ran fastest in the model."""
        return not self.kept_default and self._fastest() == self.previous

    def _fastest(self) -> dict:
        default = config_key(self.task.default_config())
        fastest = min(
            self.candidates(),
            key=lambda timed: (statistics.median(timed[1]), config_key(timed[0]) != default),
        )
        return fastest[0]

    def candidates(self) -> list[tuple[dict, tuple[float, ...]]]:
        """(config, in-model times) of each config timed, once: a task whose best is its
        default, checked for its earlier choice, has the default in two builds, and the
        tuned build's timing counts."""
        timed = [(self.tuned_config, self.tuned), (self.task.default_config(), self.default)]
        once = {}
        for config, times in timed + self.alternatives:
            once.setdefault(config_key(config), (config, times))
        return list(once.values())


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
    """Time the tasks `log` tunes (those not checked in the model since their last search
    measurement whose best config, or whose earlier choice, is not the default) inside the
    model, tuned and untuned, and append the timings to `log` as in-model records (keyed
    like `measurer`'s). Returns what was timed, heaviest task first."""
    from compiler_core.compiler import compile_graph

    fingerprint = measurer.fingerprint
    _, notes, _ = tuned_schedules(graph, target, log, fingerprint)
    previous = {task.key: _previous(task, log, fingerprint) for task in tasks}
    tuned = {
        task.key: notes[task.groups[0]]["config"]
        for task in tasks
        if task.groups[0] in notes
        and _tuned(task, notes[task.groups[0]]["config"], previous[task.key])
        and not log.checked_in_model(task.key, fingerprint, task.template_version)
    }
    if not tuned:
        return []
    builds = [
        load(compile_graph(graph, target, verify=False, tuning=log), num_threads=threads),
        load(compile_graph(graph, target, verify=False), num_threads=threads),
    ]
    alternatives = {
        task.key: _alternatives(task, tuned[task.key], log, fingerprint, previous[task.key])
        for task in tasks
        if task.key in tuned
    }
    extra = max(map(len, alternatives.values()), default=0)
    builds += [_alternatives_build(graph, target, alternatives, k, threads) for k in range(extra)]
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
        timing.alternatives = list(zip(alternatives[task.key], alternative_times, strict=False))
        if previous[task.key] in alternatives[task.key]:
            timing.previous = previous[task.key]
        timings.append(timing)
    log.extend(_records(timings, measurer, compiler_version))
    return timings


def _tuned(task: Task, best: dict, previous: dict | None) -> bool:
    """Whether a task has a config other than its default to time in the model: its best,
    or what builds applied before its search (a search whose best alone is the default,
    today, has not shown that the earlier choice runs slower in the model)."""
    default = config_key(task.default_config())
    return config_key(best) != default or (previous is not None and config_key(previous) != default)


def _previous(task: Task, log: TuningLog, fingerprint: str) -> dict | None:
    """The config builds applied before the task's latest search, where its template still
    builds it (`TuningLog.previous_choice`)."""
    previous = log.previous_choice(task.key, fingerprint, task.template, task.template_version)
    return previous.config if previous is not None and _current(task, previous) else None


def _alternatives(
    task: Task, tuned: dict, log: TuningLog, fingerprint: str, previous: dict | None
) -> list[dict]:
    """A task's configs to time in the model beside its tuned config and its default: the
    `previous` choice, then, for a task of several algorithms, the tuned algorithm at its
    template's default knobs and each other algorithm's fastest config measured alone; each
    only where it is another config."""
    configs = [previous] if previous is not None else []
    if task.algorithms:
        configs += _algorithm_alternatives(task, tuned, log, fingerprint)
    seen = {config_key(tuned), config_key(task.default_config())}
    kept = []
    for config in configs:
        if config_key(config) not in seen:
            seen.add(config_key(config))
            kept.append(config)
    return kept


def _algorithm_alternatives(task: Task, tuned: dict, log: TuningLog, fingerprint: str):
    """The tuned algorithm at its template's default knobs, then each other algorithm's
    fastest config measured alone."""
    algorithm = tuned.get(ALGORITHM) or DIRECT
    configs = [task.algorithm_default(algorithm)]
    alone = sorted(
        (r for r in log.records(task.key, fingerprint) if r.ok and not r.in_model),
        key=lambda r: r.cost,
    )
    for other in task.algorithms:
        if other != algorithm:
            ran = (r for r in alone if (r.config.get(ALGORITHM) or DIRECT) == other)
            fastest = next((r.config for r in ran if _current(task, r)), None)
            configs += [fastest] if fastest is not None else []
    return configs


def _current(task: Task, record) -> bool:
    """Whether a record's config is one the task's template builds today (a record of an
    older template version, or of knob values since dropped, is not)."""
    if (record.template, record.template_version) != (task.template, task.template_version):
        return False
    return task.builds(record.config)


def _alternatives_build(graph: Graph, target: Target, alternatives, k: int, threads):
    """The model built with each task's k-th alternative config (see `_alternatives`), every
    other task at its default."""
    from compiler_core.compiler import compile_graph

    configs = {key: configs[k] for key, configs in alternatives.items() if len(configs) > k}
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
