"""A compile job's tuning, fanned out: one Celery task per workload, on the job's queue.

In its tuning stage a job records its workloads in the ledger, each with its share of the
budget (its estimated share of the model's time: occurrences x FLOPs; what a workload whose
search converged early leaves goes to the next one claimed), sends one
`kiln.tune_workload` message per workload to its own queue (so a tuned GPU job's workloads
reach GPU workers only), and then works through them as well: it claims a pending workload
and tunes it itself, or waits for those other workers hold. A claim is an atomic update of
the workload's ledger entry, so a workload has one owner; the owner renews its lease every
heartbeat, and a workload whose lease runs out (its worker died) is claimed again by whoever
comes next, which resumes from the shared log without re-measuring a recorded config. The
job never waits on a message no worker is free to take: on one worker (the embedded
default, one process) it tunes every workload itself and the messages, taken later, find
them ended.

Every tuner writes to the shared log (Redis, or the local JSONL file, which takes concurrent
appends), and each starts warm from the records of the others (transfer). Workers measure
on their own machine: several tuning processes on one host would time each other's noise,
so a host runs one (`worker_concurrency` 1) per device.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import time
from collections.abc import Callable

from tuner_workers.ledger import TERMINAL, TUNING_ENDED, Ledger
from tuner_workers.service import (
    JobRun,
    JobStopped,
    compiler_version,
    owner_is_dead,
    process_owner,
    renewing,
)

log = logging.getLogger("kiln.worker")

Send = Callable[[str, str], None]  # (job id, workload key): one tune_workload message

# Graphs' tasks a worker has rebuilt from a job's model, by (model, shapes, target): the
# messages of one job arrive together, and a task's lowering is worth keeping.
_TASK_CACHE: dict[tuple, dict] = {}
TASK_CACHE_SIZE = 2


def budget_shares(tasks, trials: int | None, seconds: float | None) -> list[dict]:
    """Each task's ledger entry: its share of `trials` or of `seconds`, in proportion to
    occurrences x FLOPs. Every task gets a trial (its first measurement is what the estimated
    latency needs) when the trials allow; the rest go by largest remainders, so that the
    shares add up to the budget. A time share is never zero: a task's first batch runs."""
    weights = [task.weight * task.flops for task in tasks]
    total = sum(weights) or 1.0
    fractions = [w / total for w in weights]
    trial_shares: list = [None] * len(tasks)
    if trials:
        first = 1 if trials >= len(tasks) else 0
        rest = _largest_remainders(trials - first * len(tasks), fractions)
        trial_shares = [first + share for share in rest]
    entries = []
    for index, (task, fraction, share) in enumerate(
        zip(tasks, fractions, trial_shares, strict=True)
    ):
        entries.append({
            "key": task.key, "index": index, "workload": task.workload,
            "weight": task.weight, "flops": task.flops, "trials_budget": share,
            "seconds_budget": seconds * fraction if seconds else None,
        })  # fmt: skip
    return entries


def _largest_remainders(total: int, fractions: list[float]) -> list[int]:
    exact = [total * f for f in fractions]
    shares = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda k: shares[k] - exact[k])
    for k in by_remainder[: total - sum(shares)]:
        shares[k] += 1
    return shares


def tune_job(run: JobRun, graph, target, request: dict, settings, send: Send | None = None):
    """The job's tuning stage: record the workloads, fan them out, tune and wait until every
    one has ended. Returns the log to build with, or None for an untuned build."""
    from compiler_core.autotune.measure import Measurer
    from compiler_core.autotune.records import open_log
    from compiler_core.autotune.tasks import extract_tasks

    trials, seconds = request.get("trials"), request.get("time_budget")
    if not trials and not seconds:
        run.stage("tuning", progress={"tasks_done": 0, "tasks_total": 0}, tuned=False)
        return None
    tasks = extract_tasks(graph, target)
    run.stage("tuning", progress={"tasks_done": 0, "tasks_total": len(tasks)}, tuned=True)
    tuning_log = open_log(settings.resolved_tuning_log)
    # Made first: a target this worker cannot measure on fails the job here, saying so.
    with Measurer(target) as measurer:
        entries = run.ledger.add_tuning_tasks(run.job["id"], budget_shares(tasks, trials, seconds))
        if send is not None:
            for entry in entries:
                if entry["status"] not in TUNING_ENDED:
                    send(run.job["id"], entry["key"])
        JobTuning(run, {t.key: t for t in tasks}, tuning_log, measurer, settings).run()
        if not target.is_gpu:
            check_job_in_model(run, graph, target, tasks, tuning_log, measurer)
    return tuning_log


