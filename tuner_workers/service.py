"""Compile jobs as service functions: the Celery tasks are thin shells over these.

A job runs in stages (importing, tuning, building, verifying, storing), each recorded in the
ledger with a progress event. A job is idempotent: its key is the sha256 of (model digest,
target, options, compiler version), and a job whose key already has an artifact in the store
finishes with that artifact. Module archives are byte-deterministic, so a job redone after a
crash stores the very same blob.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from tuner_workers.ledger import TERMINAL, Ledger

log = logging.getLogger("kiln.worker")

STAGES = ("importing", "tuning", "building", "verifying", "storing")
MEASURE_RUNS = 20


class JobStopped(Exception):  # noqa: N818 - a signal, not an error
    pass


def compiler_version() -> str:
    """The installed package's version and a digest of the compiler's sources. A job key
    names the compiler that built its artifact: a compiler changed under an unchanged version
    number (an editable install being worked on, a patched image) must not be handed the
    artifacts the old one built."""
    from importlib.metadata import version

    import compiler_core

    return f"{version('kiln')}+{source_digest(Path(compiler_core.__file__).parent)}"


@functools.cache
def source_digest(root: Path) -> str:
    """A short sha256 of the Python and C sources under `root` (their paths and bytes)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".c") and p.is_file()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def job_key(model_digest: str, target: str, options: dict, version: str) -> str:
    text = json.dumps([model_digest, target, options, version], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def process_owner() -> str:
    """Who runs a job: host and pid, so a restarted worker on the same host can tell that the
    previous owner is gone without waiting for its lease to run out."""
    return f"{socket.gethostname()}:{os.getpid()}"


def owner_is_dead(owner: str | None) -> bool:
    if not owner:
        return False
    host, _, pid = owner.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return _is_zombie(int(pid))


def _is_zombie(pid: int) -> bool:
    """A killed pool process whose parent died too waits, as a zombie, for someone to reap it:
    it still answers kill(pid, 0), but it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] == "Z"


@contextlib.contextmanager
def renewing(renew: Callable[[], object], every: float, name: str) -> Iterator[None]:
    """Call `renew` every `every` seconds on a thread of its own while the block runs, until
    it answers falsy (the lease is no longer this owner's): a job's heartbeat, a tuning
    workload's."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(every):
            if not renew():
                return

    thread = threading.Thread(target=beat, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


class JobRun:
    """One attempt at a job by one owner: stage bookkeeping, cancellation, heartbeats."""

    def __init__(self, ledger: Ledger, job: dict, owner: str, heartbeat_seconds: float):
        self.ledger, self.job, self.owner = ledger, job, owner
        self.heartbeat_seconds = heartbeat_seconds

    def heartbeating(self) -> contextlib.AbstractContextManager[None]:
        renew = functools.partial(self.ledger.heartbeat, self.job["id"], self.owner)
        return renewing(renew, self.heartbeat_seconds, "kiln-heartbeat")

    def check(self) -> None:
        """Stop here if the job was cancelled or taken over by another worker."""
        current = self.ledger.get_job(self.job["id"])
        if current is None or current["status"] == "cancelled":
            raise JobStopped()
        if current.get("owner") != self.owner:
            raise JobStopped()  # taken over by another worker: let it finish

    def stage(self, name: str, **detail) -> None:
        self.check()
        self.ledger.update_job(self.job["id"], stage=name, **detail)
        self.event("stage", stage=name, **detail)
        log.info("job %s: %s %s", self.job["id"], name, detail or "")

    def event(self, kind: str, **fields) -> None:
        self.ledger.append_event(self.job["id"], {"type": kind, **fields})

    def finish(self, status: str, **fields) -> None:
        job = self.ledger.update_job(self.job["id"], status=status, stage=status, **fields)
        if job is not None:
            self.event(status, **fields)


def run_compile_job(
    job_id: str,
    ledger: Ledger,
    store,
    settings,
    time_limit_errors: tuple = (),
    send_tuning=None,
) -> dict | None:
    """Run (or take up again) compile job `job_id`; returns its final record, or None when the
    job is not this worker's to run (ended, cancelled, or held by a live owner).
    `time_limit_errors`: the exceptions that mean the job ran past its soft time limit;
    `send_tuning(job_id, workload_key)`: fans a tuning task out to the workers (None: the
    job tunes every workload itself)."""
    job = ledger.get_job(job_id)
    if job is None or job["status"] in TERMINAL:
        return job
    owner = process_owner()
    claimed = ledger.claim_job(job_id, owner, settings.job_lease_seconds)
    if claimed is None:
        log.info("job %s is held by %s: not running it twice", job_id, job.get("owner"))
        return None
    run = JobRun(ledger, claimed, owner, settings.heartbeat_seconds)
    with run.heartbeating():
        try:
            _compile_stages(run, store, settings, send_tuning)
        except JobStopped:
            log.info("job %s cancelled or taken over", job_id)
        except ValueError as err:  # the compiler's user errors: a model or option to fix
            run.finish("failed", error=str(err))
        except time_limit_errors:
            limit = settings.compile_soft_time_limit
            run.finish("failed", error=f"the job ran past its time limit of {limit} s")
        except Exception as err:  # noqa: BLE001 - recorded on the job; the worker lives on
            log.exception("job %s failed", job_id)
            run.finish("failed", error=f"internal error: {type(err).__name__}: {err}")
    return ledger.get_job(job_id)


def _compile_stages(run: JobRun, store, settings, send_tuning=None) -> None:
    from compiler_core.compiler import attach_verification, compile_graph
    from compiler_core.frontend.onnx import import_model
    from compiler_core.passes.pipeline import optimize
    from compiler_core.target import parse_target
    from tuner_workers.tuning import tune_job

    job = run.job
    known = _known_artifact(store, job["key"])
    if known:
        run.ledger.grant_artifact(job["tenant"], known)
        # What was checked and measured when it was built comes with it.
        stored = _stored_manifest(store, known)
        if stored.get("latency_ms") is not None:
            run.ledger.update_job(job["id"], best_latency_ms=stored["latency_ms"])
        verification = stored.get("verification")
        run.finish("done", artifact=known, reused=True, verification=verification)
        return
    run.stage("importing")
    target = parse_target(job["target"])
    model = store.get_blob(job["model_digest"])
    graph = optimize(import_model(model, shapes=job.get("shapes") or None), target=target)
    tuning = tune_job(run, graph, target, job.get("tuning") or {}, settings, send_tuning)
    run.stage("building", kernels=len(graph.nodes), tuned=tuning is not None)
    model_sha = job["model_digest"].split(":")[-1]
    archive = compile_graph(graph, target, model_sha, verify=False, tuning=tuning)
    run.stage("verifying")
    archive = attach_verification(archive, graph)
    verification = archive.manifest["verification"]
    if verification["passed"] is False:  # None: not run here (a GPU archive, no OpenCL)
        raise ValueError(
            "the compiled module disagrees with the reference executor: max abs error "
            f"{verification['max_abs_error']:.3g}"
        )
    latency_ms = _measure_latency(archive)
    run.ledger.update_job(job["id"], best_latency_ms=latency_ms)
    run.event("measured", latency_ms=latency_ms)
    run.stage("storing")
    digest = store.put_blob(archive.to_bytes())
    store.put_manifest(
        "artifacts",
        digest,
        {
            "artifact": digest,
            "model": job["model_digest"],
            "target": job["target"],
            "target_fingerprint": target.fingerprint,
            "options": {"shapes": job.get("shapes"), "tuning": job.get("tuning")},
            "job_key": job["key"],
            "compiler_version": job["compiler_version"],
            "compile_seconds": round(archive.compile_seconds or 0.0, 3),
            "verification": verification,
            "latency_ms": latency_ms,
            "inputs": archive.manifest["inputs"],
            "outputs": archive.manifest["outputs"],
            "created": time.time(),
        },
    )
    store.put_manifest("jobs", job["key"], {"artifact": digest})
    run.ledger.grant_artifact(job["tenant"], digest)
    run.finish("done", artifact=digest, verification=verification)


def _known_artifact(store, key: str) -> str | None:
    from artifact_store import ManifestNotFound

    try:
        digest = store.get_manifest("jobs", key)["artifact"]
    except ManifestNotFound:
        return None
    return digest if store.has_blob(digest) else None


def _stored_manifest(store, digest: str) -> dict:
    """What was recorded with a stored artifact ({} when its manifest is gone)."""
    from artifact_store import ManifestNotFound

    try:
        return store.get_manifest("artifacts", digest)
    except ManifestNotFound:
        return {}


def _measure_latency(archive) -> float | None:
    """Median latency of the compiled module on random inputs, in milliseconds; None for a
    GPU archive on a worker without a GPU (it was built here, it runs elsewhere)."""
    import numpy as np

    from compiler_core.runtime import load
    from compiler_core.runtime.cuda import NoCudaDeviceError

    try:
        module = load(archive)
    except NoCudaDeviceError:
        return None
    rng = np.random.default_rng(0)
    feeds = {
        name: (rng.standard_normal(shape) if dtype.kind == "f" else np.zeros(shape)).astype(dtype)
        for name, shape, dtype in module.inputs
    }
    module.run(feeds)
    samples = []
    for _ in range(MEASURE_RUNS):
        started = time.perf_counter()
        module.run(feeds)
        samples.append(time.perf_counter() - started)
    return round(float(np.median(samples)) * 1000, 4)


def requeue_orphans(ledger: Ledger, lease_seconds: float, enqueue) -> list[str]:
    """Give every orphaned job back to the queue once (`enqueue(job)` sends its message)."""
    requeued = []
    for job in orphaned_jobs(ledger, lease_seconds):
        if ledger.release_job(job["id"], job.get("owner")) is not None:
            ledger.append_event(job["id"], {"type": "requeued", "previous_owner": job["owner"]})
            enqueue(job)
            requeued.append(job["id"])
    return requeued


def orphaned_jobs(ledger: Ledger, lease_seconds: float) -> list[dict]:
    """Running jobs whose owner is gone: a dead process on this host, or a lease run out."""
    now = time.time()
    return [
        job
        for job in ledger.active_jobs()
        if job["status"] == "running"
        and (owner_is_dead(job.get("owner")) or now - job.get("heartbeat", 0) > lease_seconds)
    ]
