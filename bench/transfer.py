"""Transfer, measured live: tuning a model cold, and warm from another model's tuning log.

    .venv/bin/kiln tune ../shared/models/resnet18.onnx --time-budget 12m \
        --log build/tuning/resnet18.jsonl                      # once per machine: the source
    .venv/bin/python -m bench.transfer [--model mobilenet_v2] [--source build/tuning/resnet18.jsonl]
                                       [--trials 320] [--seeds 1] [--keep-logs DIR]
    .venv/bin/python -m bench.transfer --from-logs DIR    # the readings of kept sessions again
    .venv/bin/python -m bench.transfer --tables DIR --measure  # every config of the model, once
    .venv/bin/python -m bench.transfer --tables DIR --seeds 10 # replayed sessions

Both sessions are the tuner as `kiln tune` runs it (real measurements, the same trial budget
and seed), each on a fresh log of its own; the warm one also learns from `--source` (read
only: `Tuner(transfer_from=...)`, `kiln tune --transfer-from`: its records train the cost
model, and the configs proven on its workloads join each task's first batch), which must
hold records of this machine with their features: a whole tuning session's log (the
committed `bench/tuning/` logs keep only each workload's best record, too few to learn
from). The two sessions run side by side, a batch of one then a batch of the other, so
that both measure on the same machine: a shared one drifts by several percent over the
minutes a session takes.

Quality after t trials: the tuned kernels' estimated time in one model run, L(t) = sum over
tasks of occurrences x the best cost measured so far (a task not reached yet counts at its
default's cost, measured when it is reached), each config at its fastest measurement in
either session (as the tuner counts a config at its fastest). Two readings of "95% of the
final quality", each against the better of the two sessions' final L:
- speed: the first t with L(t) <= L_final / 0.95;
- gain: the first t with L(t) <= L(0) - 0.95 (L(0) - L_final), L(0) all defaults;
and in a replay, where the optimum L* (every task at its fastest config) is known:
- optimum: the first t with L(t) <= L(0) - 0.95 (L(0) - L*);
and the share of that gain, (L(0) - L(t)) / (L(0) - L*), each session holds after
CHECKPOINTS trials (`captured`). Issue 9 asks the warm session to get there in at most half
the cold one's trials. A replay also reads each task's gain (its default over its table's
fastest config) against its table's own noise (`task_gains`: how far the repeated timings of
one config spread), and says what share of the spaces' gain lies in tasks whose gain is
within it: a gain that repeated timings of one config cover is the luck of a measurement,
which no search, warm or cold, can learn to find.

Replay (`--tables DIR`): live sessions take 3-4 minutes a seed and see the machine drift, so
a change to the search reads through the noise only over many seeds. `--measure` times every
config of every task of the model once (the tuner's Measurer, `bench.search`'s tables: about
1800 configs, ~10 minutes for mobilenet_v2), then each task's default and three fastest
again, in two passes over the tables (a busy stretch can outlast one task's re-timing), as
the tuner re-times its best (a table keeps each config at its fastest; `--measure` on
measured tables re-times them once more); the
sessions then run the tuner unchanged but answer each trial from those tables
(`ReplayMeasurer`), so that two versions of the search are compared on the same costs, and
many seeds take minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.run import cpu_name
from bench.search import (
    ReplayMeasurer,
    fastest_records,
    measure_tables,
    read_table,
    retime_tables,
)
from compiler_core.autotune.measure import Measurer
from compiler_core.autotune.records import FileLog, TuningRecord
from compiler_core.autotune.search import Tuner, config_features
from compiler_core.autotune.tasks import Task, config_key, extract_tasks
from compiler_core.compiler import COMPILER_VERSION
from compiler_core.frontend.onnx import import_model
from compiler_core.passes.pipeline import optimize
from compiler_core.target import host_target
from tests.conftest import shared_model

GOAL = 0.95
SETTLE_SECONDS = 2.0
KINDS = ("cold", "warm")
# Trials after which a replay reads the share of the spaces' gain each session holds: where
# the defaults stand within a few percent of the optimum (MobileNetV2 on Zen 4: 98.6%), the
# readings above come at the budget's end or never, and the whole curve says more.
CHECKPOINTS = (24, 48, 96, 160, 240, 320)


def tune_sessions(
    tasks: list[Task],
    trials: int,
    seed: int,
    source: Path,
    keep: Path | None = None,
    replay: Replay | None = None,
) -> dict[str, list]:
    """Tune `tasks` twice from fresh logs, cold and warm (learning from `source` first),
    alternating batches so that both see the same machine (a shared one drifts by several
    percent over minutes); each session's records in the order they were measured. `keep`:
    a folder to copy the two logs to (`session_logs` reads them back). `replay`: answer the
    trials from measured tables instead of measuring."""
    target = host_target()
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kiln-transfer-")))
        tuners = {}
        for kind, sources in (("cold", []), ("warm", [FileLog(source)])):
            live = replay is None
            measurer = stack.enter_context(Measurer(target)) if live else replay.measurer
            log = stack.enter_context(FileLog(tmp / f"{kind}.jsonl"))
            tuners[kind] = Tuner(
                tasks, target, log, measurer, seed=seed,
                compiler_version=COMPILER_VERSION, transfer_from=sources,
            )  # fmt: skip
            if replay is not None:
                for state in tuners[kind].states:
                    state.features.update(replay.features[state.task.key])
        records, workloads = tuners["warm"].transfer
        if not records:
            raise SystemExit(
                f"{source}: no records with features for this machine (of workloads whose "
                "default config was measured: logs older than the record's `default` flag "
                "have none)"
            )
        print(f"  seed {seed}: warm learns first from {records} records of {workloads} workloads")
        started = time.monotonic()
        while any(t.trials < trials for t in tuners.values()):
            progressed = False
            for tuner in tuners.values():
                before = tuner.trials
                if before < trials:
                    tuner.run(trials=min(tuner.batch, trials - before))
                progressed |= tuner.trials > before
            if not progressed:
                break  # every task of both sessions has converged
        print(
            f"  seed {seed}: cold {tuners['cold'].trials}, warm {tuners['warm'].trials} trials "
            f"in {time.monotonic() - started:.0f} s",
            flush=True,
        )
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            for kind in tuners:
                shutil.copyfile(tmp / f"{kind}.jsonl", keep / f"{kind}.jsonl")
        return {kind: tuner.log.records() for kind, tuner in tuners.items()}


@dataclasses.dataclass
class Replay:
    """Measured tables of a model's tasks: a measurer that answers from them, and every
    config's features (computed once: the sessions would each compute them again)."""

    measurer: ReplayMeasurer
    features: dict[str, dict[str, np.ndarray]]
    optimum: float  # L with every task at its table's fastest config: what tuning can reach

    @classmethod
    def load(cls, tasks: list[Task], folder: Path) -> Replay:
        tables = {}
        for slug, task in table_slugs(tasks).items():
            table = read_table(slug, task, folder)
            missing = len(task.space()) - len(table)
            if missing:
                raise SystemExit(f"{folder}: {slug} lacks {missing} configs: run --measure")
            tables[task.key] = table
        features = {
            task.key: {r.config_key: config_features(task, r.config) for r in tables[task.key]}
            for task in tasks
        }
        records = [r for table in tables.values() for r in table]
        optimum = sum(task.weight * min(r.cost for r in tables[task.key] if r.ok) for task in tasks)
        return cls(ReplayMeasurer(records), features, optimum)


