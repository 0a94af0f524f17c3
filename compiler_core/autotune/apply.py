"""Apply a tuning log at build time: the best valid record per task, the default otherwise.

Records are matched by workload key and target fingerprint, and only for the template
version they were measured with: a record from other hardware or an older template is never
applied.
"""

from __future__ import annotations

from compiler_core.autotune.records import TuningLog, open_log
from compiler_core.autotune.tasks import extract_tasks
from compiler_core.graph.ir import Graph
from compiler_core.schedule.primitives import Record
from compiler_core.target import Target


def tuned_schedules(
    graph: Graph, target: Target, tuning: str | TuningLog, fingerprint: str | None = None
) -> tuple[dict[str, list[Record]], dict[str, dict], dict[str, dict]]:
    """({group name: schedule records}, {group name: what the manifest says about it},
    {group name: the compute choices its builders must be told: its algorithm}).
    `fingerprint` (default: the target's) picks the measurements to apply; a GPU target's
    OpenCL-twin records have their own and apply only when asked for by it."""
    log = open_log(tuning)
    fingerprint = fingerprint or target.fingerprint
    schedules, notes, choices = {}, {}, {}
    for task in extract_tasks(graph, target):
        best = log.best(task.key, fingerprint, task.template, task.template_version)
        if best is None:
            continue
        records = task.records(best.config)
        note = {
            "schedule": "tuned",
            "template": f"{task.template}/v{task.template_version}",
            "config": best.config,
            "workload_key": task.key,
            "measured_us": round(best.cost * 1e6, 3),
            "gflops": round(best.gflops, 2),
        }
        chosen = task.choices(best.config)
        for group in task.groups:
            schedules[group] = records
            notes[group] = note
            if chosen:
                choices[group] = chosen
    return schedules, notes, choices
