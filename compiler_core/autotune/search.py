"""The tuner: a model-guided search over each task's schedule space, within one budget.

Per task the space is every config of its template's knobs that fits the registers (tens to
a few hundred points; a conv with several algorithms has each one's). Each round measures a
batch: the configs the cost model ranks fastest among a bounded set of unvisited candidates
(SCORED_PER_ROUND: neighbours, one knob apart, of the best configs measured so far, and a
random sample of the rest), the default point while it is unmeasured, and an epsilon share
picked at random so the model keeps seeing the space it ranks badly; a task's first batch
also holds the configs that ran best on other workloads of its template (`Tuner._proven`),
which carries over what the model's features do not; once the model has been fit on many
other workloads (`Tuner._informed`), a first batch is the default and the model's top picks
of the task's whole space instead. The model is
retrained on every ok measurement of this model's tasks, on top of a prior fit once on every
other workload's records that carry their features, in the log for this target or in
read-only logs given as `transfer_from` (transfer: a model trained on ResNet's convs ranks
MobileNet's before it has measured any of them, and MobileNet's own records correct it).
The task scheduler gives each task a first
batch, the heaviest first (occurrences x FLOPs), then each next batch to the task whose
trials are expected to save the most model time (`_gradient`: occurrences x the recent and
the optimistic fall of its best cost per trial; Ansor's gradient idea) while it still
improves.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from compiler_core.autotune.cost_model import CostModel
from compiler_core.autotune.features import FEATURE_COUNT, FEATURE_SET, extract
from compiler_core.autotune.measure import Measurer, Result
from compiler_core.autotune.records import TuningLog, TuningRecord, is_number
from compiler_core.autotune.tasks import ALGORITHM, Task, config_key
from compiler_core.schedule.primitives import apply
from compiler_core.target import Target

STALE_ROUNDS = 3  # batches without a 1% gain before a task stops asking for more
SCORED_PER_ROUND = 32  # unvisited configs the cost model ranks per batch
# Of those, up to this share are neighbours (one knob changed) of the best configs measured so
# far, the rest a random sample: good configs sit near good configs, and a sample of a space
# of thousands rarely holds the few best.
NEIGHBOUR_SHARE = 0.5
NEIGHBOUR_PARENTS = 4
IMPROVEMENT = 0.99
# When the search ends, each task's few best configs and its default are timed again, in
# rounds that alternate between them: on a shared machine a config timed once in a busy
# second reads 1.5x slow (the default of encoder4's FFN output GEMM read 87 GFLOP/s in the
# search and 140 when re-timed, and a config 30% slower inside the model won), and the log's
# best is the fastest measurement of each config, so one quiet measurement each settles it.
RETIME_TOP = 3
RETIME_ROUNDS = 2
# A task's first batch also measures the configs that ran best on other workloads of its
# template (this session's and the logs' on this machine), mapped into its space: the same
# register tile, loop order and parallel axis tend to win across layers of one kind, and the
# cost model, which learns what fast programs look like, ranks another workload's space
# poorly (trained on all but one of ResNet-18's workloads, it ranks the held-out one's
# configs with a Spearman correlation of 0.2). Configs within PROVEN_MARGIN of a workload's
# best count as its proven ones; the configs proven on the most workloads come first.
PROVEN_SLOTS = 2
PROVEN_MARGIN = 0.97
# The task scheduler (`_gradient`, Ansor's idea): the fall of a task's best cost per trial
# over its last GRADIENT_WINDOW trials, weighted RECENT_SHARE against an optimistic estimate.
# It replaced "the largest occurrences x best cost", which spent batch after batch on a heavy
# task that had nothing left to gain (until 3 batches without a 1% gain) while light tasks
# kept their first batch only: replayed on MobileNetV2's measured spaces (bench.transfer
# --tables, 12 seeds, 320 trials), a cold session reached 82% of the gain the spaces hold,
# and 94% with this one (warm: 85% -> 97%). RECENT_SHARE 0.8 or a window of 4 read about
# the same; RECENT_SHARE 0.2 a little worse (93% / 94%).
GRADIENT_WINDOW = 8
RECENT_SHARE = 0.5
# A model trained on at least INFORMED_WORKLOADS other workloads is trusted with a task's
# first batch: it ranks the task's whole space (up to FIRST_SCORED configs, not a sample of
# SCORED_PER_ROUND, which holds a space's best config with a chance of 32 in the space's
# 100-600), and the batch is the default (the baseline) and its INFORMED_PICKS top picks, no
# proven configs and no random ones. Fit on a Zen 4 log of ResNet-18's 16 workloads, the
# model's first pick in each of MobileNetV2's 31 measured spaces ran at a median 95% of the
# space's best, the best of its top four at 100%. Replayed there (bench.transfer --tables,
# 12 seeds), a session warm from that log reached 95% of the final quality in 28 trials
# instead of 41 (a first batch of 4: proven configs, an epsilon share and one model pick),
# and the cold session, informed after 8 tasks, ended better (2.806 ms against 2.830).
# First batches of 2 or 4 read 33 trials; every trained model informed slowed the cold one.
INFORMED_WORKLOADS = 8
INFORMED_PICKS = 2
FIRST_SCORED = 256


@dataclasses.dataclass
class TaskState:
    task: Task
    space: list[dict]
    visited: set[str] = dataclasses.field(default_factory=set)
    best_cost: float = math.inf
    best_config: dict | None = None
    default_cost: float = math.inf
    trials: int = 0
    stale: int = 0
    history: list[float] = dataclasses.field(default_factory=list)  # best GFLOP/s after each trial
    # (cost, config) of every ok measurement: the best ones' neighbours are ranked first
    measured: list[tuple[float, dict]] = dataclasses.field(default_factory=list)
    features: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    # Whether the best configs were re-timed after the task's last search measurement.
    retimed: bool = False
    # The config builds applied when the session began (the log's best, if not the default):
    # a re-timing times it beside this session's best, whose isolated costs do not compare
    # with ones taken on another day.
    incumbent: dict | None = None

    @property
    def exhausted(self) -> bool:
        return len(self.visited) >= len(self.space) or self.stale >= STALE_ROUNDS

    @property
    def best_gflops(self) -> float:
        return self.task.flops / self.best_cost / 1e9 if math.isfinite(self.best_cost) else 0.0

    def unvisited(self) -> list[dict]:
        return [c for c in self.space if config_key(c) not in self.visited]


@dataclasses.dataclass(frozen=True)
class TransferRows:
    """What a session learns from before it measures: one row per logged record (its
    features and throughput, and its workload, which LightGBM's ranking groups by), and each
    of those workloads' template."""

    rows: list[np.ndarray]
    throughput: list[float]
    workloads: list[str]
    templates: dict[str, str]


Progress = Callable[["Tuner", TaskState], None]


class Tuner:
    def __init__(
        self,
        tasks: Sequence[Task],
        target: Target,
        log: TuningLog,
        measurer: Measurer,
        *,
        batch: int = 8,
        epsilon: float = 0.25,
        seed: int = 0,
        model: CostModel | None = None,
        compiler_version: str = "",
        transfer_from: Sequence[TuningLog] = (),
    ):
        self.target, self.log, self.measurer = target, log, measurer
        # The measured device's key: a GPU target's OpenCL twin has its own.
        self.fingerprint = measurer.fingerprint
        self.batch, self.epsilon = batch, epsilon
        self.rng = random.Random(seed)
        self.model = model or CostModel(seed=seed)
        self.compiler_version = compiler_version
        self.states = [TaskState(task, task.space()) for task in tasks]
        self._sources = tuple(transfer_from)
        # (template, version) -> the sources' `_near_best`: they are read-only
        self._source_near: dict[tuple[str, int], dict[str, list[tuple[dict, float]]]] = {}
        self.trials = 0
        self.retimings = 0  # measurements `retime` took
        self._measuring = (0, 0.0)  # (configs, seconds): the rate a re-timing is planned at
        for state in self.states:
            self._resume(state)
        self._transfer = self._transfer_rows(transfer_from)
        # workload -> its template, for every workload learnt from and the session's tasks
        self._templates = {
            **self._transfer.templates,
            **{state.task.key: state.task.template for state in self.states},
        }
        self._trained_on: set[str] = set()  # the workloads the cost model was fit on
        self._learn_prior()  # warm: from the logs alone, before this session measures anything
        self._retrain()  # a resumed session's own records

    @property
    def transfer(self) -> tuple[int, int]:
        """(records, workloads) the cost model learns from before this session measures:
        other workloads' in the log, any workload's in the logs to learn from."""
        workloads = self._transfer.workloads
        return len(workloads), len(set(workloads))

    # --- state from the log -------------------------------------------------------------

    def _resume(self, state: TaskState) -> None:
        """Configs already in the log are never measured again; the config builds apply now
        is the task's incumbent."""
        task = state.task
        for record in self.log.records(task.key, self.fingerprint):
            if record.template_version != task.template_version:
                continue
            state.visited.add(record.config_key)
            if record.in_model:  # another scale: kernel times inside the model
                continue
            state.retimed = record.retimed  # a search measurement after it wants another
            self._account(state, record.config, record.cost, record.retimed)
        best = self.log.best(task.key, self.fingerprint, task.template, task.template_version)
        if best is not None and best.config != task.default_config() and task.builds(best.config):
            state.incumbent = dict(best.config)

    def _account(self, state: TaskState, config: dict, cost: float, retimed=False) -> None:
        """One measurement of `config`; each config counts at its fastest."""
        if config == state.task.default_config() and math.isfinite(cost):
            state.default_cost = min(state.default_cost, cost)
        if math.isfinite(cost):
            state.measured.append((cost, dict(config)))
        if cost < state.best_cost:
            state.best_cost, state.best_config = cost, dict(config)
        if not retimed:
            state.history.append(state.best_gflops)

    # --- the loop -----------------------------------------------------------------------

    def run(
        self,
        trials: int | None = None,
        time_budget: float | None = None,
        progress: Progress | None = None,
        retime: bool = False,
    ) -> None:
        """Measure up to `trials` candidates in all, or until `time_budget` seconds pass;
        with `retime`, then re-time each task's best configs (`retime`): the search then
        stops early enough for that to fit the time budget too (not the trials: re-timings
        are not trials)."""
        deadline = time.monotonic() + time_budget if time_budget else math.inf
        limit = trials if trials is not None else math.inf
        spent = 0
        reserve = self._retime_seconds if retime else lambda: 0.0
        while spent < limit and time.monotonic() + reserve() < deadline:
            state = self._next_task()
            if state is None:
                break
            before = state.best_cost
            measured = self.step(state, int(min(self._batch_for(state), limit - spent)))
            if not measured:
                state.stale = STALE_ROUNDS
                continue
            spent += measured
            improved = state.best_cost < before * IMPROVEMENT
            state.stale = 0 if improved or not math.isfinite(before) else state.stale + 1
            if progress is not None:
                progress(self, state)
        if retime:
            self.retime()

    def retime(self) -> int:
        """Time each task's RETIME_TOP best configs and its default again, RETIME_ROUNDS
        rounds that alternate between them (the order reversed each round), as records of
        their own: the log's best is each config at its fastest, so a config is no longer
        judged by one measurement taken while the machine was busy. Tasks re-timed since
        their last search measurement are left alone. Returns the measurements taken."""
        taken = 0
        for state in self.states:
            if state.retimed:
                configs = []
            else:
                configs = retime_configs(state.measured, state.task, state.incumbent)
            if len(configs) > 1:
                per_config = self.measurer.measure_rounds(state.task, configs, RETIME_ROUNDS)
                for round_ in range(RETIME_ROUNDS):
                    results = [taken_by[round_] for taken_by in per_config]
                    self._record(state, configs, results, retimed=True)
                taken += RETIME_ROUNDS * len(configs)
            state.retimed = True
        self.retimings += taken
        return taken

    def _retime_seconds(self) -> float:
        """Seconds the re-timing still to come may take, at this session's measuring rate
        (an overestimate: a re-timing builds each config once for all its rounds, and a
        config measured twice counts twice here); 0 while nothing has been measured."""
        configs, seconds = self._measuring
        if not configs:
            return 0.0
        pending = sum(
            RETIME_ROUNDS * min(RETIME_TOP + 1, len(s.measured))
            for s in self.states
            if not s.retimed and len(s.measured) > 1
        )
        return pending * seconds / configs

    def _batch_for(self, state: TaskState) -> int:
        """A task's first batch: the default and the top picks of an informed model
        (`_informed`); half a batch once the model knows the task's template
        (`_knows_template`: its top picks, the default, proven configs and one at random); a
        whole batch before; each with the first points (`_first_points`) on top. A model of
        many tasks is covered sooner, and the next batches go where the gains are."""
        if state.trials:
            return self.batch
        others = len(self._first_points(state))
        if self._informed(state):
            return 1 + INFORMED_PICKS + others
        if self._knows_template(state):
            return max(self.batch // 2, 2) + others
        return self.batch + others

    def _first_points(self, state: TaskState) -> list[dict]:
        """What a task's first batch measures beside its default, unmeasured so far: the
        other algorithms' own defaults (each variant's template rules), and for each
        algorithm, every other value of its template's pivots (`Template.pivots`) at the
        config nearest its default (`_pivoted`).

        The untuned algorithm is the rules' guess, and another's default can beat it by more
        than any knob of its own: under the rule before F(4x4) took 14x14 outputs, ResNet-18's
        256-channel 14x14 3x3 conv ran Winograd F(2x2) by default at 0.49 of its space's best
        and F(4x4) at its defaults at 0.94 (Zen 4, bench.search's tables), and F(4x4)'s tile
        knob takes values F(2x2)'s default lacks, so no neighbour of the default reaches it.
        Likewise a pivot: GEMM 1024^3's first 48 trials on a Cascade Lake Xeon never measured
        packed A in the `ji` order (its default is `ij`, packed a tile at a time; `ji` packs
        at the root, two knobs away), which ran at 182 GFLOP/s against the 127 found."""
        task = state.task
        default = task.default_config()
        if task.algorithms:
            defaults = [task.algorithm_default(a) for a in task.algorithms]
            pivots = {a: v.tunable.template.pivots for a, v in task.variants.items()}
        else:
            defaults, pivots = [default], {None: task.tunable.template.pivots}
        points = [d for d in defaults if d != default]
        for point in defaults:
            for knob in pivots[point.get(ALGORITHM)]:
                points += _pivoted(point, state.space, knob)
        unique = {config_key(c): c for c in points if config_key(c) not in state.visited}
        return list(unique.values())

    def _template_workloads(self, state: TaskState) -> int:
        """Workloads of the task's template other than the task's that the cost model was
        fit on."""
        template = state.task.template
        others = self._trained_on - {state.task.key}
        return sum(1 for key in others if self._templates.get(key) == template)

    def _knows_template(self, state: TaskState) -> bool:
        """Whether the model may pick in a task's first batch: it was fit on the task's own
        records, or on another workload of its template. A model fit on other templates'
        loop programs only ranks the task's space worse than the default's neighbours do:
        on Zen 3, a session warm from ResNet-18's log (no chained convs) picked MobileNetV2's
        chained expand + depthwise tasks' first batches from the model, half a batch each,
        and held 12% of the gain the spaces hold after 24 trials where the cold session,
        which measures the default's neighbours, held 53% (bench.transfer's replay, 12
        seeds)."""
        if not self.model.trained:
            return False
        return state.task.key in self._trained_on or self._template_workloads(state) > 0

    def _informed(self, state: TaskState) -> bool:
        """Whether the cost model was fit on INFORMED_WORKLOADS workloads of the task's
        template other than the task's: from a log to learn from (transfer), or after that
        many of this session's. Workloads of other templates do not count: their loop
        programs differ, and on a Xeon a model fit on ResNet-18's convs alone picked
        MobileNetV2's chained convs' first batches at 1.24 of their best after 60 trials,
        where the default's neighbours stood at 1.01-1.02 (the warm session then took 2.55
        times the cold one's trials to 95% of the final quality)."""
        return self.model.trained and self._template_workloads(state) >= INFORMED_WORKLOADS

    def step(self, state: TaskState, count: int) -> int:
        """One batch of `state`'s task: choose up to `count` unvisited configs, measure them,
        retrain the model; how many were measured (0: the space is spent)."""
        configs = self._choose(state, count)
        if configs:
            self._measure(state, configs)
            self._retrain()
        return len(configs)

    def _next_task(self) -> TaskState | None:
        """Each task once, heaviest first (the tasks come sorted by occurrences x FLOPs);
        then the task whose next trials promise to save the most model time (`_gradient`)."""
        live = [s for s in self.states if not s.exhausted]
        if not live:
            return None
        untouched = [s for s in live if not math.isfinite(s.best_cost) and s.trials == 0]
        if untouched:
            return untouched[0]
        return max(live, key=_gradient)

    def _choose(self, state: TaskState, count: int) -> list[dict]:
        """The next batch: the configs the model ranks fastest among the candidates (when it
        knows the task's template, `_knows_template`), the default point while it is
        unmeasured, in a task's first batch its first points (`_first_points`: other
        algorithms' defaults, the pivots' other values) and the configs proven on other
        workloads of its template (`_proven`), and an epsilon share at random (before the
        model knows the template, the rest of the batch: the default's neighbours, then the
        rest of the space). An informed model (`_informed`) picks all of a task's first batch
        but the default, from the whole space."""
        default = state.task.default_config()
        default_due = config_key(default) not in state.visited
        rest = [c for c in state.unvisited() if c != default]
        informed = state.trials == 0 and self._informed(state)
        firsts = [] if state.trials else self._first_points(state)[:count]
        first_keys = {config_key(c) for c in firsts}
        rest = [c for c in rest if config_key(c) not in first_keys]
        proven = []
        if state.trials == 0 and not informed:
            # proven configs leave room in the batch for the default and one other pick
            proven = self._proven(state, rest)[: max(count - 2 - len(firsts), 0)]
        taken = {config_key(c) for c in proven}
        rest = [c for c in rest if config_key(c) not in taken]
        greedy: list[dict] = []
        knows = self._knows_template(state)
        if knows and rest:
            slots = count - int(default_due) - len(proven) - len(firsts)
            # proven configs explore beyond the model too: the model keeps one pick at least
            explore = max(1, round(count * self.epsilon)) if not (proven or informed) else 0
            budget = FIRST_SCORED if informed else SCORED_PER_ROUND
            candidates = self._candidates(state, rest, budget)
            scores = self.model.predict(np.stack([self._relative(state, c) for c in candidates]))
            ranked = [candidates[k] for k in np.argsort(-scores)]
            greedy = ranked[: max(slots - explore, 0)]
            picked = {config_key(c) for c in greedy}
            rest = [c for c in rest if config_key(c) not in picked]
        self.rng.shuffle(rest)
        if not knows:
            # No model that knows the template yet: the default's neighbours (one knob
            # changed) first, in random order. The default is the rules' pick, 66-99% of the
            # best on the workloads that bench.search measures, and good configs sit near it:
            # replayed there (15 seeds, cold), this took the median guided/random trials from
            # 0.28 to 0.22 and 0.32 to 0.14 on two seed sets, against a first batch drawn
            # from the whole space.
            rest.sort(key=lambda c: not _one_knob_apart(c, default))
        # The default is measured first, then the model's first pick: the rules' pick is the
        # better single guess (Zen 4: 97-99% of the best on four of bench.search's five
        # workloads, a median 99% on MobileNetV2's 25 tasks, where a model fit on ResNet-18's
        # log put its first pick at a median 95%), and a warm session whose model is
        # measured first takes a trial more than a cold one wherever the default is enough.
        chosen = ([default] if default_due else []) + greedy[:1] + firsts + proven + greedy[1:]
        chosen += rest[: count - len(chosen)]
        return chosen[:count]

    def _proven(self, state: TaskState, rest: list[dict]) -> list[dict]:
        """Configs of `rest` that ran within PROVEN_MARGIN of the best on other workloads of
        the task's template and version, on this machine (in the log or the logs to learn
        from), each mapped into the task's space (`_project`); the ones proven on the most
        workloads first, ties broken by how near their workloads' bests they ran (the sum of
        best / cost). At most PROVEN_SLOTS."""
        task = state.task
        if not rest:
            return []
        template = (task.template, task.template_version)
        if template not in self._source_near:  # read-only: read once per template
            self._source_near[template] = {}
            for log in self._sources:
                self._source_near[template].update(self._near_best(log, *template))
        near_best = {**self._source_near[template], **self._near_best(self.log, *template)}
        kinds = _kinds(state.space)
        index = {config_key(c): c for c in rest}
        votes: dict[str, tuple[int, float]] = {}
        for workload, near in near_best.items():
            if workload == task.key:
                continue
            shares: dict[str, float] = {}  # a workload votes once for each config
            for config, share in near:
                projected = _project(config, kinds)
                key = config_key(projected) if projected is not None else None
                if key in index:
                    shares[key] = max(shares.get(key, 0.0), share)
            for key, share in shares.items():
                count, total = votes.get(key, (0, 0.0))
                votes[key] = (count + 1, total + share)
        ordered = sorted(votes, key=lambda key: votes[key], reverse=True)
        return [index[key] for key in ordered[:PROVEN_SLOTS]]

    def _near_best(
        self, log: TuningLog, template: str, version: int
    ) -> dict[str, list[tuple[dict, float]]]:
        """Per workload of `template` in `log` on this machine: its configs within
        PROVEN_MARGIN of its best, each with best / cost."""
        records = log.records(fingerprint=self.fingerprint)
        workloads = {r.workload_key for r in records if r.template == template}
        near_best = {}
        for workload in sorted(workloads):
            ranked = log.ranked(workload, self.fingerprint, template, version)
            shares = [(r.config, ranked[0].cost / r.cost) for r in ranked]
            near_best[workload] = [(c, share) for c, share in shares if share >= PROVEN_MARGIN]
        return near_best

    def _candidates(self, state: TaskState, rest: list[dict], budget: int) -> list[dict]:
        """What the model ranks this batch (at most `budget`: every candidate's features
        cost a schedule application, 5-30 ms, and they are kept for the session): neighbours
        of the best configs measured so far, then a random sample of the rest of the
        unvisited space."""
        parents = [config for _, config in sorted(state.measured, key=lambda m: m[0])]
        parents = parents[:NEIGHBOUR_PARENTS]
        near = [c for c in rest if any(_one_knob_apart(c, p) for p in parents)]
        self.rng.shuffle(near)
        candidates = near[: int(budget * NEIGHBOUR_SHARE)]
        taken = {config_key(c) for c in candidates}
        others = [c for c in rest if config_key(c) not in taken]
        candidates += self.rng.sample(others, min(budget - len(candidates), len(others)))
        return candidates

    def _features(self, state: TaskState, config: dict) -> np.ndarray:
        key = config_key(config)
        if key not in state.features:
            state.features[key] = config_features(state.task, config)
        return state.features[key]

    def _relative(self, state: TaskState, config: dict) -> np.ndarray:
        """What the cost model reads: `config`'s features less its task's default's
        (`relative_features`)."""
        default = self._features(state, state.task.default_config())
        return relative_features(self._features(state, config), default)

    def _measure(self, state: TaskState, configs: list[dict]) -> None:
        started = time.monotonic()
        results = self.measurer.measure(state.task, configs)
        count, seconds = self._measuring
        self._measuring = (count + len(configs), seconds + time.monotonic() - started)
        self._record(state, configs, results)

    def _record(
        self, state: TaskState, configs: list[dict], results: list[Result], retimed=False
    ) -> None:
        """Log one measurement of each config and account for it."""
        task = state.task
        records = [
            measured_record(
                task,
                c,
                r,
                self.measurer,
                self.compiler_version,
                self._features(state, c) if r.error == "ok" else None,
                retimed,
            )
            for c, r in zip(configs, results, strict=True)
        ]
        self.log.extend(records)
        for record in records:
            state.visited.add(record.config_key)
            if not retimed:
                state.trials += 1
                self.trials += 1
                state.retimed = False
            self._account(state, record.config, record.cost, retimed)

    def _transfer_rows(self, sources: Sequence[TuningLog]) -> TransferRows:
        """What to learn from before measuring anything: the ok records on this target,
        with features of the layout `extract` gives, of other workloads in the session's log,
        and of every workload (this session's too) in the read-only `sources`. (This
        session's records in its own log are trained on as they are measured: `_retrain`.)"""
        own = {state.task.key for state in self.states}
        seen = set()  # a record in two of the logs counts once
        learnable: dict[str, list[TuningRecord]] = {}  # by workload
        for log in (self.log, *sources):
            for record in log.records(fingerprint=self.fingerprint):
                identity = (record.workload_key, record.config_key, record.timestamp)
                if identity in seen:
                    continue
                seen.add(identity)
                if log is self.log and record.workload_key in own:
                    continue
                if (
                    record.ok
                    and record.feature_set == FEATURE_SET
                    and len(record.features) == FEATURE_COUNT
                ):
                    learnable.setdefault(record.workload_key, []).append(record)
        rows, throughput, groups, templates = [], [], [], {}
        for workload, records in learnable.items():
            # Each config is read against its workload's default: a workload whose default
            # was never measured (an older log, a log of best records only) has no reference.
            reference = next((r.features for r in records if r.default), None)
            if reference is None:
                continue
            for record in records:
                rows.append(relative_features(record.features, reference))
                throughput.append(1.0 / record.cost)
                groups.append(workload)
            templates[workload] = records[0].template
        return TransferRows(rows, throughput, groups, templates)

    def _learn_prior(self) -> None:
        """The cost model's prior (`CostModel.learn_prior`): what the records learnt from
        before measuring (`_transfer_rows`) say, which the session's own records correct."""
        transfer = self._transfer
        if transfer.rows:
            rows, throughput = np.stack(transfer.rows), np.array(transfer.throughput)
            if self.model.learn_prior(rows, throughput, transfer.workloads):
                self._trained_on = set(self.model.prior_groups)

    def _retrain(self) -> None:
        """Fit the cost model on the session's records (on top of the prior, if any)."""
        rows, throughput, groups = [], [], []
        for state in self.states:
            for record in self.log.records(state.task.key, self.fingerprint):
                if record.ok and record.template_version == state.task.template_version:
                    rows.append(self._relative(state, record.config))
                    throughput.append(1.0 / record.cost)
                    groups.append(state.task.key)
        if rows and self.model.fit(np.stack(rows), np.array(throughput), groups):
            self._trained_on = set(groups) | self.model.prior_groups

    # --- what the session found ---------------------------------------------------------

    def estimated_latency(self) -> float | None:
        """Seconds of the tuned tasks in one model run: see `estimated_time`."""
        return estimated_time(
            (s.task.weight, min(s.best_cost, s.default_cost)) for s in self.states
        )


def retime_configs(
    measured: Iterable[tuple[float, dict]],
    task: Task,
    incumbent: dict | None = None,
    top: int = RETIME_TOP,
) -> list[dict]:
    """What a re-timing times again: the `top` fastest of the `measured` (cost, config)
    pairs, each config at its fastest measurement, the task's default when it was measured,
    and the `incumbent` (what builds applied when the session began), measured or not (the
    tuner's `retime`; bench's replay tables are re-timed alike)."""
    fastest: dict[str, tuple[float, dict]] = {}
    for cost, config in measured:
        key = config_key(config)
        if key not in fastest or cost < fastest[key][0]:
            fastest[key] = (cost, config)
    ranked = [config for _, config in sorted(fastest.values(), key=lambda m: m[0])]
    chosen = ranked[:top]
    default = task.default_config()
    if config_key(default) in fastest and default not in chosen:
        chosen.append(default)
    if incumbent is not None and config_key(incumbent) not in map(config_key, chosen):
        chosen.append(dict(incumbent))
    return chosen


def _gradient(state: TaskState) -> float:
    """Seconds of model time a trial of this task is expected to save: its occurrences x the
    fall of its best cost per trial, blending the fall over its last GRADIENT_WINDOW trials
    (what its search achieves now) with an optimistic one, best / trials (a search's best
    keeps falling about like 1/t until it converges)."""
    trials = len(state.history)  # best GFLOP/s after each trial
    if not trials or not math.isfinite(state.best_cost):
        return 0.0  # every config measured so far failed: more of the same promises nothing
    steps = min(GRADIENT_WINDOW, trials - 1)
    before = state.history[trials - 1 - steps]  # the best, `steps` trials ago
    recent = 0.0
    if steps and before > 0:
        recent = (state.task.flops / (before * 1e9) - state.best_cost) / steps
    optimistic = state.best_cost / trials
    return state.task.weight * (RECENT_SHARE * recent + (1 - RECENT_SHARE) * optimistic)


def estimated_time(tasks: Iterable[tuple[int, float | None]]) -> float | None:
    """Seconds of tuned tasks in one model run, from (occurrences, best cost) per task, once
    every task has a measurement; None before (a partial sum would grow as tasks are
    reached), or for no tasks."""
    tasks = list(tasks)
    if not tasks or not all(cost is not None and math.isfinite(cost) for _, cost in tasks):
        return None
    return sum(weight * cost for weight, cost in tasks)


def _kinds(space: Sequence[dict]) -> dict[tuple, tuple[dict[str, list], list[dict]]]:
    """A space's configs by kind (`_kind`), each kind with the values each knob takes."""
    kinds: dict[tuple, list[dict]] = {}
    for config in space:
        kinds.setdefault(_kind(config), []).append(config)
    return {
        kind: ({knob: list({c[knob]: None for c in configs}) for knob in kind[1]}, configs)
        for kind, configs in kinds.items()
    }


def _kind(config: dict) -> tuple:
    """The algorithm a config runs (None: a workload with one) and its knobs' names: a
    Winograd variant has its own tile knobs, and a conv that can run Winograd (3x3, stride
    1) is another kind of layer than one that cannot (a 1x1 conv)."""
    return (config.get(ALGORITHM), tuple(sorted(config)))


def _project(config: dict, kinds: dict[tuple, tuple[dict[str, list], list[dict]]]) -> dict | None:
    """The config of this space nearest to `config`: each numeric knob the space cannot
    take moved to the nearest value it can (another layer's 28-pixel row tile onto a
    14-pixel row: 14); where that breaks a rule of the space (a register tile too wide for
    the blocks it holds), the config one knob away from it with the nearest values. None
    when the space has no configs of its kind, or when a knob takes a name the space lacks
    or differs from a knob the space fixes to one value: the config comes from another kind
    of layer (a 1x1 conv's 2-block tiles say nothing of a depthwise conv's, which hold one)."""
    if _kind(config) not in kinds:
        return None
    domains, configs = kinds[_kind(config)]
    clamped = {}
    for knob, value in config.items():
        values = domains[knob]
        if value in values:
            clamped[knob] = value
            continue
        numbers = [v for v in values if is_number(v)]
        if not is_number(value) or len(values) < 2 or not numbers:
            return None
        clamped[knob] = min(numbers, key=lambda v: (abs(v - value), v))
    if clamped in configs:
        return clamped
    near = [c for c in configs if sum(c[k] != clamped[k] for k in c) == 1]
    return min(near, key=lambda c: _distance(c, clamped), default=None)


def _distance(a: dict, b: dict) -> float:
    """How far apart two configs of one kind are: relative differences of numeric knobs,
    1 for each name that differs."""
    return sum(
        abs(a[k] - b[k]) / max(abs(a[k]), abs(b[k]), 1)
        if is_number(a[k]) and is_number(b[k])
        else float(a[k] != b[k])
        for k in a
    )


def _pivoted(point: dict, space: Sequence[dict], knob: str) -> list[dict]:
    """For each value of `knob` other than `point`'s: the config of `space` (of `point`'s
    algorithm) with that value that differs from `point` in the fewest knobs, the first in
    the space's order among ties (another knob may have to follow the pivot to fit)."""
    if knob not in point:
        return []
    algorithm = point.get(ALGORITHM)
    same = [c for c in space if c.keys() == point.keys() and c.get(ALGORITHM) == algorithm]
    values = list(dict.fromkeys(c[knob] for c in same if c[knob] != point[knob]))
    return [
        min((c for c in same if c[knob] == value), key=lambda c: _knobs_apart(c, point))
        for value in values
    ]


def _knobs_apart(a: dict, b: dict) -> int:
    return sum(a[k] != b[k] for k in a)


def _one_knob_apart(a: dict, b: dict) -> bool:
    """Configs of the same knobs (the same algorithm) that differ in exactly one."""
    return a.keys() == b.keys() and _knobs_apart(a, b) == 1


def config_features(task: Task, config: dict) -> np.ndarray:
    """Features of one candidate's scheduled loop program (what the log keeps)."""
    return extract(apply(task.lowered_for(config).func, task.records(config)))


def relative_features(features: Sequence[float], default: Sequence[float]) -> np.ndarray:
    """The cost model's view of a candidate: its features less those of its task's default
    config. The features are log-scaled counts, so this is how a config's loop program
    differs from the rules' pick, in ratios (twice the register tile, a tenth of the cache
    misses), which carries from one workload to another where the counts themselves, set by
    each workload's size, do not: a model fit on ResNet-18's records ranked MobileNetV2's
    spaces (Zen 4, bench.transfer's tables) with its first pick at a median 0.81 of each
    space's best on the counts, 0.95 on the differences, and fit on all but one of
    MobileNetV2's own tasks, the default and its two top picks held 33% of the gain the
    spaces hold on the counts, 59% on the differences."""
    return np.asarray(features, np.float32) - np.asarray(default, np.float32)


def measured_record(
    task: Task,
    config: dict,
    result: Result,
    measurer,
    compiler_version: str = "",
    features: np.ndarray | None = None,
    retimed: bool = False,
) -> TuningRecord:
    """The log's record of one measurement of `task` at `config` by `measurer` (anything with
    the Measurer's `fingerprint` and `target_label`), with the candidate's features when
    given (5 significant digits: they are log-scaled counts); `retimed`: a repeat taken by
    `Tuner.retime`."""
    ok = result.error == "ok"
    kept = () if features is None else tuple(float(f"{x:.5g}") for x in features)
    default = config == task.default_config()
    return TuningRecord(
        workload_key=task.key,
        workload=task.workload,
        target=measurer.target_label,
        fingerprint=measurer.fingerprint,
        template=task.template,
        template_version=task.template_version,
        config=dict(config),
        costs=tuple(result.costs) if ok else (),
        error=result.error,
        error_detail=result.detail,
        flops=task.flops,
        compiler_version=compiler_version,
        timestamp=time.time(),
        features=kept,
        feature_set=FEATURE_SET if kept else "",
        retimed=retimed,
        default=default,
    )
