"""The runtime server's settings: one typed object, read from `KILN_*` environment variables."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_data_dir() -> Path:
    return Path.home() / ".kiln"


class RuntimeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KILN_")

    data_dir: Path = Field(default_factory=_default_data_dir)
    # None: a local store under data_dir, so a single machine needs no configuration.
    store_url: str | None = None
    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    # Module instances per loaded model version: a Module has one workspace, so this is the
    # number of requests one version can run at the same time.
    runtime_instances: int = Field(default=2, ge=1)
    # Dynamic batching of archives compiled with batch buckets: requests queued together run
    # as one batch, a batch waiting up to this long for more (0: only what is already queued,
    # no added latency); negative turns batching off.
    runtime_batch_delay_ms: float = 0.0
    # Threads per instance (None: the runtime's default, every core).
    num_threads: int | None = Field(default=None, ge=1)
    # How often to converge on the deployments listed in the store (0: never). Every replica
    # loads every deployment, so the api's load request needs to reach only one of them.
    runtime_sync_seconds: float = Field(default=5.0, ge=0)
    runtime_access_log: bool = False
    runtime_host: str = "127.0.0.1"
    runtime_port: int = Field(default=8001, ge=0, le=65535)

    @property
    def batch_delay(self) -> float | None:
        """Seconds a batch may wait, or None when dynamic batching is off."""
        if self.runtime_batch_delay_ms < 0:
            return None
        return self.runtime_batch_delay_ms / 1000.0

    def resolved_store_url(self) -> str:
        return self.store_url or str(self.data_dir / "store")

    def store(self):
        """Open the artifact store these settings name."""
        # Imported here so that reading settings never needs the store's dependencies.
        from artifact_store import open_store

        return open_store(
            self.resolved_store_url(),
            endpoint_url=self.s3_endpoint_url,
            region=self.s3_region,
        )
