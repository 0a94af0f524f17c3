"""The backend-independent half of the store: staged writes, the API and garbage collection.

A backend supplies where staging files live, how a finished staging file is published under
its digest, and the raw blob/manifest operations; everything that must behave the same on
every backend (hashing, limits, cleanup on failure, gc's mark and sweep) lives here once.
"""

from __future__ import annotations

import abc
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from artifact_store.errors import BlobNotFound, ManifestNotFound, StoreError, TooLarge
from artifact_store.naming import DIGEST_PATTERN, DIGEST_PREFIX


@dataclass(frozen=True)
class BlobInfo:
    """One stored blob as listed: its digest, size in bytes and modification time (epoch s)."""

    digest: str
    size: int
    modified: float


@dataclass
class GcReport:
    """What a gc run did (or, with dry_run, would do).

    `kept` counts referenced blobs; `young` lists unreferenced blobs spared because they are
    younger than the grace period; `deleted` lists unreferenced old blobs removed.
    """

    kept: int = 0
    deleted: list[str] = field(default_factory=list)
    young: list[str] = field(default_factory=list)
    freed_bytes: int = 0


class StagedBlob:
    """A blob being written: hashed as it streams into a local file, published only on commit.

    Use it as a context manager; leaving the block without `commit()` (or through an
    exception) deletes the staging file, so a failed upload leaves nothing behind.
    """

    def __init__(self, store: ArtifactStore, directory: Path, max_bytes: int | None) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise StoreError(f"max_bytes must be non-negative, got {max_bytes}")
        self._store = store
        self._max_bytes = max_bytes
        self._hash = hashlib.sha256()
        self._size = 0
        self._state = "open"  # open -> committed | discarded
        fd, name = tempfile.mkstemp(prefix="stage-", suffix=".part", dir=directory)
        self._path = Path(name)
        self._file = os.fdopen(fd, "wb")

    # -- writing --------------------------------------------------------------------------

    def write(self, chunk: bytes) -> None:
        """Append a chunk; raises TooLarge (and discards the staging) once past max_bytes."""
        self._require_open()
        view = memoryview(chunk).cast("B")
        if self._max_bytes is not None and self._size + view.nbytes > self._max_bytes:
            self.discard()
            raise TooLarge(self._max_bytes)
        self._file.write(view)
        self._hash.update(view)
        self._size += view.nbytes

    @property
    def size(self) -> int:
        """Bytes written so far."""
        return self._size

    @property
    def digest(self) -> str:
        """The digest of the bytes written so far (final once writing is finished)."""
        return DIGEST_PREFIX + self._hash.hexdigest()

    @property
    def path(self) -> Path:
        """The local staging file, flushed so a caller can read it back and validate it."""
        if self._state == "open":
            self._file.flush()
        return self._path

    # -- finishing ------------------------------------------------------------------------

    def commit(self) -> str:
        """Publish the blob atomically under its digest and return the digest.

        Committing bytes that are already stored is fine: the existing blob is kept.
        """
        if self._state == "committed":
            return self.digest
        self._require_open()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        try:
            self._store._publish(self._path, self.digest, self._size)
        except BaseException:
            self.discard()
            raise
        self._state = "committed"
        self._path.unlink(missing_ok=True)
        return self.digest

    def discard(self) -> None:
        """Drop the staging file; nothing becomes visible. Safe to call more than once."""
        if self._state != "open":
            return
        self._state = "discarded"
        self._file.close()
        self._path.unlink(missing_ok=True)

    def _require_open(self) -> None:
        if self._state != "open":
            raise StoreError(f"this staged blob is already {self._state}")

    def __enter__(self) -> StagedBlob:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.discard()


