"""The platform's settings: one typed object, read from `KILN_*` environment variables.

With no `KILN_REDIS_URL`, everything runs on one machine: Celery over SQLite, the job ledger in
SQLite, the filesystem artifact store, all under `KILN_DATA_DIR`. With it, the broker, the
result backend and the ledger are that Redis, shared by every api and worker replica.
"""

from __future__ import annotations

import hashlib
from functools import cached_property
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class KilnSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KILN_", extra="ignore")

    data_dir: Path = Field(default_factory=lambda: Path.home() / ".kiln")
    redis_url: str | None = None
    store_url: str | None = None
    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    # Comma-separated `tenant:key` pairs. Keys are hashed as soon as they are read.
    api_keys: str = ""
    max_upload_bytes: int = 512 * 2**20
    runtime_url: str = "http://127.0.0.1:8001"
    api_host: str = "127.0.0.1"
    api_port: int = 8000
    # A compile job's limits: the soft limit raises inside the task (the job fails with a
    # reason), the hard limit kills the process. The broker's visibility timeout stays above
    # the hard limit so Redis never redelivers a job that is still running.
    compile_soft_time_limit: int = 3600
    compile_hard_time_limit: int = 3900
    # A running job's owner heartbeats every `heartbeat_seconds`; a job whose heartbeat is
    # older than `job_lease_seconds` has lost its worker and is taken up again.
    heartbeat_seconds: float = 2.0
    job_lease_seconds: float = 20.0
    worker_concurrency: int = 1
    # The shared tuning log: a JSONL path or a redis:// URL. Default: the Redis the platform
    # uses, else `<data_dir>/tuning.jsonl`.
    tuning_log: str | None = None

    @field_validator("data_dir")
    @classmethod
    def _absolute(cls, value: Path) -> Path:
        return value.expanduser().resolve()

    @property
    def embedded(self) -> bool:
        return not self.redis_url

    @property
    def broker_url(self) -> str:
        return self.redis_url or f"sqla+sqlite:///{self.data_dir / 'celery-broker.sqlite'}"

    @property
    def result_backend(self) -> str:
        return self.redis_url or f"db+sqlite:///{self.data_dir / 'celery-results.sqlite'}"

    @property
    def ledger_path(self) -> Path:
        return self.data_dir / "ledger.sqlite"

    @property
    def resolved_tuning_log(self) -> str:
        return self.tuning_log or self.redis_url or str(self.data_dir / "tuning.jsonl")

    @property
    def resolved_store_url(self) -> str:
        return self.store_url or str(self.data_dir / "store")

    @cached_property
    def api_key_hashes(self) -> dict[str, str]:
        """sha256(key) -> tenant. Only hashes are kept in memory."""
        return parse_api_keys(self.api_keys)

    def store(self):
        from artifact_store import open_store

        return open_store(
            self.resolved_store_url, endpoint_url=self.s3_endpoint_url, region=self.s3_region
        )


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def parse_api_keys(text: str) -> dict[str, str]:
    hashes = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        tenant, sep, key = pair.partition(":")
        if not sep or not tenant or not key:
            raise ValueError(
                f"KILN_API_KEYS: expected tenant:key pairs, got {pair.split(':')[0]!r}"
            )
        hashes[hash_key(key)] = tenant
    return hashes
