"""A store in an S3 bucket (AWS, MinIO, moto ...), under an optional key prefix.

Layout: <prefix>/blobs/sha256/<hex>, <prefix>/manifests/<kind>/<name>.json. Blobs are staged
to a local temp file, then uploaded create-only (If-None-Match: *), so an existing blob is
never overwritten; S3 makes a single PUT visible whole or not at all.
boto3 is imported only when an S3Store is built: the filesystem store needs none of it.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from artifact_store.base import ArtifactStore, BlobInfo, decode_manifest, encode_manifest
from artifact_store.errors import BlobNotFound, CorruptBlob, ManifestNotFound, StoreError
from artifact_store.naming import (
    DIGEST_PREFIX,
    check_kind,
    check_name,
    digest_hex,
    digest_of,
    is_hex64,
    parse_digest,
)

_MISSING_CODES = {"NoSuchKey", "404", "NotFound"}
_EXISTS_CODES = {"PreconditionFailed", "412"}
# A 409 means another conditional write of the same key is in flight: retry, it settles.
_CONFLICT_CODES = {"ConditionalRequestConflict", "409"}
_CONFLICT_RETRIES = 5


class S3Store(ArtifactStore):
    """Blobs and manifests as objects in one bucket."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        client: Any = None,
    ) -> None:
        if not bucket:
            raise StoreError("an S3 store needs a bucket name")
        from botocore.exceptions import ClientError  # lazy: see the module docstring

        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self._client = client or _make_client(endpoint_url, region)
        self._client_error = ClientError

    def __repr__(self) -> str:
        return f"S3Store({self.bucket!r}, {self.prefix!r})"

    # -- blobs ----------------------------------------------------------------------------

    def get_blob(self, digest: str) -> bytes:
        digest = parse_digest(digest)
        try:
            response = self._client.get_object(Bucket=self.bucket, Key=self._blob_key(digest))
            data = response["Body"].read()
        except self._client_error as exc:
            if _code(exc) in _MISSING_CODES:
                raise BlobNotFound(digest) from None
            raise
        actual = digest_of(data)
        if actual != digest:
            raise CorruptBlob(digest, actual)
        return data

    def has_blob(self, digest: str) -> bool:
        return self._head(self._blob_key(digest)) is not None

    def blob_size(self, digest: str) -> int:
        digest = parse_digest(digest)
        head = self._head(self._blob_key(digest))
        if head is None:
            raise BlobNotFound(digest)
        return int(head["ContentLength"])

    def delete_blob(self, digest: str) -> None:
        digest = parse_digest(digest)
        key = self._blob_key(digest)
        if self._head(key) is None:  # S3 deletes silently; the API promises BlobNotFound
            raise BlobNotFound(digest)
        self._client.delete_object(Bucket=self.bucket, Key=key)

    def list_blobs(self) -> Iterator[BlobInfo]:
        folder = self._key("blobs/sha256/")
        for item in self._list_objects(folder):
            hex_digits = item["Key"][len(folder) :]
            if is_hex64(hex_digits):
                yield BlobInfo(
                    DIGEST_PREFIX + hex_digits,
                    int(item["Size"]),
                    item["LastModified"].timestamp(),
                )

    # -- manifests ------------------------------------------------------------------------

    def put_manifest(self, kind: str, name: str, document: dict) -> None:
        data = encode_manifest(kind, name, document)
        self._client.put_object(
            Bucket=self.bucket,
            Key=self._manifest_key(kind, name),
            Body=data,
            ContentType="application/json",
        )

    def get_manifest(self, kind: str, name: str) -> dict:
        key = self._manifest_key(kind, name)
        try:
            data = self._client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except self._client_error as exc:
            if _code(exc) in _MISSING_CODES:
                raise ManifestNotFound(kind, name) from None
            raise
        return decode_manifest(kind, name, data)

    def list_manifests(self, kind: str) -> list[str]:
        folder = self._key(f"manifests/{check_kind(kind)}/")
        names = []
        for item in self._list_objects(folder):
            relative = item["Key"][len(folder) :]
            if relative.endswith(".json"):
                names.append(relative[: -len(".json")])
        return sorted(names)

    def delete_manifest(self, kind: str, name: str) -> None:
        key = self._manifest_key(kind, name)
        if self._head(key) is None:
            raise ManifestNotFound(kind, name)
        self._client.delete_object(Bucket=self.bucket, Key=key)

    # -- backend hooks --------------------------------------------------------------------

    def _staging_dir(self) -> Path:
        return Path(tempfile.gettempdir())

    def _publish(self, staging: Path, digest: str, size: int) -> None:
        key = self._blob_key(digest)
        for attempt in range(_CONFLICT_RETRIES):
            try:
                self._put_create_only(staging, key, size)
                return
            except self._client_error as exc:
                code = _code(exc)
                if code in _EXISTS_CODES:
                    self._touch(key)
                    return
                if code not in _CONFLICT_CODES or attempt == _CONFLICT_RETRIES - 1:
                    raise
                time.sleep(0.1 * (attempt + 1))

    def _manifest_kinds(self) -> list[str]:
        folder = self._key("manifests/")
        kinds = []
        paginator = self._client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=folder, Delimiter="/"):
            for common in page.get("CommonPrefixes", []):
                kinds.append(common["Prefix"][len(folder) :].rstrip("/"))
        return sorted(kinds)

    # -- S3 calls -------------------------------------------------------------------------

    def _put_create_only(self, staging: Path, key: str, size: int) -> None:
        with open(staging, "rb") as body:
            self._client.put_object(
                Bucket=self.bucket,
                Key=key,
                Body=body,
                ContentLength=size,
                IfNoneMatch="*",
            )

    def _touch(self, key: str) -> None:
        """Restart an existing blob's grace clock (gc must not take it before its manifest).

        A copy onto itself with replaced metadata is the only way S3 offers to bump
        LastModified; it rewrites the same bytes server-side.
        """
        self._client.copy_object(
            Bucket=self.bucket,
            Key=key,
            CopySource={"Bucket": self.bucket, "Key": key},
            MetadataDirective="REPLACE",
        )

    def _head(self, key: str) -> dict | None:
        try:
            return self._client.head_object(Bucket=self.bucket, Key=key)
        except self._client_error as exc:
            if _code(exc) in _MISSING_CODES:
                return None
            raise

    def _list_objects(self, folder: str) -> Iterator[dict]:
        paginator = self._client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=folder):
            yield from page.get("Contents", [])

    # -- keys -----------------------------------------------------------------------------

    def _key(self, relative: str) -> str:
        return f"{self.prefix}/{relative}" if self.prefix else relative

    def _blob_key(self, digest: str) -> str:
        return self._key(f"blobs/sha256/{digest_hex(digest)}")

    def _manifest_key(self, kind: str, name: str) -> str:
        return self._key(f"manifests/{check_kind(kind)}/{check_name(name)}.json")


def _make_client(endpoint_url: str | None, region: str | None) -> Any:
    """A boto3 S3 client; path-style addressing for custom endpoints (MinIO, moto)."""
    import boto3
    from botocore.config import Config

    config = Config(s3={"addressing_style": "path"}) if endpoint_url else None
    return boto3.client("s3", endpoint_url=endpoint_url, region_name=region, config=config)


def _code(exc: Exception) -> str:
    """The S3 error code of a botocore ClientError ('NoSuchKey', '404', ...)."""
    error = getattr(exc, "response", {}).get("Error", {})
    return str(error.get("Code", ""))
