"""Apply a tuning log at build time: the best valid record per task, the default otherwise.

Records are matched by workload key and target fingerprint, and only for the template
version they were measured with: a record from other hardware or an older template is never
applied.
"""

from __future__ import annotations

import logging

from compiler_core.autotune.records import TuningLog, open_log
from compiler_core.autotune.tasks import Task, extract_tasks
from compiler_core.graph.ir import Graph
from compiler_core.schedule.primitives import Record
from compiler_core.target import Target

log_ = logging.getLogger(__name__)


def tuned_schedules(
    graph: Graph, target: Target, tuning: str | TuningLog, fingerprint: str | None = None
) -> tuple[dict[str, list[Record]], dict[str, dict], dict[str, dict]]:
    """({group name: schedule records}, {group name: what the manifest says about it},
    {group name: the compute choices its builders must be told: its algorithm}).
    `fingerprint` (default: the target's) picks the measurements to apply; a GPU target's
    OpenCL-twin records have their own and apply only when asked for by it."""
    log = open_log(tuning)
    fingerprint = fingerprint or target.fingerprint
    chosen = []
    for task in extract_tasks(graph, target):
        best, records = _best_applicable(log, task, fingerprint)
        if best is None:
            continue
        note = {
            "schedule": "tuned",
            "template": f"{task.template}/v{task.template_version}",
            "config": best.config,
            "workload_key": task.key,
            "measured_us": round(best.cost * 1e6, 3),
            "gflops": round(best.gflops, 2),
        }
        chosen.append((task, best.config, records, note))
    return _per_group(chosen)


def configured_schedules(
    graph: Graph, target: Target, configs: dict[str, dict]
) -> tuple[dict[str, list[Record]], dict[str, dict], dict[str, dict]]:
    """As `tuned_schedules`, for explicit configs {workload key: config} instead of a log's
    best records (a config nobody measured: the in-model check's alternatives). A config the
    task's template refuses is an error here: the caller made it, no log did."""
    chosen = []
    for task in extract_tasks(graph, target):
        config = configs.get(task.key)
        if config is None:
            continue
        note = {
            "schedule": "configured",
            "template": f"{task.template}/v{task.template_version}",
            "config": config,
            "workload_key": task.key,
        }
        chosen.append((task, config, task.records(config), note))
    return _per_group(chosen)


def _per_group(chosen: list[tuple[Task, dict, list[Record], dict]]):
    """Each (task, config, schedule records, manifest note) spread over the task's groups."""
    schedules, notes, choices = {}, {}, {}
    for task, config, records, note in chosen:
        algorithm = task.choices(config)
        for group in task.groups:
            schedules[group] = records
            notes[group] = note
            if algorithm:
                choices[group] = algorithm
    return schedules, notes, choices


def _best_applicable(log: TuningLog, task: Task, fingerprint: str):
    """The fastest record whose config the task's template takes, with its schedule (None,
    None: none). A config the template refuses (a knob it no longer has, a value out of its
    range) is skipped with a warning: a log written by another version of the template, or
    edited by hand, must not fail the build."""
    for record in log.ranked(task.key, fingerprint, task.template, task.template_version):
        try:
            return record, task.records(record.config)
        except ValueError as err:
            log_.warning("a tuning record of %s not applied: %s", task.workload, err)
    return None, None