def table_slugs(tasks: list[Task]) -> dict[str, Task]:
    """A table's name for each task: its place in the model and its workload key."""
    return {f"task{k:02d}_{task.key[:12]}": task for k, task in enumerate(tasks)}


def session_logs(folder: Path) -> list[dict[str, list]]:
    """The sessions `--keep-logs` kept under `folder` (seed0/, seed1/...), by seed."""
    seeds = sorted(folder.glob("seed*"), key=lambda p: int(p.name[len("seed") :]))
    if not seeds:
        raise SystemExit(f"{folder}: no seed*/ folders of kept sessions")
    return [{kind: FileLog(d / f"{kind}.jsonl").records() for kind in KINDS} for d in seeds]


def fastest_costs(sessions: list[list[TuningRecord]]) -> dict[tuple[str, str], float]:
    """Each config's fastest measurement over both sessions: the two share the machine, and
    one reading of a kernel taken in a busy second (1.7-1.9x slow, seen on the defaults of two
    of MobileNetV2's tasks) would otherwise count as a gain when the session moves on."""
    every = (r for records in sessions for r in records)
    return {key: r.cost for key, r in fastest_records(every).items() if r.ok}


def latency_curve(
    tasks: list[Task], records: list[TuningRecord], fastest: dict[tuple[str, str], float]
) -> list[float]:
    """L(t) for t = 0 .. len(records): estimated seconds of the tuned kernels per model run,
    each config at its `fastest` cost."""
    default_of = {t.key: t.default_config() for t in tasks}
    defaults = {
        r.workload_key: fastest[r.workload_key, r.config_key]
        for r in records
        if r.ok and r.config == default_of[r.workload_key]
    }
    missing = [t.workload for t in tasks if t.key not in defaults]
    if missing:
        raise SystemExit(f"the session never measured the default of {missing}: more trials")
    best = dict(defaults)
    weight = {t.key: t.weight for t in tasks}
    curve = [sum(weight[k] * c for k, c in best.items())]
    for record in records:
        if record.ok:
            cost = fastest[record.workload_key, record.config_key]
            best[record.workload_key] = min(best[record.workload_key], cost)
        curve.append(sum(weight[k] * c for k, c in best.items()))
    return curve


