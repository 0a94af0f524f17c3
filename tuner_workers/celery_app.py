"""The Celery app shared by the workers and by the api (which enqueues tasks by name only).

Importing this module imports nothing of the compiler: the api builds its app here too.
"""

from __future__ import annotations

import shlex

from celery import Celery

from tuner_workers.settings import KilnSettings

COMPILE_TASK = "kiln.compile"
TUNE_TASK = "kiln.tune_workload"  # one workload of a compile job's tuning stage
GENERIC_CPU_QUEUE = "cpu"


def queue_for_target(target: str, tuned: bool = False) -> str:
    """The queue a compile job for `target` goes to, so it runs on the hardware it is for.

    `llvm` (the worker's own CPU) goes to the generic `cpu` queue every CPU worker consumes;
    `llvm -mcpu=NAME` to `cpu.NAME`, consumed by workers whose CPU is NAME; `cuda -arch=sm_XY`
    to `cuda.sm_XY`, which any worker serves (PTX is built without a GPU), or, when the job
    is `tuned` (its candidates are measured on the GPU), to `cuda.sm_XY.gpu`, which only GPU
    workers consume. Raises ValueError for anything else.
    """
    try:
        words = shlex.split(target)
    except ValueError as err:  # an unclosed quote
        raise ValueError(f"unsupported target {target!r}: {err}") from None
    if not words or words[0] not in ("llvm", "cuda"):
        raise ValueError(f"unsupported target {target!r}: expected 'llvm [-mcpu=NAME]' or 'cuda'")
    options = dict(word.partition("=")[::2] for word in words[1:])
    unknown = set(options) - {"-mcpu", "-mattr", "-arch"}
    if unknown:
        raise ValueError(f"unknown target option(s) {sorted(unknown)} in {target!r}")
    if words[0] == "cuda":
        queue = f"cuda.{options.get('-arch', 'sm_90')}"
        return f"{queue}.gpu" if tuned else queue
    cpu = options.get("-mcpu")
    return f"cpu.{cpu}" if cpu else GENERIC_CPU_QUEUE


def make_app(settings: KilnSettings | None = None) -> Celery:
    settings = settings or KilnSettings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    app = Celery("kiln", broker=settings.broker_url, backend=settings.result_backend)
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        # A compile job is long: acknowledge it only once it has finished, give it back to
        # the broker if the worker process dies, and reserve one message at a time.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_soft_time_limit=settings.compile_soft_time_limit,
        task_time_limit=settings.compile_hard_time_limit,
        broker_connection_retry_on_startup=True,
        task_default_queue=GENERIC_CPU_QUEUE,
        result_expires=24 * 3600,
        worker_hijack_root_logger=False,
    )
    if settings.redis_url:
        # Redis redelivers an unacknowledged message after the visibility timeout: keep it
        # above the hard time limit, or a job still running would be handed out twice. (The
        # SQLite transport passes its options to SQLAlchemy and has no such timeout.)
        visibility = settings.compile_hard_time_limit + 600
        app.conf.broker_transport_options = {"visibility_timeout": visibility}
    app.conf.kiln_settings = settings
    return app
