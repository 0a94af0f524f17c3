"""Celery tasks: thin shells over `tuner_workers.service`.

`create_worker_app(settings)` builds an app with the tasks registered; `kiln worker` runs one
on the queues for this machine's CPU (`celery -A tuner_workers.tasks worker -Q cpu` works too:
`app` is built from the KILN_* environment on first use).
"""

from __future__ import annotations

import logging
import threading
from functools import cached_property

from celery import Celery, signals
from celery.exceptions import SoftTimeLimitExceeded

from tuner_workers import service, tuning
from tuner_workers.celery_app import COMPILE_TASK, TUNE_TASK, make_app
from tuner_workers.ledger import Ledger, open_ledger
from tuner_workers.settings import KilnSettings

log = logging.getLogger("kiln.worker")
ORPHAN_WATCH_SECONDS = 5.0


class WorkerContext:
    """What a worker's tasks share: settings, and the ledger and store, opened on first use
    (after the prefork pool has forked)."""

    def __init__(self, app: Celery, settings: KilnSettings):
        self.app, self.settings = app, settings
        self.stop = threading.Event()

    @cached_property
    def ledger(self) -> Ledger:
        return open_ledger(self.settings)

    @cached_property
    def store(self):
        return self.settings.store()

    def enqueue(self, job: dict) -> None:
        self.app.send_task(COMPILE_TASK, args=[job["id"]], queue=job["queue"])

    def send_tuning(self, job_id: str, key: str) -> None:
        """One workload of a job's tuning, to the job's queue (its hardware's workers)."""
        job = self.ledger.get_job(job_id)
        self.app.send_task(TUNE_TASK, args=[job_id, key], queue=job["queue"])

    def watch_for_orphans(self) -> None:
        """Take up jobs whose worker died: at start (a restarted worker finds its
        predecessor's job) and then every half lease. The SQLite broker never redelivers a
        fetched message, and Redis only after the visibility timeout: the ledger decides. A
        dead owner on this host is seen at once; another host's, when its lease runs out."""
        lease = self.settings.job_lease_seconds
        while True:
            try:
                requeued = service.requeue_orphans(self.ledger, lease, self.enqueue)
                if requeued:
                    log.warning("took up orphaned jobs: %s", ", ".join(requeued))
            except Exception:  # noqa: BLE001 - the watcher must outlive a broker hiccup
                log.exception("orphan watch failed")
            if self.stop.wait(min(max(lease / 2, 0.5), ORPHAN_WATCH_SECONDS)):
                return


def create_worker_app(settings: KilnSettings | None = None) -> Celery:
    settings = settings or KilnSettings()
    app = make_app(settings)
    context = WorkerContext(app, settings)
    app.kiln = context

    @app.task(name=COMPILE_TASK, shared=False)
    def compile_job(job_id: str) -> dict | None:
        job = service.run_compile_job(
            job_id,
            context.ledger,
            context.store,
            context.settings,
            time_limit_errors=(SoftTimeLimitExceeded,),
            send_tuning=context.send_tuning,
        )
        return None if job is None else {"id": job_id, "status": job["status"]}

    @app.task(name=TUNE_TASK, shared=False)
    def tune_workload(job_id: str, key: str) -> dict | None:
        try:
            entry = tuning.run_tune_message(
                context.ledger, context.store, context.settings, job_id, key
            )
        except service.JobStopped:
            log.info("job %s: tuning of %s stopped (cancelled or taken over)", job_id, key)
            return None
        return None if entry is None else {"job": job_id, "key": key, "status": entry["status"]}

    return app


@signals.worker_ready.connect
def _start_orphan_watch(sender=None, **_) -> None:
    context = getattr(getattr(sender, "app", None), "kiln", None)
    if context is not None:
        threading.Thread(target=context.watch_for_orphans, name="kiln-orphans", daemon=True).start()


@signals.worker_shutdown.connect
def _stop_orphan_watch(sender=None, **_) -> None:
    context = getattr(getattr(sender, "app", None), "kiln", None)
    if context is not None:
        context.stop.set()


_default_app: Celery | None = None


def __getattr__(name: str):
    """`app` for `celery -A tuner_workers.tasks`, built from the environment on first use."""
    global _default_app
    if name != "app":
        raise AttributeError(name)
    if _default_app is None:
        _default_app = create_worker_app()
    return _default_app
