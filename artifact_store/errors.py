"""The store's exceptions: one base class so callers can catch every store failure at once."""

from __future__ import annotations


class StoreError(Exception):
    """Base of every error the artifact store raises."""


class BlobNotFound(StoreError):  # noqa: N818 (public API names)
    """No blob is stored under the digest."""

    def __init__(self, digest: str) -> None:
        super().__init__(f"blob {digest} not found")
        self.digest = digest


class CorruptBlob(StoreError):  # noqa: N818 (public API names)
    """The stored bytes do not hash to the digest they are stored under."""

    def __init__(self, digest: str, actual: str) -> None:
        super().__init__(f"blob {digest} is corrupt: its stored bytes hash to {actual}")
        self.digest = digest
        self.actual = actual


class TooLarge(StoreError):  # noqa: N818 (public API names)
    """A staged write went past its byte limit; the staging has been discarded."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"blob exceeds the limit of {limit} bytes")
        self.limit = limit


class ManifestNotFound(StoreError):  # noqa: N818 (public API names)
    """No manifest is stored under the kind and name."""

    def __init__(self, kind: str, name: str) -> None:
        super().__init__(f"manifest {kind}/{name} not found")
        self.kind = kind
        self.name = name


class InvalidDigest(StoreError, ValueError):  # noqa: N818 (public API names)
    """A string is not a canonical 'sha256:<64 hex>' digest."""
