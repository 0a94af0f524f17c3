"""A store in a local (or shared POSIX) directory.

Layout: root/blobs/sha256/ab/<hex>, root/manifests/<kind>/<name>.json, staging in root/tmp/.
Every write lands in root/tmp first (same filesystem), is fsynced and then linked or renamed
into place, and the directory is fsynced: a reader sees a whole file or none.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from artifact_store.base import ArtifactStore, BlobInfo, decode_manifest, encode_manifest
from artifact_store.errors import BlobNotFound, CorruptBlob, ManifestNotFound
from artifact_store.naming import (
    DIGEST_PREFIX,
    check_kind,
    check_name,
    digest_hex,
    digest_of,
    is_hex64,
    parse_digest,
)

_BLOB_MODE = 0o644


class FileStore(ArtifactStore):
    """Blobs and manifests under one root directory."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._blobs = self.root / "blobs" / "sha256"
        self._manifests = self.root / "manifests"
        self._tmp = self.root / "tmp"
        for directory in (self._blobs, self._manifests, self._tmp):
            directory.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"FileStore({str(self.root)!r})"

    # -- blobs ----------------------------------------------------------------------------

    def get_blob(self, digest: str) -> bytes:
        digest = parse_digest(digest)
        try:
            data = self._blob_path(digest).read_bytes()
        except FileNotFoundError:
            raise BlobNotFound(digest) from None
        actual = digest_of(data)
        if actual != digest:
            raise CorruptBlob(digest, actual)
        return data

    def has_blob(self, digest: str) -> bool:
        return self._blob_path(digest).is_file()

    def blob_size(self, digest: str) -> int:
        digest = parse_digest(digest)
        try:
            return self._blob_path(digest).stat().st_size
        except FileNotFoundError:
            raise BlobNotFound(digest) from None

    def delete_blob(self, digest: str) -> None:
        digest = parse_digest(digest)
        path = self._blob_path(digest)
        try:
            path.unlink()
        except FileNotFoundError:
            raise BlobNotFound(digest) from None
        _fsync_dir(path.parent)

    def list_blobs(self) -> Iterator[BlobInfo]:
        for fanout in _scandir(self._blobs):
            if not fanout.is_dir():
                continue
            for entry in _scandir(Path(fanout.path)):
                # Skip anything that is not a blob in its right fan-out folder.
                if not (is_hex64(entry.name) and entry.name[:2] == fanout.name):
                    continue
                try:
                    stat = entry.stat()
                except FileNotFoundError:
                    continue  # deleted since the directory was read
                yield BlobInfo(DIGEST_PREFIX + entry.name, stat.st_size, stat.st_mtime)

    # -- manifests ------------------------------------------------------------------------

    def put_manifest(self, kind: str, name: str, document: dict) -> None:
        data = encode_manifest(kind, name, document)
        target = self._manifest_path(kind, name)
        _make_dirs(target.parent)
        self._atomic_write(target, data)

    def get_manifest(self, kind: str, name: str) -> dict:
        try:
            data = self._manifest_path(kind, name).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            raise ManifestNotFound(kind, name) from None
        return decode_manifest(kind, name, data)

    def list_manifests(self, kind: str) -> list[str]:
        directory = self._manifests / check_kind(kind)
        names = []
        for path in directory.rglob("*.json"):
            name = path.relative_to(directory).as_posix()[: -len(".json")]
            with contextlib.suppress(Exception):
                names.append(check_name(name))  # a stray file with an odd name is no manifest
        return sorted(names)

    def delete_manifest(self, kind: str, name: str) -> None:
        path = self._manifest_path(kind, name)
        try:
            path.unlink()
        except (FileNotFoundError, NotADirectoryError):
            raise ManifestNotFound(kind, name) from None
        _fsync_dir(path.parent)

    # -- backend hooks --------------------------------------------------------------------

    def _staging_dir(self) -> Path:
        return self._tmp

    def _publish(self, staging: Path, digest: str, size: int) -> None:
        final = self._blob_path(digest)
        _make_dirs(final.parent)
        os.chmod(staging, _BLOB_MODE)
        try:
            # A hard link never replaces an existing file, so a concurrent writer of the same
            # bytes (or an existing blob) is left untouched.
            os.link(staging, final)
        except FileExistsError:
            # Restart the grace clock: the caller is about to reference this blob, and gc
            # must not take it in between because an earlier copy was old.
            os.utime(final)
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                raise
            os.replace(staging, final)  # no hard links here: same bytes, so replacing is fine
        _fsync_dir(final.parent)

    def _manifest_kinds(self) -> list[str]:
        kinds = []
        for entry in _scandir(self._manifests):
            with contextlib.suppress(Exception):
                if entry.is_dir():
                    kinds.append(check_kind(entry.name))
        return sorted(kinds)

    # -- paths and writes -----------------------------------------------------------------

    def _blob_path(self, digest: str) -> Path:
        hex_digits = digest_hex(digest)
        return self._blobs / hex_digits[:2] / hex_digits

    def _manifest_path(self, kind: str, name: str) -> Path:
        return self._manifests / check_kind(kind) / (check_name(name) + ".json")

    def _atomic_write(self, target: Path, data: bytes) -> None:
        """Write through a temp file in root/tmp, then rename over `target`."""
        fd, name = tempfile.mkstemp(prefix="manifest-", suffix=".part", dir=self._tmp)
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            os.replace(name, target)
        except BaseException:
            Path(name).unlink(missing_ok=True)
            raise
        _fsync_dir(target.parent)


def _scandir(directory: Path) -> list[os.DirEntry]:
    """Directory entries, or none when the directory does not exist."""
    try:
        with os.scandir(directory) as entries:
            return list(entries)
    except FileNotFoundError:
        return []


def _make_dirs(directory: Path) -> None:
    """Create a directory chain, fsyncing each parent that gained an entry."""
    if directory.is_dir():
        return
    _make_dirs(directory.parent)
    try:
        directory.mkdir()
    except FileExistsError:
        return
    _fsync_dir(directory.parent)


def _fsync_dir(directory: Path) -> None:
    """Make a rename or link in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
