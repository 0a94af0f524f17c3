"""bench.rekey: this host's records under the legacy fingerprint are keyed by the current one
and then apply; other machines' records and every other field stay as they were."""

from __future__ import annotations

import dataclasses

from bench import rekey
from compiler_core.autotune.records import FileLog
from compiler_core.target import host_target
from tests.autotune.test_records import KEY, record


def test_this_hosts_legacy_records_are_rekeyed_and_others_kept(tmp_path):
    target = host_target()
    legacy = rekey.legacy_fingerprint(target)
    path = tmp_path / "log.jsonl"
    FileLog(path).extend(
        [
            record(tile=8, costs=(2e-3,), fingerprint=legacy),
            record(tile=16, costs=(1e-3,), fingerprint="fedcba9876543210"),
        ]
    )
    assert FileLog(path).best(KEY, target.fingerprint) is None

    rekey.main([str(path)])

    mine, other = FileLog(path).records()
    assert mine == dataclasses.replace(record(tile=8, costs=(2e-3,)), fingerprint=mine.fingerprint)
    assert mine.fingerprint == target.fingerprint
    assert other.fingerprint == "fedcba9876543210"
    assert FileLog(path).best(KEY, target.fingerprint).config == {"tile_x": 8, "order": "xy"}


def test_a_dry_run_writes_nothing(tmp_path):
    path = tmp_path / "log.jsonl"
    FileLog(path).extend([record(fingerprint=rekey.legacy_fingerprint(host_target()))])
    before = path.read_bytes()
    rekey.main([str(path), "--dry-run"])
    assert path.read_bytes() == before
