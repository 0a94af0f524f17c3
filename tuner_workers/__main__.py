"""`python -m tuner_workers worker [-Q QUEUES] [--concurrency N]` runs a Celery worker on the
queues of this machine's CPU; `python -m tuner_workers serve ...` runs the whole platform
(see `tuner_workers.serve`); `python -m tuner_workers gc` collects unreferenced blobs.
`kiln worker`, `kiln serve` and `kiln gc` call these."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path


def cpu_queues() -> list[str]:
    """The generic `cpu` queue, `cpu.<cpu name>` and `cpu.<target fingerprint>`, and the
    `cuda.<sm>` queue of every architecture: building PTX needs no GPU (LLVM's NVPTX target
    emits it anywhere), so every worker builds GPU archives."""
    from compiler_core.target import GPU_ARCHS, host_target
    from tuner_workers.celery_app import GENERIC_CPU_QUEUE

    target = host_target()
    cuda = [f"cuda.{arch}" for arch in GPU_ARCHS]
    return [GENERIC_CPU_QUEUE, f"cpu.{target.cpu}", f"cpu.{target.fingerprint}", *cuda]


def run_worker(args) -> int:
    from tuner_workers.tasks import create_worker_app

    app = create_worker_app()
    queues = args.queues or ",".join(cpu_queues())
    concurrency = args.concurrency or app.conf.kiln_settings.worker_concurrency
    argv = ["worker", "-Q", queues, "--concurrency", str(concurrency), "--loglevel", args.loglevel]
    parts = queues.split(",")
    label = next((q for q in reversed(parts) if q.startswith("cpu.")), parts[-1])
    argv += ["-n", f"kiln-{label}@{socket.gethostname()}", "--without-gossip"]
    app.worker_main(argv)
    return 0


def run_gc(args) -> int:
    """Mark and sweep the artifact store: blobs no manifest references, older than the grace
    period (uploads and jobs between their blob and their manifest are younger)."""
    from tuner_workers.settings import KilnSettings

    report = KilnSettings().store().gc(grace_seconds=args.grace, dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    print(
        f"kept {report.kept} referenced blobs, {len(report.young)} young unreferenced ones; "
        f"{verb} {len(report.deleted)} ({report.freed_bytes} bytes)"
    )
    for digest in report.deleted:
        print(f"  {digest}")
    return 0


def run_serve(args) -> int:
    from tuner_workers.serve import serve

    return serve(args.api_port, args.runtime_port, Path(args.data_dir), args.host)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tuner_workers")
    sub = parser.add_subparsers(dest="command", required=True)
    worker = sub.add_parser("worker", help="run a Celery worker for this machine's queues")
    worker.add_argument("-Q", "--queues", help="comma-separated (default: this CPU's queues)")
    worker.add_argument("--concurrency", type=int, default=None)
    worker.add_argument("--loglevel", default="INFO")
    worker.set_defaults(run=run_worker)
    gc = sub.add_parser("gc", help="delete blobs that no manifest references")
    gc.add_argument("--grace", type=float, default=24 * 3600, help="seconds (default a day)")
    gc.add_argument("--dry-run", action="store_true")
    gc.set_defaults(run=run_gc)
    serve = sub.add_parser("serve", help="api + worker + runtime server on one machine")
    add_serve_arguments(serve)
    serve.set_defaults(run=run_serve)
    return parser


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api-port", type=int, default=8000)
    parser.add_argument("--runtime-port", type=int, default=8001)
    parser.add_argument("--host", default="127.0.0.1")
    default = os.environ.get("KILN_DATA_DIR") or str(Path.home() / ".kiln")
    parser.add_argument("--data-dir", default=default)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
