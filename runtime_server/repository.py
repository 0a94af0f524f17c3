"""The model repository: loaded module archives by model name and version.

Plain service code (no HTTP here). Each loaded version owns a pool of `Module` instances
loaded from the same archive bytes; a request borrows one instance for the duration of one
run, because a Module has a single workspace and two concurrent runs on it would corrupt each
other's intermediates.
"""

from __future__ import annotations

import queue
import re
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field

import numpy as np

from artifact_store import BlobNotFound, CorruptBlob, InvalidDigest, StoreError
from compiler_core.runtime import ArchiveError, InputError, Module, load
from compiler_core.runtime.cuda import NoCudaDeviceError
from compiler_core.runtime.library import set_num_threads
from compiler_core.runtime.module import request_batch
from runtime_server.batching import BatcherClosed, DynamicBatcher

READY = "READY"
UNAVAILABLE = "UNAVAILABLE"
DEFAULT_VERSION = "1"

# Names and versions travel in URL paths and metric labels: keep them to a plain alphabet.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_VERSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

Signature = list[tuple[str, tuple[int, ...], np.dtype]]


class RepositoryError(Exception):
    """Base of the repository's errors; the HTTP layer maps each subclass to a status."""


class ModelNotFound(RepositoryError):  # noqa: N818 (public API names)
    """No model (or no such version of it) has ever been loaded under the name."""


class ModelNotReady(RepositoryError):  # noqa: N818 (public API names)
    """The model is known but the requested version is not loaded (unloaded or failed)."""


class InvalidRequest(RepositoryError):  # noqa: N818 (public API names)
    """A request the caller can fix: a bad name, version, artifact or inputs."""


class ArtifactMissing(RepositoryError):  # noqa: N818 (public API names)
    """The artifact named in a load request is not in the store."""


class StoreUnavailable(RepositoryError):  # noqa: N818 (public API names)
    """The store failed for a reason that is not the caller's (corrupt blob, unreachable)."""


def version_key(version: str) -> tuple[int, int, str]:
    """Order versions numerically when they are numbers, lexically otherwise (numbers first),
    so "10" is later than "9" as Triton's integer versions are."""
    if version.isdigit():
        return (1, int(version), "")
    return (0, 0, version)


def _dynamic_batch(signature: Signature, buckets: list[int] | None) -> Signature:
    if not buckets:
        return list(signature)
    return [(name, (-1, *shape[1:]), dtype) for name, shape, dtype in signature]


