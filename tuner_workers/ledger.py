"""The platform's records: models, compilation jobs with their event streams, deployments.

The job records, not the broker, are the truth about a job (DESIGN §7): a worker claims a job
before running it, heartbeats while it runs, and a job whose owner stopped heartbeating is
taken up again by another worker. Two backends share one `Ledger` written over five
primitives: documents, compare-and-set updates, sets, and append-only event streams. Redis is
the shared backend; SQLite (one file under the data dir) is the embedded default.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path

TERMINAL = frozenset({"done", "failed", "cancelled"})
# A tuning task ends done (its budget spent or its search converged) or failed (an error its
# record says; the job builds with whatever the log holds).
TUNING_ENDED = frozenset({"done", "failed"})
Update = Callable[[dict], dict | None]  # new document, or None to leave it as it is


class Backend(ABC):
    @abstractmethod
    def get(self, kind: str, key: str) -> dict | None: ...

    @abstractmethod
    def put(self, kind: str, key: str, doc: dict) -> None: ...

    @abstractmethod
    def delete(self, kind: str, key: str) -> None: ...

    @abstractmethod
    def update(self, kind: str, key: str, change: Update) -> dict | None:
        """Atomically apply `change` to the stored document; returns the new one, or None when
        there is no such document or `change` declined."""

    @abstractmethod
    def add_member(self, group: str, member: str) -> None: ...

    @abstractmethod
    def remove_member(self, group: str, member: str) -> None: ...

    @abstractmethod
    def members(self, group: str) -> list[str]: ...

    @abstractmethod
    def append(self, stream: str, event: dict) -> str: ...

    @abstractmethod
    def read(self, stream: str, after: str | None) -> list[tuple[str, dict]]: ...


class RedisBackend(Backend):
    def __init__(self, url: str, prefix: str = "kiln"):
        import redis

        self.client = redis.Redis.from_url(url, decode_responses=True)
        self.prefix = prefix

    def _key(self, kind: str, key: str) -> str:
        return f"{self.prefix}:{kind}:{key}"

    def get(self, kind, key):
        raw = self.client.get(self._key(kind, key))
        return None if raw is None else json.loads(raw)

    def put(self, kind, key, doc):
        self.client.set(self._key(kind, key), json.dumps(doc))

    def delete(self, kind, key):
        self.client.delete(self._key(kind, key))

    def update(self, kind, key, change):
        import redis

        name = self._key(kind, key)
        with self.client.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(name)
                    raw = pipe.get(name)
                    new = None if raw is None else change(json.loads(raw))
                    if new is None:
                        pipe.unwatch()
                        return None
                    pipe.multi()
                    pipe.set(name, json.dumps(new))
                    pipe.execute()
                    return new
                except redis.WatchError:
                    continue  # someone else changed it between read and write: read again

    def add_member(self, group, member):
        self.client.sadd(self._key("set", group), member)

    def remove_member(self, group, member):
        self.client.srem(self._key("set", group), member)

    def members(self, group):
        return sorted(self.client.smembers(self._key("set", group)))

    def append(self, stream, event):
        return self.client.xadd(self._key("events", stream), {"json": json.dumps(event)})

    def read(self, stream, after):
        start = f"({after}" if after else "-"
        try:
            entries = self.client.xrange(self._key("events", stream), min=start)
        except Exception as err:  # a malformed Last-Event-ID: read from the start instead
            if "Invalid stream ID" not in str(err):
                raise
            entries = self.client.xrange(self._key("events", stream))
        return [(entry_id, json.loads(fields["json"])) for entry_id, fields in entries]


class SqliteBackend(Backend):
    """One file shared by the api and worker processes (WAL mode: readers never block the
    writer). A connection per call keeps it safe across threads and forked workers."""

    SCHEMA = """
    CREATE TABLE IF NOT EXISTS docs (kind TEXT, key TEXT, doc TEXT, PRIMARY KEY (kind, key));
    CREATE TABLE IF NOT EXISTS members (grp TEXT, member TEXT, PRIMARY KEY (grp, member));
    CREATE TABLE IF NOT EXISTS events (
        id INTEGER PRIMARY KEY AUTOINCREMENT, stream TEXT, doc TEXT);
    CREATE INDEX IF NOT EXISTS events_by_stream ON events (stream, id);
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.executescript(self.SCHEMA)

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        try:
            db.execute("PRAGMA busy_timeout=30000")
            yield db
        finally:
            db.close()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")  # take the write lock before reading
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def get(self, kind, key):
        with self._connect() as db:
            row = db.execute("SELECT doc FROM docs WHERE kind=? AND key=?", (kind, key)).fetchone()
        return None if row is None else json.loads(row[0])

    def put(self, kind, key, doc):
        with self._connect() as db:
            db.execute(
                "INSERT OR REPLACE INTO docs (kind, key, doc) VALUES (?, ?, ?)",
                (kind, key, json.dumps(doc)),
            )

    def delete(self, kind, key):
        with self._connect() as db:
            db.execute("DELETE FROM docs WHERE kind=? AND key=?", (kind, key))

    def update(self, kind, key, change):
        with self._transaction() as db:
            row = db.execute("SELECT doc FROM docs WHERE kind=? AND key=?", (kind, key)).fetchone()
            new = None if row is None else change(json.loads(row[0]))
            if new is not None:
                db.execute(
                    "UPDATE docs SET doc=? WHERE kind=? AND key=?", (json.dumps(new), kind, key)
                )
            return new

    def add_member(self, group, member):
        with self._connect() as db:
            db.execute("INSERT OR IGNORE INTO members VALUES (?, ?)", (group, member))

    def remove_member(self, group, member):
        with self._connect() as db:
            db.execute("DELETE FROM members WHERE grp=? AND member=?", (group, member))

    def members(self, group):
        with self._connect() as db:
            rows = db.execute("SELECT member FROM members WHERE grp=? ORDER BY member", (group,))
            return [member for (member,) in rows]

    def append(self, stream, event):
        with self._connect() as db:
            cursor = db.execute(
                "INSERT INTO events (stream, doc) VALUES (?, ?)", (stream, json.dumps(event))
            )
            return str(cursor.lastrowid)

    def read(self, stream, after):
        try:
            after_id = int(after) if after else 0
        except ValueError:  # a malformed Last-Event-ID: read from the start instead
            after_id = 0
        with self._connect() as db:
            rows = db.execute(
                "SELECT id, doc FROM events WHERE stream=? AND id>? ORDER BY id", (stream, after_id)
            ).fetchall()
        return [(str(row_id), json.loads(doc)) for row_id, doc in rows]


