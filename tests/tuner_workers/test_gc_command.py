"""`kiln gc` sweeps the configured store: unreferenced blobs past the grace period go."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from artifact_store import open_store

KILN = str(Path(sys.executable).parent / "kiln")


def test_kiln_gc_deletes_only_unreferenced_blobs(tmp_path):
    store = open_store(str(tmp_path / "store"))
    kept = store.put_blob(b"a module archive")
    store.put_manifest("artifacts", kept, {"artifact": kept})
    orphan = store.put_blob(b"an upload whose manifest never came")
    env = dict(os.environ, KILN_DATA_DIR=str(tmp_path))

    def gc(*args):
        return subprocess.run([KILN, "gc", *args], env=env, capture_output=True, text=True)

    dry = gc("--grace", "0", "--dry-run")
    assert dry.returncode == 0 and "would delete 1" in dry.stdout and orphan in dry.stdout
    assert store.has_blob(orphan)
    assert "deleted 0" in gc("--grace", "3600").stdout  # too young to go
    done = gc("--grace", "0")
    assert done.returncode == 0 and "deleted 1" in done.stdout
    assert store.has_blob(kept) and not store.has_blob(orphan)