def check_job_in_model(run: JobRun, graph, target, tasks, tuning_log, measurer) -> None:
    """Once every workload has ended: time the tuned ones inside the model, tuned and
    untuned (`check_in_model`), so the build keeps a default, or what it applied before this
    search, that runs faster there; an `in_model` event says what was checked and which
    tasks keep their default or their earlier choice."""
    from compiler_core.autotune.in_model import check_in_model

    run.check()
    timings = check_in_model(graph, target, tasks, tuning_log, measurer, compiler_version())
    run.event(
        "in_model",
        checked=len(timings),
        kept_default=[
            {
                "task": tasks.index(t.task),
                "workload": t.task.workload,
                "tuned_ms": round(t.tuned_ms, 4),
                "default_ms": round(t.default_ms, 4),
            }
            for t in timings
            if t.kept_default
        ],
        kept_previous=[tasks.index(t.task) for t in timings if t.kept_previous],
    )


class JobTuning:
    """The job's side: tune what nobody holds, report progress, wait for the rest."""

    def __init__(self, run: JobRun, tasks: dict, tuning_log, measurer, settings):
        self.job_run, self.tasks, self.log = run, tasks, tuning_log
        self.measurer, self.settings = measurer, settings
        self.ledger: Ledger = run.ledger
        self.job_id = run.job["id"]
        self._reported: dict[str, tuple] = {}

    def run(self) -> None:
        while True:
            self.job_run.check()
            entries = self.ledger.tuning_tasks(self.job_id)
            self.report(entries)
            if all(e["status"] in TUNING_ENDED for e in entries):
                return
            claimable = [e for e in entries if self._claimable(e)]
            if claimable:
                key = claimable[0]["key"]
                tune_workload(
                    self.ledger,
                    self.settings,
                    self.job_id,
                    key,
                    self.tasks[key],
                    self.log,
                    self.measurer,
                    owner=self.job_run.owner,
                    on_batch=self.report,
                )
            else:
                time.sleep(self.settings.heartbeat_seconds)

    def _claimable(self, entry: dict) -> bool:
        """Pending, or held by a worker that is gone: a dead process on this host (a job
        taken up after its worker was killed), or a lease run out."""
        if entry["status"] == "pending":
            return True
        lapsed = time.time() - entry.get("heartbeat", 0) > self.settings.job_lease_seconds
        gone = owner_is_dead(entry.get("owner")) or lapsed
        return entry["status"] == "running" and gone

    def report(self, entries: list[dict] | None = None) -> None:
        """A `tuning` event for every workload whose trials or status changed since the last
        report, and the job's progress: k/n workloads ended, the estimated model latency."""
        from compiler_core.autotune.search import estimated_time

        self.job_run.check()
        entries = entries if entries is not None else self.ledger.tuning_tasks(self.job_id)
        done = sum(1 for e in entries if e["status"] in TUNING_ENDED)
        estimate = estimated_time((e["weight"], e.get("best_cost")) for e in entries)
        estimated_ms = None if estimate is None else round(estimate * 1000, 4)
        progress = {"tasks_done": done, "tasks_total": len(entries), "estimated_ms": estimated_ms}
        self.ledger.update_job(self.job_id, progress=progress)
        for entry in entries:
            seen = (entry["trials"], entry["status"])
            if self._reported.get(entry["key"], (0, "pending")) == seen:
                continue
            self._reported[entry["key"]] = seen
            self.job_run.event(
                "tuning",
                task=entry["index"],
                workload=entry["workload"],
                status=entry["status"],
                worker=entry.get("owner"),
                trials=entry["trials"],
                best_gflops=entry.get("best_gflops", 0.0),
                tasks_done=done,
                tasks_total=len(entries),
                estimated_ms=estimated_ms,
                **({"error": entry["error"]} if entry.get("error") else {}),
            )


