"""Digests and manifest names, validated so no backend builds a path or key from raw input.

Path traversal is ruled out by construction: a kind is a single lowercase word, a name is a
restricted alphabet split into non-empty segments none of which is '.' or '..'.
"""

from __future__ import annotations

import hashlib
import re

from artifact_store.errors import InvalidDigest, StoreError

DIGEST_PREFIX = "sha256:"
# Used by gc to find references anywhere inside manifest strings.
DIGEST_PATTERN = re.compile(r"sha256:[0-9a-f]{64}")

_DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}", re.IGNORECASE)
_KIND_RE = re.compile(r"[a-z][a-z0-9_-]{0,63}")
_NAME_RE = re.compile(r"[A-Za-z0-9._:@/-]{1,200}")
_HEX_RE = re.compile(r"[0-9a-f]{64}")


def digest_of(data: bytes) -> str:
    """The canonical digest of `data`: 'sha256:' and 64 lowercase hex digits."""
    return DIGEST_PREFIX + hashlib.sha256(data).hexdigest()


def parse_digest(text: str) -> str:
    """Validate a digest string and return its canonical (lowercase) form."""
    if not isinstance(text, str) or not _DIGEST_RE.fullmatch(text):
        raise InvalidDigest(
            f"invalid digest {text!r}: expected 'sha256:' followed by 64 hex digits"
        )
    return text.lower()


def digest_hex(digest: str) -> str:
    """The 64 hex digits of a digest, after validating it."""
    return parse_digest(digest)[len(DIGEST_PREFIX) :]


def is_hex64(text: str) -> bool:
    """Whether `text` looks like a digest's hex part (used to skip stray files and keys)."""
    return bool(_HEX_RE.fullmatch(text))


def check_kind(kind: str) -> str:
    """Validate a manifest kind: one lowercase word, safe as a single path segment."""
    if not isinstance(kind, str) or not _KIND_RE.fullmatch(kind):
        raise StoreError(
            f"invalid manifest kind {kind!r}: expected a lowercase letter followed by up to 63 "
            "of [a-z0-9_-]"
        )
    return kind


def check_name(name: str) -> str:
    """Validate a manifest name such as 'tenant-a/m-123' or 'sha256:ab12...'."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise StoreError(
            f"invalid manifest name {name!r}: expected 1-200 characters of [A-Za-z0-9._:@/-]"
        )
    if name.startswith("/"):
        raise StoreError(f"invalid manifest name {name!r}: it must not start with '/'")
    segments = name.split("/")
    if any(segment in ("", ".", "..") for segment in segments):
        raise StoreError(
            f"invalid manifest name {name!r}: '/'-separated segments must be non-empty and "
            "not '.' or '..'"
        )
    return name