def trials_to(curve: list[float], bound: float) -> int:
    return next((t for t, value in enumerate(curve) if value <= bound), len(curve))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mobilenet_v2")
    parser.add_argument("--source", type=Path, default=Path("build/tuning/resnet18.jsonl"))
    parser.add_argument("--trials", type=int, default=320)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--keep-logs", type=Path, help="copy each session's log under here")
    parser.add_argument("--from-logs", type=Path, help="read kept sessions instead of tuning")
    parser.add_argument("--tables", type=Path, help="replay from the tables measured here")
    parser.add_argument("--measure", action="store_true", help="measure the --tables first")
    parser.add_argument("--json", type=Path, default=Path("bench/transfer.json"))
    args = parser.parse_args()
    graph = optimize(import_model(str(shared_model(args.model))))
    tasks = extract_tasks(graph)
    if args.measure:
        if not args.tables:
            raise SystemExit("--measure needs --tables DIR")
        measure_tables(table_slugs(tasks), args.tables)
        retime_tables(table_slugs(tasks), args.tables)
        return
    replay = Replay.load(tasks, args.tables) if args.tables else None
    if args.from_logs:
        runs = session_logs(args.from_logs)
    else:
        print(f"CPU: {cpu_name()}; {args.model}: {len(tasks)} tasks, {args.trials} trials each")
        runs = []
        for seed in range(args.seeds):
            if replay is None:
                time.sleep(SETTLE_SECONDS)
            keep = args.keep_logs / f"seed{seed}" if args.keep_logs else None
            runs.append(tune_sessions(tasks, args.trials, seed, args.source, keep, replay))
    report = {"cpu": cpu_name(), "model": args.model, "source": str(args.source), "seeds": []}
    optimum = replay.optimum if replay is not None else None
    for seed, sessions in enumerate(runs):
        fastest = fastest_costs(list(sessions.values()))
        cold, warm = (latency_curve(tasks, sessions[kind], fastest) for kind in KINDS)
        report["seeds"].append(seed_report(seed, cold, warm, optimum))
    for reading in report["seeds"][0]["readings"] if report["seeds"] else ():
        print(f"{reading}: warm/cold trials, median over seeds {median_ratio(report, reading)}")
    print_captured(report)
    if args.tables:
        report["tasks"] = task_gains(tasks, args.tables)
        print_task_gains(report["tasks"])
    args.json.write_text(json.dumps(report, indent=1))
    print(f"results: {args.json}")


