"""Pick a backend from a URL, so services configure their store with one setting."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlsplit

from artifact_store.base import ArtifactStore
from artifact_store.errors import StoreError
from artifact_store.filesystem import FileStore
from artifact_store.s3 import S3Store


def open_store(
    url: str, *, endpoint_url: str | None = None, region: str | None = None
) -> ArtifactStore:
    """'s3://bucket/prefix' -> S3Store; 'file:///abs/path' or a plain path -> FileStore."""
    if not isinstance(url, str) or not url.strip():
        raise StoreError(f"cannot open an artifact store from {url!r}: the URL is empty")
    if "://" not in url:
        return FileStore(Path(url))
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "s3":
        if not parts.netloc:
            raise StoreError(f"cannot open an artifact store from {url!r}: no bucket named")
        return S3Store(parts.netloc, unquote(parts.path), endpoint_url=endpoint_url, region=region)
    if scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path:
            raise StoreError(
                f"cannot open an artifact store from {url!r}: expected file:///absolute/path"
            )
        return FileStore(Path(unquote(parts.path)))
    raise StoreError(
        f"cannot open an artifact store from {url!r}: expected s3://bucket/prefix, "
        "file:///path or a plain path"
    )
