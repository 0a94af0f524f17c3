"""One suite, two backends: every behaviour is checked on a directory and on a real S3 server.

The S3 backend runs against moto's server mode over HTTP (boto3 is never mocked), with one
bucket for the session and one key prefix per test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from artifact_store import (
    ArtifactStore,
    BlobNotFound,
    CorruptBlob,
    FileStore,
    InvalidDigest,
    ManifestNotFound,
    S3Store,
    StoreError,
    TooLarge,
    digest_of,
    open_store,
    parse_digest,
)

REPO = Path(__file__).resolve().parents[2]
BUCKET = "kiln-test-artifacts"
HOUR = 3600.0


@dataclass
class Backend:
    """A store plus the test's back door to its raw storage."""

    name: str
    store: ArtifactStore
    overwrite_blob: Callable[[str, bytes], None]
    staging_dir: Path


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A moto S3 server on a free local port, with dummy credentials and one bucket."""
    from moto.server import ThreadedMotoServer

    with pytest.MonkeyPatch.context() as patch:
        for variable, value in {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_SESSION_TOKEN": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }.items():
            patch.setenv(variable, value)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        _s3_client(endpoint).create_bucket(Bucket=BUCKET)
        try:
            yield endpoint
        finally:
            server.stop()


def _s3_client(endpoint: str):
    import boto3
    from botocore.config import Config

    config = Config(s3={"addressing_style": "path"})
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", config=config)


@pytest.fixture(params=["file", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "file":
        return _file_backend(tmp_path)
    return _s3_backend(request.getfixturevalue("s3_endpoint"), tmp_path, request)


def _file_backend(tmp_path: Path) -> Backend:
    root = tmp_path / "store"
    store = FileStore(root)

    def overwrite(digest: str, data: bytes) -> None:
        hex_digits = digest.split(":")[1]
        (root / "blobs" / "sha256" / hex_digits[:2] / hex_digits).write_bytes(data)

    return Backend("file", store, overwrite, root / "tmp")


def _s3_backend(endpoint: str, tmp_path: Path, request: pytest.FixtureRequest) -> Backend:
    # S3 staging goes to the system temp dir; point it at this test's own folder to check it.
    staging = tmp_path / "staging"
    staging.mkdir()
    patch = request.getfixturevalue("monkeypatch")
    patch.setenv("TMPDIR", str(staging))
    patch.setattr("tempfile.tempdir", None)
    prefix = f"t-{uuid.uuid4().hex[:12]}/artifacts"
    store = S3Store(BUCKET, prefix, endpoint_url=endpoint, region="us-east-1")
    client = _s3_client(endpoint)

    def overwrite(digest: str, data: bytes) -> None:
        key = f"{prefix}/blobs/sha256/{digest.split(':')[1]}"
        client.put_object(Bucket=BUCKET, Key=key, Body=data)

    return Backend("s3", store, overwrite, staging)


def _make_old(backend: Backend, digest: str, age: float) -> None:
    """Backdate a blob on the file backend (S3 cannot set LastModified)."""
    assert isinstance(backend.store, FileStore)
    hex_digits = digest.split(":")[1]
    path = backend.store.root / "blobs" / "sha256" / hex_digits[:2] / hex_digits
    then = time.time() - age
    os.utime(path, (then, then))


def _digests(store: ArtifactStore) -> set[str]:
    return {info.digest for info in store.list_blobs()}


# -- digests --------------------------------------------------------------------------------


def test_digest_of_is_prefixed_lowercase_sha256():
    assert digest_of(b"abc") == (
        "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    )


def test_parse_digest_canonicalizes_case():
    digest = digest_of(b"x")
    assert parse_digest(digest.upper().replace("SHA256", "sha256")) == digest
    assert parse_digest(digest) == digest


@pytest.mark.parametrize(
    "text",
    [
        "",
        "sha256:",
        "sha256:" + "a" * 63,
        "sha256:" + "a" * 65,
        "sha256:" + "g" * 64,
        "md5:" + "a" * 64,
        "a" * 64,
        " sha256:" + "a" * 64,
        "sha256:" + "a" * 63 + "/",
        None,
    ],
)
def test_parse_digest_rejects_malformed(text):
    with pytest.raises(InvalidDigest, match="invalid digest"):
        parse_digest(text)


def test_invalid_digest_is_a_value_error_and_store_error():
    assert issubclass(InvalidDigest, ValueError)
    assert issubclass(InvalidDigest, StoreError)


# -- blobs ----------------------------------------------------------------------------------


def test_put_get_round_trip(backend):
    data = b"\x00kiln module archive\xff" * 100
    digest = backend.store.put_blob(data)
    assert digest == digest_of(data)
    assert backend.store.get_blob(digest) == data
    assert backend.store.has_blob(digest)
    assert backend.store.blob_size(digest) == len(data)


def test_put_is_idempotent(backend):
    first = backend.store.put_blob(b"same bytes")
    second = backend.store.put_blob(b"same bytes")
    assert first == second
    assert [info.digest for info in backend.store.list_blobs()] == [first]
    assert backend.store.get_blob(first) == b"same bytes"


def test_empty_blob(backend):
    digest = backend.store.put_blob(b"")
    assert backend.store.get_blob(digest) == b""
    assert backend.store.blob_size(digest) == 0


def test_list_blobs_reports_size_and_time(backend):
    before = time.time()
    small = backend.store.put_blob(b"a")
    large = backend.store.put_blob(b"b" * 1000)
    infos = {info.digest: info for info in backend.store.list_blobs()}
    assert set(infos) == {small, large}
    assert infos[small].size == 1
    assert infos[large].size == 1000
    assert all(abs(info.modified - before) < 60 for info in infos.values())


def test_streamed_staging_matches_digest_of(backend):
    chunks = [bytes([i % 256]) * (i * 37 + 1) for i in range(200)]
    whole = b"".join(chunks)
    with backend.store.stage(max_bytes=len(whole)) as staged:
        for chunk in chunks:
            staged.write(chunk)
        assert staged.size == len(whole)
        assert staged.digest == digest_of(whole)
        assert staged.path.parent == backend.staging_dir
        assert staged.path.read_bytes() == whole  # readable for validation before commit
        assert not backend.store.has_blob(digest_of(whole))
        digest = staged.commit()
    assert digest == digest_of(whole)
    assert backend.store.get_blob(digest) == whole
    assert list(backend.staging_dir.iterdir()) == []


def test_stage_accepts_bytes_like_chunks(backend):
    with backend.store.stage() as staged:
        staged.write(bytearray(b"ab"))
        staged.write(memoryview(b"cd"))
        digest = staged.commit()
    assert backend.store.get_blob(digest) == b"abcd"


def test_commit_is_idempotent_for_existing_blob(backend):
    existing = backend.store.put_blob(b"payload")
    with backend.store.stage() as staged:
        staged.write(b"payload")
        assert staged.commit() == existing
        assert staged.commit() == existing
    assert _digests(backend.store) == {existing}


def test_too_large_mid_stream_leaves_nothing(backend):
    staged = backend.store.stage(max_bytes=10)
    with pytest.raises(TooLarge) as caught, staged:
        staged.write(b"12345")
        staged.write(b"67890")  # exactly at the limit is fine
        staged.write(b"x")
    assert caught.value.limit == 10
    assert "10 bytes" in str(caught.value)
    assert not staged.path.exists()
    assert list(backend.staging_dir.iterdir()) == []
    assert list(backend.store.list_blobs()) == []
    with pytest.raises(StoreError):
        staged.write(b"more")
    with pytest.raises(StoreError):
        staged.commit()


def test_exception_inside_stage_leaves_nothing(backend):
    with pytest.raises(RuntimeError, match="validation failed"):  # noqa: SIM117
        with backend.store.stage() as staged:
            staged.write(b"half an upload")
            raise RuntimeError("validation failed")
    assert list(backend.staging_dir.iterdir()) == []
    assert list(backend.store.list_blobs()) == []


def test_leaving_stage_without_commit_leaves_nothing(backend):
    with backend.store.stage() as staged:
        staged.write(b"abandoned")
    assert not backend.store.has_blob(digest_of(b"abandoned"))
    assert list(backend.staging_dir.iterdir()) == []


def test_unknown_digest_is_not_found(backend):
    missing = digest_of(b"never stored")
    with pytest.raises(BlobNotFound, match=missing):
        backend.store.get_blob(missing)
    with pytest.raises(BlobNotFound):
        backend.store.blob_size(missing)
    with pytest.raises(BlobNotFound):
        backend.store.delete_blob(missing)
    assert not backend.store.has_blob(missing)


def test_corrupted_blob_is_detected(backend):
    digest = backend.store.put_blob(b"original bytes")
    backend.overwrite_blob(digest, b"flipped bytes!")
    with pytest.raises(CorruptBlob, match=digest) as caught:
        backend.store.get_blob(digest)
    assert caught.value.actual == digest_of(b"flipped bytes!")


@pytest.mark.parametrize("bad", ["sha256:xyz", "../../etc/passwd", "sha256:" + "A" * 63])
def test_invalid_digest_arguments(backend, bad):
    for call in (
        backend.store.get_blob,
        backend.store.has_blob,
        backend.store.blob_size,
        backend.store.delete_blob,
    ):
        with pytest.raises(InvalidDigest):
            call(bad)


def test_uppercase_digest_reads_the_blob(backend):
    digest = backend.store.put_blob(b"case")
    assert backend.store.get_blob("sha256:" + digest.split(":")[1].upper()) == b"case"


def test_delete_blob(backend):
    keep = backend.store.put_blob(b"keep")
    gone = backend.store.put_blob(b"gone")
    backend.store.delete_blob(gone)
    assert not backend.store.has_blob(gone)
    assert _digests(backend.store) == {keep}


# -- manifests ------------------------------------------------------------------------------


def test_manifest_round_trip_list_replace_delete(backend):
    store = backend.store
    store.put_manifest("models", "tenant-a/m-123", {"blob": digest_of(b"m"), "n": 1})
    store.put_manifest("models", "b", {"n": 2})
    store.put_manifest("compilations", "c-1", {"n": 3})
    assert store.get_manifest("models", "tenant-a/m-123") == {"blob": digest_of(b"m"), "n": 1}
    assert store.list_manifests("models") == ["b", "tenant-a/m-123"]
    assert store.list_manifests("compilations") == ["c-1"]
    assert store.list_manifests("deployments") == []

    store.put_manifest("models", "b", {"n": 20, "nested": {"list": [1, "two", None]}})
    assert store.get_manifest("models", "b") == {"n": 20, "nested": {"list": [1, "two", None]}}

    store.delete_manifest("models", "b")
    assert store.list_manifests("models") == ["tenant-a/m-123"]
    with pytest.raises(ManifestNotFound, match="models/b"):
        store.get_manifest("models", "b")
    with pytest.raises(ManifestNotFound):
        store.delete_manifest("models", "b")


def test_manifest_names_with_digests_and_at_signs(backend):
    name = digest_of(b"model")
    backend.store.put_manifest("artifacts", name, {"ok": True})
    backend.store.put_manifest("artifacts", "user@example.com/v1.2", {"ok": False})
    assert backend.store.get_manifest("artifacts", name) == {"ok": True}
    assert backend.store.list_manifests("artifacts") == sorted([name, "user@example.com/v1.2"])


def test_missing_manifest(backend):
    with pytest.raises(ManifestNotFound, match="models/nope"):
        backend.store.get_manifest("models", "nope")


@pytest.mark.parametrize(
    "name",
    ["", "../x", "a/../../x", "/abs", "a//b", "a/", "./a", "..", "a b", "a\\b", "x" * 201, "é"],
)
def test_invalid_manifest_names(backend, name):
    with pytest.raises(StoreError, match="invalid manifest name"):
        backend.store.put_manifest("models", name, {})
    with pytest.raises(StoreError, match="invalid manifest name"):
        backend.store.get_manifest("models", name)
    with pytest.raises(StoreError, match="invalid manifest name"):
        backend.store.delete_manifest("models", name)


@pytest.mark.parametrize("kind", ["", "Models", "1models", "../x", "a/b", "k" * 65, "a.b"])
def test_invalid_manifest_kinds(backend, kind):
    with pytest.raises(StoreError, match="invalid manifest kind"):
        backend.store.put_manifest(kind, "name", {})
    with pytest.raises(StoreError, match="invalid manifest kind"):
        backend.store.list_manifests(kind)


def test_traversal_writes_nothing_outside(backend, tmp_path):
    with pytest.raises(StoreError):
        backend.store.put_manifest("models", "../../escaped", {})
    assert not list(tmp_path.rglob("escaped*"))


def test_manifest_must_be_a_json_object(backend):
    with pytest.raises(StoreError, match="JSON object"):
        backend.store.put_manifest("models", "m", ["not", "a", "dict"])
    with pytest.raises(StoreError, match="not JSON-serializable"):
        backend.store.put_manifest("models", "m", {"x": object()})
    assert backend.store.list_manifests("models") == []


# -- garbage collection ---------------------------------------------------------------------


def test_gc_keeps_referenced_and_deletes_unreferenced(backend):
    store = backend.store
    model = store.put_blob(b"model bytes")
    weights = store.put_blob(b"weights")
    orphan = store.put_blob(b"orphan")
    store.put_manifest("models", "m1", {"source": model})
    # References are found anywhere: nested, inside longer strings, in keys.
    store.put_manifest("compilations", "c1", {"out": [{"note": f"archive={weights};"}]})

    report = store.gc(grace_seconds=0)

    assert report.kept == 2
    assert report.deleted == [orphan]
    assert report.young == []
    assert report.freed_bytes == len(b"orphan")
    assert _digests(store) == {model, weights}


def test_gc_marks_digests_in_keys(backend):
    keyed = backend.store.put_blob(b"keyed")
    backend.store.put_manifest("index", "i", {keyed: "present"})
    assert backend.store.gc(grace_seconds=0).deleted == []
    assert backend.store.has_blob(keyed)


def test_gc_keeps_young_unreferenced(backend):
    young = backend.store.put_blob(b"just uploaded")
    report = backend.store.gc(grace_seconds=HOUR)
    assert report.young == [young]
    assert report.deleted == []
    assert backend.store.has_blob(young)


def test_gc_dry_run_deletes_nothing(backend):
    orphan = backend.store.put_blob(b"orphan")
    report = backend.store.gc(grace_seconds=0, dry_run=True)
    assert report.deleted == [orphan]
    assert report.freed_bytes == len(b"orphan")
    assert backend.store.has_blob(orphan)


def test_gc_after_manifest_deleted(backend):
    blob = backend.store.put_blob(b"was referenced")
    backend.store.put_manifest("models", "m", {"blob": blob})
    assert backend.store.gc(grace_seconds=0).kept == 1
    backend.store.delete_manifest("models", "m")
    assert backend.store.gc(grace_seconds=0).deleted == [blob]
    assert not backend.store.has_blob(blob)


def test_gc_by_age_on_the_file_backend(tmp_path):
    backend = _file_backend(tmp_path)
    old = backend.store.put_blob(b"old orphan")
    young = backend.store.put_blob(b"young orphan")
    referenced = backend.store.put_blob(b"old but referenced")
    backend.store.put_manifest("models", "m", {"b": referenced})
    _make_old(backend, old, 2 * HOUR)
    _make_old(backend, referenced, 2 * HOUR)

    report = backend.store.gc(grace_seconds=HOUR)

    assert (report.kept, report.deleted, report.young) == (1, [old], [young])
    assert _digests(backend.store) == {young, referenced}


def test_recommit_restarts_the_grace_clock(backend):
    """Re-uploading an old orphan (its manifest still to come) must protect it from gc."""
    digest = backend.store.put_blob(b"reused")
    if backend.name == "file":
        _make_old(backend, digest, 2 * HOUR)
        grace = HOUR
    else:
        time.sleep(2.2)  # S3's LastModified cannot be set; it has one-second resolution
        grace = 2.0
    assert backend.store.gc(grace_seconds=grace, dry_run=True).deleted == [digest]
    backend.store.put_blob(b"reused")
    assert backend.store.gc(grace_seconds=grace).young == [digest]
    assert backend.store.has_blob(digest)


def test_commit_never_overwrites_an_existing_blob(backend):
    """Commit is create-only: whatever is stored under a digest is left as is."""
    digest = backend.store.put_blob(b"genuine")
    backend.overwrite_blob(digest, b"damaged")
    assert backend.store.put_blob(b"genuine") == digest
    with pytest.raises(CorruptBlob):
        backend.store.get_blob(digest)


# -- open_store ------------------------------------------------------------------------------


def test_open_store_plain_path_and_file_url(tmp_path):
    plain = open_store(str(tmp_path / "a"))
    assert isinstance(plain, FileStore)
    assert plain.root == tmp_path / "a"
    url = open_store(f"file://{tmp_path}/b%20c")
    assert isinstance(url, FileStore)
    assert url.root == tmp_path / "b c"
    assert (tmp_path / "b c" / "blobs").is_dir()


def test_open_store_s3_url(s3_endpoint):
    store = open_store(f"s3://{BUCKET}/some/prefix/", endpoint_url=s3_endpoint)
    assert isinstance(store, S3Store)
    assert (store.bucket, store.prefix) == (BUCKET, "some/prefix")
    digest = store.put_blob(b"via url")
    keys = [
        item["Key"]
        for item in _s3_client(s3_endpoint).list_objects_v2(Bucket=BUCKET, Prefix="some/prefix/")[
            "Contents"
        ]
    ]
    assert keys == [f"some/prefix/blobs/sha256/{digest.split(':')[1]}"]


def test_open_store_s3_url_without_prefix(s3_endpoint):
    store = open_store(f"s3://{BUCKET}", endpoint_url=s3_endpoint, region="us-east-1")
    assert isinstance(store, S3Store)
    assert store.prefix == ""


@pytest.mark.parametrize(
    "url", ["", "http://example.com/x", "s3://", "file://remote-host/x", "gs://bucket/x"]
)
def test_open_store_rejects_unknown_urls(url):
    with pytest.raises(StoreError, match="cannot open an artifact store") as caught:
        open_store(url)
    assert repr(url) in str(caught.value)


def test_file_store_imports_no_boto3(tmp_path):
    script = (
        "import sys, artifact_store as a; a.FileStore(sys.argv[1]).put_blob(b'x'); "
        "assert not {'boto3', 'botocore'} & set(sys.modules), 'boto3 was imported'"
    )
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True, cwd=REPO)


def test_file_layout(tmp_path):
    store = FileStore(tmp_path)
    digest = store.put_blob(b"layout")
    store.put_manifest("models", "tenant/m", {"b": digest})
    hex_digits = digest.split(":")[1]
    assert (tmp_path / "blobs" / "sha256" / hex_digits[:2] / hex_digits).read_bytes() == b"layout"
    assert (tmp_path / "manifests" / "models" / "tenant" / "m.json").is_file()
    assert list((tmp_path / "tmp").iterdir()) == []