class Ledger:
    """Models, jobs and deployments, scoped by tenant."""

    def __init__(self, backend: Backend):
        self.backend = backend

    # --- models ---------------------------------------------------------------------------

    def add_model(self, tenant: str, record: dict) -> dict:
        """Record an upload for `tenant`; the same bytes twice keep the first record."""
        key = f"{tenant}/{record['id']}"
        existing = self.backend.get("model", key)
        if existing is not None:
            return existing
        self.backend.put("model", key, record)
        self.backend.add_member(f"models/{tenant}", record["id"])
        return record

    def get_model(self, tenant: str, model_id: str) -> dict | None:
        return self.backend.get("model", f"{tenant}/{model_id}")

    def list_models(self, tenant: str) -> list[dict]:
        found = (self.get_model(tenant, m) for m in self.backend.members(f"models/{tenant}"))
        return sorted(filter(None, found), key=lambda r: r["created"])

    # --- compilation jobs -------------------------------------------------------------------

    def create_job(self, record: dict) -> dict:
        self.backend.put("job", record["id"], record)
        self.backend.add_member(f"jobs/{record['tenant']}", record["id"])
        self.backend.add_member("jobs/active", record["id"])
        return record

    def get_job(self, job_id: str) -> dict | None:
        return self.backend.get("job", job_id)

    def list_jobs(self, tenant: str) -> list[dict]:
        found = (self.get_job(j) for j in self.backend.members(f"jobs/{tenant}"))
        return sorted(filter(None, found), key=lambda r: r["created"])

    def active_jobs(self) -> list[dict]:
        return list(filter(None, map(self.get_job, self.backend.members("jobs/active"))))

    def update_job(self, job_id: str, **fields) -> dict | None:
        """Change a job that has not ended; an ended job is never changed again."""

        def change(job: dict) -> dict | None:
            if job["status"] in TERMINAL:
                return None
            return {**job, **fields, "updated": time.time()}

        job = self.backend.update("job", job_id, change)
        if job is not None and job["status"] in TERMINAL:
            self.backend.remove_member("jobs/active", job_id)
        return job

    def claim_job(self, job_id: str, owner: str, lease_seconds: float) -> dict | None:
        """Take `job_id` for `owner` unless another owner holds a live lease on it."""
        now = time.time()

        def change(job: dict) -> dict | None:
            if job["status"] in TERMINAL:
                return None
            held = job.get("owner") not in (None, owner)
            if held and now - job.get("heartbeat", 0) < lease_seconds:
                return None
            attempts = job.get("attempts", 0) + 1
            return {**job, "owner": owner, "heartbeat": now, "status": "running",
                    "attempts": attempts, "updated": now}  # fmt: skip

        return self.backend.update("job", job_id, change)

    def release_job(self, job_id: str, owner: str | None) -> dict | None:
        """Put a running job back in the queue, if `owner` still holds it."""

        def change(job: dict) -> dict | None:
            if job["status"] != "running" or job.get("owner") != owner:
                return None
            return {**job, "status": "queued", "stage": "queued", "owner": None,
                    "updated": time.time()}  # fmt: skip

        return self.backend.update("job", job_id, change)

    def heartbeat(self, job_id: str, owner: str) -> bool:
        """Renew `owner`'s lease; False once the job is no longer its own (or has ended)."""

        def change(job: dict) -> dict | None:
            if job.get("owner") != owner or job["status"] in TERMINAL:
                return None
            return {**job, "heartbeat": time.time()}

        return self.backend.update("job", job_id, change) is not None

    def append_event(self, job_id: str, event: dict) -> str:
        return self.backend.append(f"job/{job_id}", {**event, "time": time.time()})

    def read_events(self, job_id: str, after: str | None = None) -> list[tuple[str, dict]]:
        return self.backend.read(f"job/{job_id}", after)

    # --- a job's tuning tasks (one per workload, fanned out to the workers) -------------------

    def add_tuning_tasks(self, job_id: str, tasks: list[dict]) -> list[dict]:
        """Record the workloads job `job_id` tunes (each a dict with its `key` and budget),
        pending; a job taken up again keeps what its earlier attempt recorded."""
        for task in tasks:
            name = f"{job_id}/{task['key']}"
            if self.backend.get("tuning", name) is None:
                self.backend.put("tuning", name, {**task, "job": job_id, "status": "pending",
                                                  "owner": None, "heartbeat": 0, "trials": 0,
                                                  "attempts": 0})  # fmt: skip
            self.backend.add_member(f"tuning/{job_id}", task["key"])
        return self.tuning_tasks(job_id)

    def tuning_tasks(self, job_id: str) -> list[dict]:
        keys = self.backend.members(f"tuning/{job_id}")
        found = (self.get_tuning_task(job_id, key) for key in keys)
        return sorted(filter(None, found), key=lambda t: t.get("index", 0))

    def get_tuning_task(self, job_id: str, key: str) -> dict | None:
        return self.backend.get("tuning", f"{job_id}/{key}")

    def claim_tuning_task(
        self, job_id: str, key: str, owner: str, lease_seconds: float
    ) -> dict | None:
        """Take a pending tuning task, or one whose owner's lease ran out, for `owner`."""
        now = time.time()

        def change(task: dict) -> dict | None:
            if task["status"] in TUNING_ENDED:
                return None
            held = task["status"] == "running" and task.get("owner") != owner
            if held and now - task.get("heartbeat", 0) < lease_seconds:
                return None
            return {**task, "status": "running", "owner": owner, "heartbeat": now,
                    "attempts": task.get("attempts", 0) + 1}  # fmt: skip

        return self.backend.update("tuning", f"{job_id}/{key}", change)

    def update_tuning_task(self, job_id: str, key: str, owner: str, **fields) -> dict | None:
        """Record progress (and renew the lease) of a tuning task `owner` holds; None once it
        is not its own any more or has ended."""

        def change(task: dict) -> dict | None:
            if task.get("owner") != owner or task["status"] in TUNING_ENDED:
                return None
            return {**task, **fields, "heartbeat": time.time()}

        return self.backend.update("tuning", f"{job_id}/{key}", change)

    def give_spare(self, job_id: str, trials: int = 0, seconds: float = 0.0) -> None:
        """Return budget a workload did not use (its search converged first) to the job."""

        def change(job: dict) -> dict | None:
            spare = job.get("tuning_spare") or {"trials": 0, "seconds": 0.0}
            return {**job, "tuning_spare": {"trials": spare["trials"] + trials,
                                            "seconds": spare["seconds"] + seconds}}  # fmt: skip

        self.backend.update("job", job_id, change)

    def take_spare(self, job_id: str) -> tuple[int, float]:
        """Take all of a job's spare tuning budget (trials, seconds) for one workload."""
        taken = {}

        def change(job: dict) -> dict | None:
            spare = job.get("tuning_spare") or {}
            taken.update(spare)
            if not spare.get("trials") and not spare.get("seconds"):
                return None
            return {**job, "tuning_spare": {"trials": 0, "seconds": 0.0}}

        self.backend.update("job", job_id, change)
        return int(taken.get("trials", 0)), float(taken.get("seconds", 0.0))

    # --- artifacts and deployments ----------------------------------------------------------

    def grant_artifact(self, tenant: str, digest: str) -> None:
        self.backend.add_member(f"artifacts/{tenant}", digest)

    def owns_artifact(self, tenant: str, digest: str) -> bool:
        return digest in self.backend.members(f"artifacts/{tenant}")

    def put_deployment(self, record: dict) -> None:
        self.backend.put("deployment", record["name"], record)
        self.backend.add_member(f"deployments/{record['tenant']}", record["name"])

    def get_deployment(self, name: str) -> dict | None:
        return self.backend.get("deployment", name)

    def delete_deployment(self, name: str, tenant: str) -> None:
        self.backend.delete("deployment", name)
        self.backend.remove_member(f"deployments/{tenant}", name)

    def list_deployments(self, tenant: str) -> list[dict]:
        names = self.backend.members(f"deployments/{tenant}")
        return list(filter(None, map(self.get_deployment, names)))


def open_ledger(settings) -> Ledger:
    if settings.redis_url:
        return Ledger(RedisBackend(settings.redis_url))
    return Ledger(SqliteBackend(settings.ledger_path))