class ArtifactStore(abc.ABC):
    """Content-addressed blobs plus small JSON manifests that name them."""

    # -- blobs ----------------------------------------------------------------------------

    def stage(self, max_bytes: int | None = None) -> StagedBlob:
        """Start a streamed write; see StagedBlob."""
        return StagedBlob(self, self._staging_dir(), max_bytes)

    def put_blob(self, data: bytes) -> str:
        """Store `data` and return its digest (idempotent)."""
        with self.stage() as staged:
            staged.write(data)
            return staged.commit()

    @abc.abstractmethod
    def get_blob(self, digest: str) -> bytes:
        """The blob's bytes, verified against the digest (BlobNotFound, CorruptBlob)."""

    @abc.abstractmethod
    def has_blob(self, digest: str) -> bool:
        """Whether a blob is stored under the digest."""

    @abc.abstractmethod
    def blob_size(self, digest: str) -> int:
        """The stored blob's size in bytes (BlobNotFound)."""

    @abc.abstractmethod
    def delete_blob(self, digest: str) -> None:
        """Remove the blob (BlobNotFound when there is none)."""

    @abc.abstractmethod
    def list_blobs(self) -> Iterator[BlobInfo]:
        """Every stored blob, in no particular order."""

    # -- manifests ------------------------------------------------------------------------

    @abc.abstractmethod
    def put_manifest(self, kind: str, name: str, document: dict) -> None:
        """Store (or atomically replace) a JSON manifest."""

    @abc.abstractmethod
    def get_manifest(self, kind: str, name: str) -> dict:
        """The manifest's document (ManifestNotFound)."""

    @abc.abstractmethod
    def list_manifests(self, kind: str) -> list[str]:
        """The names of every manifest of `kind`, sorted."""

    @abc.abstractmethod
    def delete_manifest(self, kind: str, name: str) -> None:
        """Remove the manifest (ManifestNotFound when there is none)."""

    # -- garbage collection ---------------------------------------------------------------

    def gc(self, grace_seconds: float = 3600.0, dry_run: bool = False) -> GcReport:
        """Delete blobs no manifest references, sparing those younger than grace_seconds.

        The grace period protects an upload that has committed its blob but not yet written
        the manifest naming it; grace_seconds <= 0 deletes every unreferenced blob.
        """
        marked = self._mark()
        now = time.time()
        report = GcReport()
        for info in self.list_blobs():
            if info.digest in marked:
                report.kept += 1
            elif grace_seconds > 0 and now - info.modified < grace_seconds:
                report.young.append(info.digest)
            elif self._sweep(info.digest, dry_run):
                report.deleted.append(info.digest)
                report.freed_bytes += info.size
        return report

    def _mark(self) -> set[str]:
        """Every digest mentioned anywhere in any manifest of any kind."""
        marked: set[str] = set()
        for kind in self._manifest_kinds():
            for name in self.list_manifests(kind):
                try:
                    document = self.get_manifest(kind, name)
                except ManifestNotFound:
                    continue  # deleted while we were marking: it references nothing now
                _collect_digests(document, marked)
        return marked

    def _sweep(self, digest: str, dry_run: bool) -> bool:
        """Delete one blob; False when it vanished meanwhile (someone else swept it)."""
        if dry_run:
            return True
        try:
            self.delete_blob(digest)
        except BlobNotFound:
            return False
        return True

    # -- what a backend supplies ----------------------------------------------------------

    @abc.abstractmethod
    def _staging_dir(self) -> Path:
        """A local directory for staging files."""

    @abc.abstractmethod
    def _publish(self, staging: Path, digest: str, size: int) -> None:
        """Make the fsynced staging file visible under `digest`, leaving an existing blob be."""

    @abc.abstractmethod
    def _manifest_kinds(self) -> list[str]:
        """Every kind that has at least one manifest (gc marks across all of them)."""


def _collect_digests(value: object, into: set[str]) -> None:
    """Add every digest found in any string (keys included) of a JSON value."""
    if isinstance(value, str):
        into.update(DIGEST_PATTERN.findall(value))
    elif isinstance(value, dict):
        for key, item in value.items():
            _collect_digests(key, into)
            _collect_digests(item, into)
    elif isinstance(value, list):
        for item in value:
            _collect_digests(item, into)


def encode_manifest(kind: str, name: str, document: dict) -> bytes:
    """A manifest's stored form: sorted-key JSON, so equal documents store equal bytes."""
    if not isinstance(document, dict):
        raise StoreError(
            f"manifest {kind}/{name} must be a JSON object, got {type(document).__name__}"
        )
    try:
        text = json.dumps(document, sort_keys=True, indent=1, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise StoreError(f"manifest {kind}/{name} is not JSON-serializable: {exc}") from exc
    return text.encode("utf-8")


def decode_manifest(kind: str, name: str, data: bytes) -> dict:
    """Parse a stored manifest; a damaged one is an error, never an empty document."""
    try:
        document = json.loads(data)
    except ValueError as exc:
        raise StoreError(f"manifest {kind}/{name} is not valid JSON: {exc}") from exc
    if not isinstance(document, dict):
        raise StoreError(f"manifest {kind}/{name} does not hold a JSON object")
    return document