def seed_report(
    seed: int, cold: list[float], warm: list[float], optimum: float | None = None
) -> dict:
    """One seed's readings (trials to 95% of the final quality, both ways), printed. With the
    `optimum` (a replay knows it: every task at its table's fastest config), a third reading:
    95% of the gain the spaces hold, a reference that neither session's luck moves."""
    curves = dict(zip(KINDS, (cold, warm), strict=True))
    final = min(cold[-1], warm[-1])
    row = {"final_ms": final * 1e3, "default_ms": cold[0] * 1e3}
    bounds = {
        "speed": lambda curve: final / GOAL,
        "gain": lambda curve: curve[0] - GOAL * (curve[0] - final),
    }
    labels = {"speed": "of the final quality", "gain": "of the final quality"}
    if optimum is not None:
        row["optimum_ms"] = optimum * 1e3
        bounds["optimum"] = lambda curve: curve[0] - GOAL * (curve[0] - optimum)
        labels["optimum"] = "of the gain the spaces hold"
    row["readings"] = list(bounds)
    for reading, bound_of in bounds.items():
        row[reading] = {kind: trials_to(c, bound_of(c)) for kind, c in curves.items()}
    if optimum is not None:
        row["captured"] = {
            kind: [captured(c, optimum, t) for t in CHECKPOINTS] for kind, c in curves.items()
        }
    row["curves_ms"] = {
        kind: [round(v * 1e3, 4) for v in c[:: max(len(c) // 40, 1)]] for kind, c in curves.items()
    }
    print(
        f"seed {seed}: defaults {cold[0] * 1e3:.3f} ms (cold) {warm[0] * 1e3:.3f} ms (warm), "
        f"final {cold[-1] * 1e3:.3f} / {warm[-1] * 1e3:.3f} ms"
        + (f", optimum {optimum * 1e3:.3f} ms" if optimum is not None else "")
    )
    for reading, label in labels.items():
        trials = row[reading]
        ratio = trials_ratio(trials)
        said = f"{ratio:.2f} of cold" if ratio is not None else "the defaults meet it: no reading"
        print(
            f"  {GOAL:.0%} {label} ({reading}): cold {trials['cold']} trials, "
            f"warm {trials['warm']} ({said})"
        )
    return row


def captured(curve: list[float], optimum: float, trials: int) -> float:
    """The share of the gain the spaces hold (L(0) - L*) that a session's curve holds after
    `trials` trials (its last point where it ran fewer); 1 where the defaults are optimal."""
    gain = curve[0] - optimum
    reached = curve[min(trials, len(curve) - 1)]
    return (curve[0] - reached) / gain if gain > 0 else 1.0


def print_captured(report: dict) -> None:
    """Medians over the seeds of each session's share of the spaces' gain at CHECKPOINTS."""
    seeds = [seed["captured"] for seed in report["seeds"] if "captured" in seed]
    if not seeds:
        return
    print("share of the gain the spaces hold after t trials, median over seeds:")
    for kind in KINDS:
        shares = [statistics.median(s[kind][k] for s in seeds) for k in range(len(CHECKPOINTS))]
        readings = zip(CHECKPOINTS, shares, strict=True)
        print(f"  {kind}: " + "  ".join(f"t={t} {v:.2f}" for t, v in readings))


def task_gains(tasks: list[Task], folder: Path) -> list[dict]:
    """Each task's gain in its measured table against the table's noise (`task_gain`)."""
    fingerprint = host_target().fingerprint
    return [
        task_gain(slug, task, FileLog(folder / f"{slug}.jsonl").records(task.key, fingerprint))
        for slug, task in table_slugs(tasks).items()
    ]


def task_gain(slug: str, task: Task, records: list[TuningRecord]) -> dict:
    """A task's `gain` (its default's cost over its fastest config's, less 1, each config at
    its fastest timing) and its table's `noise`: over the configs timed at least three times
    (the default and the fastest, re-timed by `--measure`), the median of how far a config's
    median timing lies above its fastest. None where no config was timed that often."""
    timings: dict[str, list[float]] = {}
    for record in records:
        if record.ok:
            timings.setdefault(record.config_key, []).append(record.cost)
    fastest = {key: min(costs) for key, costs in timings.items()}
    default, best = fastest[config_key(task.default_config())], min(fastest.values())
    spreads = [
        statistics.median(costs) / min(costs) - 1 for costs in timings.values() if len(costs) >= 3
    ]
    return {
        "task": slug,
        "weight": task.weight,
        "default_us": default * 1e6,
        "best_us": best * 1e6,
        "gain": default / best - 1,
        "noise": statistics.median(spreads) if spreads else None,
    }


def gain_within_noise(rows: list[dict]) -> float | None:
    """The share of the spaces' gain (occurrences x (default - best), summed over the tasks)
    that lies in tasks whose gain is no larger than their table's noise; None without gain."""
    total = sum(map(_saved_us, rows))
    if total <= 0:
        return None
    noisy = (r for r in rows if r["noise"] is not None and r["gain"] <= r["noise"])
    return sum(map(_saved_us, noisy)) / total


def _saved_us(row: dict) -> float:
    """Microseconds of a model run a task's best config saves over its default."""
    return row["weight"] * (row["default_us"] - row["best_us"])


def print_task_gains(rows: list[dict]) -> None:
    """Where the spaces' gain lies, the heaviest first, each task against its table's noise."""
    total = sum(map(_saved_us, rows))
    print("the spaces' gain by task (default over best, against repeated timings' spread):")
    for row in sorted(rows, key=_saved_us, reverse=True):
        saved = _saved_us(row)
        if saved <= 0:
            continue
        noise = f"{row['noise']:.1%}" if row["noise"] is not None else "-"
        print(
            f"  {row['task']}: x{row['weight']} {row['default_us']:.1f} -> {row['best_us']:.1f} us"
            f" (gain {row['gain']:.1%}, noise {noise}), {saved / total:.0%} of the spaces' gain"
        )
    share = gain_within_noise(rows)
    if share is not None:
        print(f"  {share:.0%} of the spaces' gain lies in tasks whose gain is within their noise")


def trials_ratio(trials: dict) -> float | None:
    """Warm's trials to the bound over cold's; None where both met it before their first
    trial (the defaults already do: the seed says nothing about transfer), infinite where
    only cold did."""
    if trials["cold"]:
        return trials["warm"] / trials["cold"]
    return None if not trials["warm"] else math.inf


def median_ratio(report: dict, reading: str) -> str:
    """The median ratio over the seeds that say something, and how many do."""
    ratios = [trials_ratio(seed[reading]) for seed in report["seeds"]]
    told = [r for r in ratios if r is not None]
    if not told:
        return "n/a (the defaults meet the bound in every seed)"
    return f"{statistics.median(told):.2f} ({len(told)} of {len(ratios)} seeds)"


if __name__ == "__main__":
    main()