class InstancePool:
    """N modules loaded from one archive; `borrow()` hands out one at a time per instance.

    With `batch_delay` (seconds, 0 included) and an archive compiled with batch buckets,
    concurrent requests are batched (`runtime_server/batching.py`); None turns that off."""

    def __init__(
        self,
        modules: list[Module],
        num_threads: int | None = None,
        batch_delay: float | None = None,
    ):
        if not modules:
            raise ValueError("an instance pool needs at least one module")
        self.batch_buckets: list[int] | None = modules[0].batch_buckets
        # A bucketed archive takes any batch up to its largest bucket: axis 0 is -1 (dynamic)
        # in the signature the protocol checks and the metadata shows, as in Triton.
        self.inputs: Signature = _dynamic_batch(modules[0].inputs, self.batch_buckets)
        self.outputs: Signature = _dynamic_batch(modules[0].outputs, self.batch_buckets)
        self.manifest: dict = dict(modules[0].manifest)
        self.size = len(modules)
        self._num_threads = num_threads
        self._free: queue.Queue[Module] = queue.Queue()
        for module in modules:
            self._free.put(module)
        self.batcher: DynamicBatcher | None = None
        if self.batch_buckets and batch_delay is not None:
            self.batcher = DynamicBatcher(
                self._run_one,
                self._request_batch,
                self.batch_buckets[-1],
                batch_delay,
                workers=self.size,
            )

    @contextmanager
    def borrow(self) -> Iterator[Module]:
        module = self._free.get()
        try:
            yield module
        finally:
            self._free.put(module)

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.batcher is None:
            return self._run_one(inputs)
        try:
            return self.batcher.submit(inputs)
        except BatcherClosed:
            raise ModelNotReady("the model version was unloaded or replaced: retry") from None

    def close(self) -> None:
        """Stop batching once what is queued has run (the version was unloaded or replaced)."""
        if self.batcher is not None:
            self.batcher.close()

    def _request_batch(self, inputs: Mapping[str, np.ndarray]) -> int:
        try:
            return request_batch(self.inputs, self.batch_buckets or [], inputs)
        except InputError as err:
            raise InvalidRequest(str(err)) from None

    def _run_one(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        with self.borrow() as module:
            if self._num_threads:
                # Kernel libraries built before Kiln's own pool run on OpenMP, whose
                # omp_set_num_threads is per calling thread: set it on the serving thread.
                set_num_threads(self._num_threads)
            try:
                return module.run(inputs)
            except InputError as err:
                raise InvalidRequest(str(err)) from None


@dataclass
class ModelVersion:
    """One version of a model: its artifact, and its pool while it is loaded."""

    name: str
    version: str
    artifact: str
    pool: InstancePool | None = None
    reason: str = ""

    @property
    def state(self) -> str:
        return READY if self.pool is not None else UNAVAILABLE

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        pool = self.pool
        if pool is None:
            raise ModelNotReady(_not_ready_message(self))
        return pool.run(inputs)


@dataclass
class ModelMetadata:
    name: str
    version: str
    versions: list[str]
    inputs: Signature
    outputs: Signature
    manifest: dict = field(default_factory=dict)


def _not_ready_message(entry: ModelVersion) -> str:
    why = f": {entry.reason}" if entry.reason else ""
    return f"model '{entry.name}' version '{entry.version}' is not ready{why}"


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise InvalidRequest(
            f"invalid model name {name!r}: use letters, digits, '.', '_' and '-' (at most 128)"
        )
    return name


def check_version(version: str) -> str:
    if not isinstance(version, str) or not _VERSION_RE.fullmatch(version):
        raise InvalidRequest(
            f"invalid model version {version!r}: use letters, digits, '.', '_' and '-'"
        )
    return version


class ModelRepository:
    """Models by name and version. Thread-safe: loads and requests may run concurrently."""

    def __init__(
        self,
        store,
        instances: int = 2,
        num_threads: int | None = None,
        batch_delay: float | None = 0.0,
    ):
        """`batch_delay`: how long a batch waits for more requests, in seconds, on archives
        compiled with batch buckets (None: no dynamic batching)."""
        if instances < 1:
            raise ValueError("a loaded model needs at least one instance")
        self._store = store
        self._instances = instances
        self._num_threads = num_threads
        self._batch_delay = batch_delay
        # name -> version -> entry. Entries stay after unload so a model can be reloaded by
        # name and so the index can report it as UNAVAILABLE.
        self._models: dict[str, dict[str, ModelVersion]] = {}
        self._synced: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    @property
    def store(self):
        return self._store

    # -- loading -------------------------------------------------------------------------

    def load(self, name: str, artifact: str | None = None, version: str | None = None) -> None:
        """Load `artifact` as `name`/`version`, or with no artifact reload what `name` had."""
        check_name(name)
        if artifact is None:
            if version is not None:
                check_version(version)
            self._reload(name, version)
            return
        version = check_version(version or DEFAULT_VERSION)
        pool = self._build_pool(artifact)
        with self._lock:
            versions = self._models.setdefault(name, {})
            previous = versions.get(version)
            versions[version] = ModelVersion(name, version, artifact, pool)
        if previous is not None and previous.pool is not None:
            previous.pool.close()

    def _reload(self, name: str, version: str | None) -> None:
        with self._lock:
            known = dict(self._models.get(name, {}))
        if not known:
            raise ModelNotFound(
                f"model '{name}' is unknown: give parameters.artifact ('sha256:...') to load it"
            )
        if version is not None and version not in known:
            raise ModelNotFound(f"model '{name}' has no version '{version}' to reload")
        targets = [known[version]] if version is not None else list(known.values())
        failures: list[RepositoryError] = []
        for entry in targets:
            try:
                pool = self._build_pool(entry.artifact)
            except RepositoryError as err:
                # A version still loaded keeps serving (as Triton keeps a model whose reload
                # failed); one that was not reports this reason in the index.
                self._record_failure(entry, str(err))
                failures.append(err)
                continue
            self._set_pool(entry, pool)
        if failures:
            # Raise the first failure's kind so the caller gets its status; name them all.
            raise type(failures[0])("; ".join(str(err) for err in failures))

    def _set_pool(self, entry: ModelVersion, pool: InstancePool) -> None:
        with self._lock:
            previous, entry.pool = entry.pool, pool
            entry.reason = ""
        if previous is not None:
            previous.close()

    def _record_failure(self, entry: ModelVersion, reason: str) -> None:
        with self._lock:
            if entry.pool is None:
                entry.reason = reason

    def _build_pool(self, artifact: str) -> InstancePool:
        data = self._fetch(artifact)
        try:
            modules = [load(data, self._num_threads) for _ in range(self._instances)]
        except ArchiveError as err:
            raise InvalidRequest(f"artifact {artifact} is not a module archive: {err}") from None
        except NoCudaDeviceError as err:  # a GPU archive on a server without a GPU
            raise InvalidRequest(f"artifact {artifact} cannot run on this server: {err}") from None
        return InstancePool(modules, self._num_threads, self._batch_delay)

    def _fetch(self, artifact: str) -> bytes:
        if not isinstance(artifact, str):
            raise InvalidRequest(f"artifact must be a 'sha256:<hex>' string, not {artifact!r}")
        try:
            return self._store.get_blob(artifact)
        except InvalidDigest as err:
            raise InvalidRequest(str(err)) from None
        except BlobNotFound:
            raise ArtifactMissing(f"artifact {artifact} is not in the artifact store") from None
        except CorruptBlob as err:
            raise StoreUnavailable(str(err)) from None
        except StoreError as err:
            raise StoreUnavailable(f"artifact store failed: {err}") from None

    def unload(self, name: str, version: str | None = None) -> None:
        """Unload `version` of `name`, or every version. Requests already running finish on
        their instance: they hold the pool, and the modules are freed when the last of them
        returns."""
        with self._lock:
            versions = self._models.get(name)
            if not versions:
                raise ModelNotFound(f"model '{name}' is unknown")
            if version is not None and version not in versions:
                raise ModelNotFound(f"model '{name}' has no version '{version}'")
            for entry in versions.values() if version is None else [versions[version]]:
                if entry.pool is not None:
                    entry.pool.close()
                entry.pool = None
                entry.reason = "unloaded"

    def sync(self, wanted: Mapping[tuple[str, str], str]) -> list[str]:
        """Converge on the deployments the store lists, {(name, version): artifact}: load what
        is missing or changed, unload what an earlier sync loaded and is no longer wanted
        (models loaded through the repository API are left alone). Every replica of the
        server runs this, so all of them serve every deployment. Returns what failed."""
        failures = []
        for (name, version), artifact in sorted(wanted.items()):
            with self._lock:
                entry = self._models.get(name, {}).get(version)
            if entry is not None and entry.artifact == artifact and entry.pool is not None:
                continue
            try:
                self.load(name, artifact, version)
            except RepositoryError as err:
                failures.append(f"{name}/{version}: {err}")
        for name, version in sorted(self._synced - set(wanted)):
            with suppress(ModelNotFound):
                self.unload(name, version)
        self._synced = set(wanted)
        return failures

    # -- queries -------------------------------------------------------------------------

    def index(self, ready_only: bool = False) -> list[dict]:
        with self._lock:
            entries = [e for versions in self._models.values() for e in versions.values()]
        rows = [
            {"name": e.name, "version": e.version, "state": e.state, "reason": e.reason}
            for e in sorted(entries, key=lambda e: (e.name, version_key(e.version)))
        ]
        return [row for row in rows if row["state"] == READY] if ready_only else rows

    def batch_stats(self) -> list:
        """[(model, version, BatchStats)] of the loaded versions that batch requests."""
        with self._lock:
            entries = [e for versions in self._models.values() for e in versions.values()]
        return [
            (e.name, e.version, e.pool.batcher.stats)
            for e in entries
            if e.pool is not None and e.pool.batcher is not None
        ]

    def ready_count(self) -> int:
        return sum(1 for row in self.index() if row["state"] == READY)

    def get(self, name: str, version: str | None = None) -> ModelVersion:
        """The READY version asked for; the latest READY one when `version` is None."""
        with self._lock:
            versions = dict(self._models.get(name, {}))
        if not versions:
            raise ModelNotFound(f"model '{name}' is unknown")
        if version:
            entry = versions.get(version)
            if entry is None:
                raise ModelNotFound(f"model '{name}' has no version '{version}'")
            if entry.pool is None:
                raise ModelNotReady(_not_ready_message(entry))
            return entry
        ready = [e for e in versions.values() if e.pool is not None]
        if not ready:
            reasons = sorted({e.reason for e in versions.values() if e.reason})
            why = f" ({'; '.join(reasons)})" if reasons else ""
            raise ModelNotReady(f"model '{name}' is not ready: no version is loaded{why}")
        return max(ready, key=lambda e: version_key(e.version))

    def metadata(self, name: str, version: str | None = None) -> ModelMetadata:
        entry = self.get(name, version)
        pool = entry.pool
        if pool is None:  # unloaded between get() and here
            raise ModelNotReady(_not_ready_message(entry))
        ready = [row["version"] for row in self.index(ready_only=True) if row["name"] == name]
        return ModelMetadata(name, entry.version, ready, pool.inputs, pool.outputs, pool.manifest)

    def infer(
        self, name: str, version: str | None, inputs: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        return self.get(name, version).run(inputs)