def tune_workload(
    ledger: Ledger,
    settings,
    job_id: str,
    key: str,
    task,
    tuning_log,
    measurer,
    *,
    owner: str | None = None,
    on_batch: Callable[[], None] | None = None,
) -> dict | None:
    """Claim workload `key` of job `job_id` and tune it within what is left of its budget;
    its final ledger entry, or None when it was not this owner's to tune (ended, or held by
    a live owner). An error in the search ends the workload failed, with the error; the job
    goes on (it builds the default schedule where the log has no record)."""
    from compiler_core.autotune.search import Tuner

    owner = owner or process_owner()
    job = ledger.get_job(job_id)
    if job is None or job["status"] in TERMINAL:
        return None
    current = ledger.get_tuning_task(job_id, key) or {}
    lease = 0.0 if owner_is_dead(current.get("owner")) else settings.job_lease_seconds
    entry = ledger.claim_tuning_task(job_id, key, owner, lease)
    if entry is None:
        return None
    entry = _with_spare(ledger, job_id, key, owner, entry)
    trials_left = None
    if entry["trials_budget"] is not None:
        trials_left = max(entry["trials_budget"] - entry["trials"], 0)
    spent = entry.get("seconds", 0.0)
    seconds_left = None
    if entry["seconds_budget"] is not None:
        seconds_left = max(entry["seconds_budget"] - spent, 0.0)
    started = time.monotonic()

    def progress(tuner, state) -> None:
        stopped = _job_ended(ledger, job_id)
        fields = _state_fields(state, entry["trials"])
        fields["seconds"] = round(spent + time.monotonic() - started, 3)
        if ledger.update_tuning_task(job_id, key, owner, **fields) is None or stopped:
            raise JobStopped()  # taken over, or the job was cancelled
        if on_batch is not None:
            on_batch()

    log.info("job %s: tuning %s (%s)", job_id, entry["workload"], owner)
    try:
        # A batch of Winograd candidates takes longer than a lease: renew it meanwhile.
        renew = functools.partial(ledger.update_tuning_task, job_id, key, owner)
        with renewing(renew, settings.heartbeat_seconds, "kiln-tuning-lease"):
            tuner = Tuner([task], measurer.target, tuning_log, measurer,
                          compiler_version=compiler_version())  # fmt: skip
            if trials_left != 0 and (seconds_left is None or seconds_left > 0):
                tuner.run(trials_left, seconds_left, progress, retime=True)
        final = _state_fields(tuner.states[0], entry["trials"])
        final["seconds"] = round(spent + time.monotonic() - started, 3)
        ended = ledger.update_tuning_task(job_id, key, owner, status="done", **final)
        if ended is not None:  # what the converged search left, for the workloads to come
            unused_trials = trials_left - tuner.states[0].trials if trials_left else 0
            unused_seconds = seconds_left - (time.monotonic() - started) if seconds_left else 0
            ledger.give_spare(job_id, max(unused_trials, 0), max(unused_seconds, 0.0))
    except JobStopped:
        raise
    except Exception as err:  # noqa: BLE001 - recorded on the workload; the job goes on
        log.exception("job %s: tuning %s failed", job_id, entry["workload"])
        error = f"{type(err).__name__}: {err}"
        ended = ledger.update_tuning_task(job_id, key, owner, status="failed", error=error)
    if on_batch is not None:
        on_batch()
    return ended


def _with_spare(ledger: Ledger, job_id: str, key: str, owner: str, entry: dict) -> dict:
    """The entry with the job's spare budget (what workloads that converged early left)
    added to its own."""
    trials, seconds = ledger.take_spare(job_id)
    if not trials and not seconds:
        return entry
    budgets = {}
    if entry["trials_budget"] is not None:
        budgets["trials_budget"] = entry["trials_budget"] + trials
    if entry["seconds_budget"] is not None:
        budgets["seconds_budget"] = entry["seconds_budget"] + seconds
    return ledger.update_tuning_task(job_id, key, owner, **budgets) or entry


def _state_fields(state, trials_before: int) -> dict:
    best = state.best_cost if math.isfinite(state.best_cost) else None
    return {
        "trials": trials_before + state.trials,
        "best_cost": best,
        "best_gflops": round(state.best_gflops, 2),
    }


def _job_ended(ledger: Ledger, job_id: str) -> bool:
    job = ledger.get_job(job_id)
    return job is None or job["status"] in TERMINAL


# --- a worker's side: a tune_workload message ---------------------------------------------


def run_tune_message(ledger: Ledger, store, settings, job_id: str, key: str) -> dict | None:
    """What a worker does with a `kiln.tune_workload` message: rebuild the job's task of
    that workload from its model and tune it, if nobody has (None otherwise)."""
    from compiler_core.autotune.measure import Measurer
    from compiler_core.autotune.records import open_log
    from compiler_core.target import parse_target

    job = ledger.get_job(job_id)
    entry = ledger.get_tuning_task(job_id, key)
    if job is None or job["status"] in TERMINAL or entry is None:
        return None
    if entry["status"] in TUNING_ENDED:
        return entry
    target = parse_target(job["target"])
    task = job_tasks(store, job, target).get(key)
    if task is None:  # cannot happen for one compiler version; say so if it does
        raise ValueError(f"job {job_id}'s model has no workload {key}")
    with Measurer(target) as measurer:
        return tune_workload(
            ledger, settings, job_id, key, task, open_log(settings.resolved_tuning_log), measurer
        )


def job_tasks(store, job: dict, target) -> dict:
    """Workload key -> task of a job's model, as its compile job extracts them."""
    from compiler_core.autotune.tasks import extract_tasks
    from compiler_core.frontend.onnx import import_model
    from compiler_core.passes.pipeline import optimize

    cache_key = (job["model_digest"], json.dumps(job.get("shapes"), sort_keys=True), job["target"])
    if cache_key not in _TASK_CACHE:
        model = store.get_blob(job["model_digest"])
        graph = optimize(import_model(model, shapes=job.get("shapes") or None), target=target)
        while len(_TASK_CACHE) >= TASK_CACHE_SIZE:
            _TASK_CACHE.pop(next(iter(_TASK_CACHE)))
        _TASK_CACHE[cache_key] = {task.key: task for task in extract_tasks(graph, target)}
    return _TASK_CACHE[cache_key]
