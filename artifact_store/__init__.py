"""Kiln's artifact store: content-addressed blobs plus small JSON manifests.

Blobs are stored under their sha256 digest and verified on every read; manifests are small
JSON documents, grouped by kind, that name blobs. Two backends share one API and one test
suite: a local directory (FileStore) and an S3 bucket (S3Store); `open_store` picks one
from a URL.
"""

from __future__ import annotations

from artifact_store.base import ArtifactStore, BlobInfo, GcReport, StagedBlob
from artifact_store.errors import (
    BlobNotFound,
    CorruptBlob,
    InvalidDigest,
    ManifestNotFound,
    StoreError,
    TooLarge,
)
from artifact_store.filesystem import FileStore
from artifact_store.naming import digest_of, parse_digest
from artifact_store.s3 import S3Store
from artifact_store.urls import open_store

__all__ = [
    "ArtifactStore",
    "BlobInfo",
    "BlobNotFound",
    "CorruptBlob",
    "FileStore",
    "GcReport",
    "InvalidDigest",
    "ManifestNotFound",
    "S3Store",
    "StagedBlob",
    "StoreError",
    "TooLarge",
    "digest_of",
    "open_store",
    "parse_digest",
]
