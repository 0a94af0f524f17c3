"""`kiln submit model.onnx --server URL ...`: upload, compile (and tune), optionally deploy,
following the job live: a progress line per stage and per tuning task on a terminal, plain
lines otherwise (a log, a CI job, a test capturing stdout).

Exit status: 0 done (and deployed when asked), 1 the job failed or was cancelled, 2 a usage or
API error, 130 interrupted (Ctrl-C cancels the job, asking first on a terminal, or leaves it
running with --detach).

Only the client's dependencies (httpx, numpy, rich) are imported here: the command runs on a
laptop with the base install, far from the services.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from api.client import Client, Event, KilnApiError, KilnConnectionError, KilnError

PROG = "kiln submit"
DEFAULT_SERVER = "http://127.0.0.1:8000"
EXIT_DONE, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd]?)")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


class UsageError(ValueError):
    pass


# --- arguments --------------------------------------------------------------------------------


def parse_duration(text: str) -> float:
    """`90`, `20s`, `10m`, `1h30m` -> seconds."""
    compact = text.strip().lower().replace(" ", "")
    parts = _DURATION.findall(compact)
    if not compact or "".join(n + u for n, u in parts) != compact:
        raise UsageError(f"--tune {text!r}: expected a duration such as 90s, 10m or 1h30m")
    seconds = sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)
    if seconds <= 0:
        raise UsageError(f"--tune {text!r}: the time budget must be positive")
    return seconds


def parse_shapes(items: list[str] | None) -> dict[str, list[int]]:
    """`name=1,3,224,224` entries -> {name: [1, 3, 224, 224]}."""
    shapes = {}
    for item in items or ():
        name, sep, dims = item.partition("=")
        try:
            if not sep or not name:
                raise ValueError
            shapes[name] = [int(d) for d in dims.split(",") if d.strip()]
        except ValueError:
            raise UsageError(f"--shape {item!r}: expected NAME=D0,D1,... (e.g. x=1,784)") from None
    return shapes


def tuning_request(args: argparse.Namespace) -> dict | None:
    tuning = {}
    if args.tune:
        tuning["time_budget"] = parse_duration(args.tune)
    if args.trials is not None:
        if args.trials < 1:
            raise UsageError("--trials must be at least 1")
        tuning["trials"] = args.trials
    return tuning or None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Upload an ONNX model, compile (and tune) it on a Kiln server, and "
        "optionally deploy it, following the job live.",
    )
    parser.add_argument("model", type=Path, help="the ONNX model file")
    parser.add_argument(
        "--server",
        default=os.environ.get("KILN_SERVER", DEFAULT_SERVER),
        help=f"the api's base URL (default: $KILN_SERVER or {DEFAULT_SERVER})",
    )
    parser.add_argument(
        "--api-key", default=os.environ.get("KILN_API_KEY"), help="default: $KILN_API_KEY"
    )
    parser.add_argument("--target", default="llvm", help="compile target (default: llvm)")
    parser.add_argument(
        "--shape", action="append", metavar="NAME=D0,D1,...", help="bind an input's shape"
    )
    parser.add_argument("--tune", metavar="DURATION", help="tuning time budget: 90s, 10m, 1h")
    parser.add_argument("--trials", type=int, metavar="N", help="tuning trials")
    parser.add_argument("--name", help="the model's name on the server (default: file stem)")
    parser.add_argument("--deploy", metavar="NAME", help="deploy the artifact under NAME")
    parser.add_argument("--deploy-version", default="1", metavar="V", help="(default: 1)")
    parser.add_argument(
        "--wait", action="store_true", help="follow the job to its end (implied by --deploy)"
    )
    parser.add_argument(
        "--detach", action="store_true", help="on Ctrl-C leave the job running, do not cancel"
    )
    return parser


# --- progress ---------------------------------------------------------------------------------


def describe_event(event: Event) -> str:
    """One plain line per event."""
    data = event.data
    if event.type == "queued":
        return f"queued (queue {data.get('queue', '?')})"
    if event.type == "stage":
        return "stage " + data.get("stage", "?") + _stage_detail(data)
    if event.type == "tuning":
        return (
            f"tuning task {data.get('task')} ({data.get('workload')}): {data.get('trials')} "
            f"trials, best {data.get('best_gflops', 0):.2f} GFLOP/s; "
            f"{data.get('tasks_done')}/{data.get('tasks_total')} tasks done, "
            f"estimated {data.get('estimated_ms')} ms" + _tuning_status(data)
        )
    if event.type == "in_model":
        kept = data.get("kept_default", [])
        details = "".join(
            f"; task {k['task']} tuned {k['tuned_ms']} ms, default {k['default_ms']} ms"
            for k in kept
        )
        summary = f"{data.get('checked')} tuned tasks, {len(kept)} keep their default"
        if data.get("kept_previous"):
            summary += f", {len(data['kept_previous'])} keep their earlier choice"
        return f"checked in the model: {summary}{details}"
    if event.type == "measured":
        return f"measured latency {data.get('latency_ms')} ms"
    if event.type == "requeued":
        return "requeued: its worker went away, another one takes it up"
    if event.type == "failed":
        return f"failed: {data.get('error', '')}"
    return event.type


def _tuning_status(data: dict) -> str:
    """A tuning task's end, and who tuned it (the workers share a job's tasks)."""
    status, worker = data.get("status"), data.get("worker")
    if status == "failed":
        return f"; failed: {data.get('error', '')}"
    if status == "done":
        return f"; done on {worker}" if worker else "; done"
    return f" (on {worker})" if worker else ""


def _stage_detail(data: dict) -> str:
    if data.get("stage") == "tuning":
        total = (data.get("progress") or {}).get("tasks_total", 0)
        return f": {total} tasks" if data.get("tuned") else ": skipped (no tuning asked)"
    if data.get("stage") == "building" and "kernels" in data:
        return f": {data['kernels']} kernels" + (", tuned" if data.get("tuned") else "")
    return ""


class PlainReporter:
    """Lines on stdout, flushed one by one so a reader of the pipe sees them as they come."""

    def line(self, text: str) -> None:
        print(text, flush=True)

    def event(self, event: Event) -> None:
        self.line(describe_event(event))

    def stop(self) -> None:
        pass


class RichReporter:
    """A live rich display: one line per stage, one per tuning task."""

    def __init__(self):
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        self.progress = Progress(
            SpinnerColumn(finished_text="[green]✓[/]"),
            TextColumn("{task.description:<28}"),
            BarColumn(bar_width=30),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=Console(),
        )
        # Lines are added as stages begin, so a tuning task's line sits under the tuning
        # stage's, and the stages a reused artifact skips never show.
        self.stages: dict[str, int] = {}
        self.tasks: dict[int, int] = {}
        self.current: str | None = None
        self.started = False

    def _start(self) -> None:
        # Only once the job runs: upload and queueing lines come before the live display.
        if not self.started:
            self.started = True
            self.progress.start()

    def line(self, text: str) -> None:
        self.progress.console.print(text, highlight=False)

    def stop(self) -> None:
        self.progress.stop()

    def event(self, event: Event) -> None:
        self._start()
        data = event.data
        if event.type == "queued":
            self._begin("queued", f"queue {data.get('queue', '?')}")
        elif event.type == "stage":
            self._begin(data.get("stage", "?"), _stage_detail(data).removeprefix(": "))
        elif event.type == "tuning":
            self._tuning(data)
        elif event.type == "measured":
            self._info("verifying", f"latency {data.get('latency_ms')} ms")
        elif event.type == "requeued":
            self.line("[yellow]requeued[/]: its worker went away, another one takes it up")
        elif event.type == "done":
            self._finish_all()
        elif self.current is not None:  # failed, cancelled
            self._info(self.current, f"[red]{event.type}[/]")

    def _begin(self, stage: str, info: str) -> None:
        self._complete_current()
        if stage not in self.stages:  # a requeued job goes through its stages again
            self.stages[stage] = self.progress.add_task(stage, total=1, info="")
        self.current = stage
        self.progress.update(self.stages[stage], info=info)

    def _complete_current(self) -> None:
        if self.current is None:
            return
        task = self.stages[self.current]
        total = self.progress.tasks[task].total or 1
        self.progress.update(task, total=total, completed=total)
        for subtask in self.tasks.values() if self.current == "tuning" else ():
            self.progress.update(subtask, total=1, completed=1)

    def _info(self, stage: str, info: str) -> None:
        if stage in self.stages:
            self.progress.update(self.stages[stage], info=info)

    def _tuning(self, data: dict) -> None:
        if "tuning" not in self.stages:
            self._begin("tuning", "")
        self.progress.update(
            self.stages["tuning"],
            total=max(data.get("tasks_total", 1), 1),
            completed=data.get("tasks_done", 0),
            info=f"{data.get('tasks_done')}/{data.get('tasks_total')} tasks, "
            f"estimated {data.get('estimated_ms')} ms",
        )
        index = int(data.get("task", 0))
        if index not in self.tasks:
            # No total: a task's trials have no fixed end under a time budget (pulsing bar).
            label = f"  {index}: {data.get('workload', '')}"[:28]
            self.tasks[index] = self.progress.add_task(label, total=None, info="")
        info = f"{data.get('trials')} trials, best {data.get('best_gflops', 0):.2f} GFLOP/s"
        self.progress.update(self.tasks[index], info=info)

    def _finish_all(self) -> None:
        self._complete_current()
        self.current = None


# --- the command ------------------------------------------------------------------------------


def error(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)


def confirm(prompt: str) -> bool:
    """y/N on the terminal; a second Ctrl-C or end of input means no."""
    print(prompt, end="", file=sys.stderr, flush=True)
    try:
        answer = sys.stdin.readline()
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return False
    return answer.strip().lower() in ("y", "yes")


def interrupted(client: Client, job: dict, args: argparse.Namespace, reporter) -> int:
    """Ctrl-C while following a job: detach, or cancel it (asking first on a terminal)."""
    reporter.stop()
    url = client.compilation_url(job)
    if args.detach:
        print(f"detached; the job goes on: {url}", flush=True)
        return EXIT_INTERRUPTED
    if sys.stdin.isatty() and not confirm("\ncancel the job? [y/N] "):
        print(f"the job goes on: {url}", flush=True)
        return EXIT_INTERRUPTED
    try:
        client.cancel(job)
        print(f"cancelled compilation {job['id']}", flush=True)
    except KilnApiError as err:
        if err.status != 409:  # 409: it ended meanwhile, nothing left to cancel
            raise
        print(f"compilation {job['id']} had already ended: {err.detail}", flush=True)
    return EXIT_INTERRUPTED


def follow(client: Client, job: dict, reporter) -> dict:
    for event in client.events(job):
        reporter.event(event)
    return client.compilation(job)


def summary(client: Client, job: dict, deployment: dict | None, reporter) -> None:
    latency = job.get("best_latency_ms")
    reporter.line(f"artifact   {job['artifact']}")
    reporter.line("latency    " + (f"{latency} ms" if latency is not None else "not measured"))
    if deployment is not None:
        reporter.line(f"deployed   {deployment['name']} (version {deployment['version']})")
        reporter.line(f"infer URL  {deployment['infer_url']}")
    else:
        reporter.line(f"download   {client.url}/v1/artifacts/{job['artifact']}")


def submit(args: argparse.Namespace, client: Client, reporter) -> int:
    shapes, tuning = parse_shapes(args.shape), tuning_request(args)
    if not args.model.is_file():
        raise UsageError(f"{args.model}: no such file")
    model = client.upload(args.model, name=args.name)
    reporter.line(f"uploaded   {args.model.name} as {model['id']} ({model['digest']})")
    job = client.compile(model, args.target, shapes=shapes, tuning=tuning)
    reporter.line(f"compiling  {client.compilation_url(job)}")
    if not (args.wait or args.deploy):
        return EXIT_DONE
    try:
        job = follow(client, job, reporter)
    except KeyboardInterrupt:
        return interrupted(client, job, args, reporter)
    reporter.stop()
    if job["status"] != "done":
        reason = job.get("error") or f"the job was {job['status']}"
        error(f"compilation {job['id']} {job['status']}: {reason}")
        return EXIT_FAILED
    deployment = None
    if args.deploy:
        deployment = client.deploy(job, args.deploy, args.deploy_version)
    summary(client, job, deployment, reporter)
    return EXIT_DONE


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    reporter = RichReporter() if sys.stdout.isatty() else PlainReporter()
    try:
        with Client(args.server, args.api_key) as client:
            return submit(args, client, reporter)
    except KeyboardInterrupt:  # before a job exists, or after it ended: nothing to cancel
        reporter.stop()
        return EXIT_INTERRUPTED
    except KilnApiError as err:
        reporter.stop()
        hint = " (give --api-key or set KILN_API_KEY)" if err.status == 401 else ""
        error(f"{err.status} {err.title}: {err.detail}{hint}")
        return EXIT_USAGE
    except (UsageError, KilnConnectionError, KilnError, OSError) as err:
        reporter.stop()
        error(str(err))
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
