"""The tuner: a model-guided search over each task's schedule space, within one budget.

Per task the space is every config of its template's knobs that fits the registers (tens to
a few hundred points; a conv with several algorithms has each one's). Each round measures a
batch: the default point first, then the configs the cost model ranks fastest among a random
sample of the unvisited ones (SCORED_PER_ROUND), with an epsilon share picked at random so
the model keeps seeing the space it ranks badly. The model is retrained on every ok
measurement of the session and of the log for this target: this model's tasks, and every
other workload's records that carry their features (transfer: a model trained on ResNet's
convs ranks MobileNet's before it has measured any of them). The task scheduler gives the
next batch to the task with the largest estimated share of the model's time (occurrences x
best cost so far) that is still improving: the gradient idea of Ansor's scheduler, in its
simplest form.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Callable, Sequence

import numpy as np

from compiler_core.autotune.cost_model import CostModel
from compiler_core.autotune.features import FEATURE_COUNT, FEATURE_SET, extract
from compiler_core.autotune.measure import Measurer, Result
from compiler_core.autotune.records import TuningLog, TuningRecord
from compiler_core.autotune.tasks import Task, config_key
from compiler_core.schedule.primitives import apply
from compiler_core.target import Target

STALE_ROUNDS = 3  # batches without a 1% gain before a task stops asking for more
SCORED_PER_ROUND = 32  # unvisited configs the cost model ranks per batch (a random sample)
IMPROVEMENT = 0.99


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
    features: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    @property
    def exhausted(self) -> bool:
        return len(self.visited) >= len(self.space) or self.stale >= STALE_ROUNDS

    @property
    def best_gflops(self) -> float:
        return self.task.flops / self.best_cost / 1e9 if math.isfinite(self.best_cost) else 0.0

    def unvisited(self) -> list[dict]:
        return [c for c in self.space if config_key(c) not in self.visited]


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
    ):
        self.target, self.log, self.measurer = target, log, measurer
        # The measured device's key: a GPU target's OpenCL twin has its own.
        self.fingerprint = measurer.fingerprint
        self.batch, self.epsilon = batch, epsilon
        self.rng = random.Random(seed)
        self.model = model or CostModel(seed=seed)
        self.compiler_version = compiler_version
        self.states = [TaskState(task, task.space()) for task in tasks]
        self.trials = 0
        for state in self.states:
            self._resume(state)
        self._transfer = self._transfer_rows()
        self._retrain()  # warm: from the log alone, before this session measures anything

    @property
    def transfer(self) -> tuple[int, int]:
        """(records, workloads) of other workloads that the cost model learns from."""
        _, _, groups = self._transfer
        return len(groups), len(set(groups))

    # --- state from the log -------------------------------------------------------------

    def _resume(self, state: TaskState) -> None:
        """Configs already in the log are never measured again."""
        task = state.task
        for record in self.log.records(task.key, self.fingerprint):
            if record.template_version != task.template_version:
                continue
            state.visited.add(record.config_key)
            self._account(state, record.config, record.cost)

    def _account(self, state: TaskState, config: dict, cost: float) -> None:
        if config == state.task.default_config() and math.isfinite(cost):
            state.default_cost = cost
        if cost < state.best_cost:
            state.best_cost, state.best_config = cost, dict(config)
        state.history.append(state.best_gflops)

    # --- the loop -----------------------------------------------------------------------

    def run(
        self,
        trials: int | None = None,
        time_budget: float | None = None,
        progress: Progress | None = None,
    ) -> None:
        """Measure up to `trials` candidates in all, or until `time_budget` seconds pass."""
        deadline = time.monotonic() + time_budget if time_budget else math.inf
        limit = trials if trials is not None else math.inf
        spent = 0
        while spent < limit and time.monotonic() < deadline:
            state = self._next_task()
            if state is None:
                break
            before = state.best_cost
            measured = self.step(state, int(min(self.batch, limit - spent)))
            if not measured:
                state.stale = STALE_ROUNDS
                continue
            spent += measured
            improved = state.best_cost < before * IMPROVEMENT
            state.stale = 0 if improved or not math.isfinite(before) else state.stale + 1
            if progress is not None:
                progress(self, state)

    def step(self, state: TaskState, count: int) -> int:
        """One batch of `state`'s task: choose up to `count` unvisited configs, measure them,
        retrain the model; how many were measured (0: the space is spent)."""
        configs = self._choose(state, count)
        if configs:
            self._measure(state, configs)
            self._retrain()
        return len(configs)

    def _next_task(self) -> TaskState | None:
        live = [s for s in self.states if not s.exhausted]
        if not live:
            return None
        untouched = [s for s in live if not math.isfinite(s.best_cost) and s.trials == 0]
        if untouched:
            return untouched[0]
        return max(live, key=lambda s: s.task.weight * s.best_cost)

    def _choose(self, state: TaskState, count: int) -> list[dict]:
        unvisited = state.unvisited()
        default = state.task.default_config()
        chosen = [default] if config_key(default) not in state.visited else []
        rest = [c for c in unvisited if c != default]
        explore = max(1, round(count * self.epsilon)) if self.model.trained else count
        if self.model.trained and rest:
            # The model ranks a bounded sample: every candidate's features cost a schedule
            # application (0.3 s for a Winograd conv's), and a space has thousands of points.
            scored = rest
            if len(rest) > SCORED_PER_ROUND:
                scored = self.rng.sample(rest, SCORED_PER_ROUND)
            scores = self.model.predict(np.stack([self._features(state, c) for c in scored]))
            ranked = [scored[k] for k in np.argsort(-scores)]
            greedy = ranked[: max(count - len(chosen) - explore, 0)]
            chosen += greedy
            rest = [c for c in rest if c not in greedy]
        self.rng.shuffle(rest)
        chosen += rest[: count - len(chosen)]
        return chosen[:count]

    def _features(self, state: TaskState, config: dict) -> np.ndarray:
        key = config_key(config)
        if key not in state.features:
            state.features[key] = config_features(state.task, config)
        return state.features[key]

    def _measure(self, state: TaskState, configs: list[dict]) -> None:
        task = state.task
        results = self.measurer.measure(task, configs)
        records = [
            measured_record(
                task,
                c,
                r,
                self.measurer,
                self.compiler_version,
                self._features(state, c) if r.error == "ok" else None,
            )
            for c, r in zip(configs, results, strict=True)
        ]
        self.log.extend(records)
        for record in records:
            state.visited.add(record.config_key)
            state.trials += 1
            self.trials += 1
            self._account(state, record.config, record.cost)

    def _transfer_rows(self) -> tuple[list[np.ndarray], list[float], list[str]]:
        """(features, throughput, workload) of the log's ok records of other workloads on
        this target that carry features of the layout `extract` gives."""
        own = {state.task.key for state in self.states}
        rows, throughput, groups = [], [], []
        for record in self.log.records(fingerprint=self.fingerprint):
            if (
                record.ok
                and record.workload_key not in own
                and record.feature_set == FEATURE_SET
                and len(record.features) == FEATURE_COUNT
            ):
                rows.append(np.array(record.features, np.float32))
                throughput.append(1.0 / record.cost)
                groups.append(record.workload_key)
        return rows, throughput, groups

    def _retrain(self) -> None:
        rows, throughput, groups = (list(part) for part in self._transfer)
        for state in self.states:
            for record in self.log.records(state.task.key, self.fingerprint):
                if record.ok and record.template_version == state.task.template_version:
                    rows.append(self._features(state, record.config))
                    throughput.append(1.0 / record.cost)
                    groups.append(state.task.key)
        if rows:
            self.model.fit(np.stack(rows), np.array(throughput), groups)

    # --- what the session found ---------------------------------------------------------

    def estimated_latency(self) -> float | None:
        """Seconds of the tuned tasks in one model run (occurrences x best cost), once every
        task has a measurement; None before (a partial sum would grow as tasks are reached)."""
        costs = [min(s.best_cost, s.default_cost) for s in self.states]
        if not all(math.isfinite(c) for c in costs):
            return None
        return sum(s.task.weight * c for s, c in zip(self.states, costs, strict=True))


def config_features(task: Task, config: dict) -> np.ndarray:
    """The cost model's view of one candidate: features of its scheduled loop program."""
    return extract(apply(task.lowered_for(config).func, task.records(config)))


def measured_record(
    task: Task,
    config: dict,
    result: Result,
    measurer,
    compiler_version: str = "",
    features: np.ndarray | None = None,
) -> TuningRecord:
    """The log's record of one measurement of `task` at `config` by `measurer` (anything with
    the Measurer's `fingerprint` and `target_label`), with the candidate's features when
    given (5 significant digits: they are log-scaled counts)."""
    ok = result.error == "ok"
    kept = () if features is None else tuple(float(f"{x:.5g}") for x in features)
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
    )
