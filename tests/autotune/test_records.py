"""The tuning log: records as data, on both backends (a JSON-lines file and real Redis)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from compiler_core.autotune.records import (
    ERROR_CODES,
    FileLog,
    RecordError,
    RedisLog,
    TuningLog,
    TuningRecord,
    open_log,
)

REDIS_URL = "redis://127.0.0.1:6379/14"
FP = "0123456789abcdef"
OTHER_FP = "fedcba9876543210"
WORKLOAD = "dense(float32[64,128], float32[256,128]) -> float32[64,256]"
KEY = hashlib.sha256(WORKLOAD.encode()).hexdigest()


def record(tile=8, costs=(1e-3,), error="ok", **fields):
    fields = {
        "workload_key": KEY,
        "workload": WORKLOAD,
        "target": "llvm -mcpu=znver4",
        "fingerprint": FP,
        "template": "dense",
        "template_version": 1,
        "config": {"tile_x": tile, "order": "xy"},
        "costs": costs if error == "ok" else (),
        "error": error,
        "flops": 2.0 * 64 * 128 * 256,
        "compiler_version": "0.1.0",
        "timestamp": 1700000000.5,
        **fields,
    }
    return TuningRecord(**fields)


@pytest.fixture(params=["file", "redis"])
def open_store(request, tmp_path):
    """A factory of logs over one fresh store: each call is a new instance (another tuner)."""
    if request.param == "file":
        yield lambda: FileLog(tmp_path / "tuning.jsonl")
        return
    key = f"kiln-test:{uuid.uuid4().hex}:tuning"
    opened = []

    def open_redis():
        opened.append(RedisLog(REDIS_URL, key=key))
        return opened[-1]

    try:
        open_redis().client.ping()
    except Exception as err:  # noqa: BLE001
        pytest.fail(f"Redis must answer on {REDIS_URL} (`.ci/run` starts one): {err}")
    yield open_redis
    opened[0].client.delete(key)
    for log in opened:
        log.close()


@pytest.fixture
def store(open_store):
    return open_store()


# --------------------------------------------------------------------------- the record


def test_record_round_trips_through_one_json_line():
    original = record(costs=[3e-3, 1e-3, 2e-3], error_detail="")
    line = original.to_json()
    assert "\n" not in line
    assert list(json.loads(line)) == sorted(json.loads(line))
    again = TuningRecord.from_json(line)
    assert again == original
    assert again.costs == (3e-3, 1e-3, 2e-3)
    assert again.cost == 2e-3  # the median, not the first or the minimum
    assert again.gflops == pytest.approx(2.0 * 64 * 128 * 256 / 2e-3 / 1e9)


def test_features_round_trip_and_a_record_without_them_writes_as_before():
    """Features ride along for transfer; a record without them has no such keys at all, so
    older logs read and write unchanged."""
    with_features = record(features=[0.5, 3, 1e-3], feature_set="abc")
    again = TuningRecord.from_json(with_features.to_json())
    assert again == with_features and again.features == (0.5, 3.0, 1e-3)
    plain = record().to_dict()
    assert "features" not in plain and "feature_set" not in plain
    with pytest.raises(RecordError, match="features must be finite"):
        record(features=[1.0, float("inf")])


def test_a_retimed_record_says_so_and_a_search_record_writes_as_before():
    retimed = record(retimed=True)
    assert TuningRecord.from_json(retimed.to_json()) == retimed
    assert "retimed" not in record().to_dict()
    assert not TuningRecord.from_json(record().to_json()).retimed


def test_a_default_configs_record_says_so_and_others_write_as_before():
    default = record(default=True)
    assert TuningRecord.from_json(default.to_json()) == default
    assert "default" not in record().to_dict()
    with pytest.raises(RecordError, match="default must be true or false"):
        record(default=1)


def test_an_in_model_record_says_so_and_others_write_as_before():
    timed = record(retimed=True, in_model=True)
    assert TuningRecord.from_json(timed.to_json()) == timed
    assert "in_model" not in record(retimed=True).to_dict()
    with pytest.raises(RecordError, match="in_model must be true or false"):
        record(in_model="yes")


def test_failed_record_ranks_last_and_serialises_without_inf():
    failed = record(error="timeout", error_detail="killed after 10 s")
    assert failed.cost == math.inf and failed.gflops == 0.0
    assert "Infinity" not in failed.to_json()
    assert TuningRecord.from_json(failed.to_json()) == failed
    assert record(costs=()).cost == math.inf


def test_config_key_is_canonical():
    a = record(config={"b": 1, "a": "x"})
    b = record(config={"a": "x", "b": 1})
    assert a.config_key == b.config_key == '{"a":"x","b":1}'
    assert record(config={"a": 2}).config_key != record(config={"a": "2"}).config_key


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("not json at all", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        (json.dumps({k: v for k, v in record().to_dict().items() if k != "costs"}), "costs"),
        (json.dumps({**record().to_dict(), "error": "segfault"}), "segfault"),
        (json.dumps({**record().to_dict(), "template_version": True}), "template_version"),
        (json.dumps({**record().to_dict(), "config": {"tile": 1.5}}), "tile"),
        (json.dumps({**record().to_dict(), "costs": [float("nan")]}), "NaN"),
        (json.dumps({**record().to_dict(), "error": "run_error"}), "carries no costs"),
        (json.dumps({**record().to_dict(), "retimed": "yes"}), "retimed must be true or false"),
    ],
)
def test_from_json_names_the_problem(line, problem):
    with pytest.raises(RecordError, match=problem):
        TuningRecord.from_json(line)


def test_record_error_is_a_value_error_and_unknown_fields_are_ignored():
    assert issubclass(RecordError, ValueError)
    line = json.dumps({**record().to_dict(), "added_by_a_newer_writer": 1})
    assert TuningRecord.from_json(line) == record()
    assert set(ERROR_CODES) >= {"ok", "invalid_config", "build_error", "wrong_answer"}


# --------------------------------------------------------------------------- the log, both backends


def test_best_is_the_lowest_median_among_ok_records_of_this_hardware(store):
    store.extend(
        [
            record(tile=1, costs=[5e-3, 5e-3, 5e-3]),
            record(tile=2, costs=[9e-3, 1e-3, 8e-3]),  # fastest single run, not fastest median
            record(tile=3, costs=[4e-3, 4e-3, 4e-3]),
            record(tile=4, error="wrong_answer", error_detail="max error 3.1"),
            record(tile=5, costs=[1e-4], fingerprint=OTHER_FP),
            record(tile=6, costs=[1e-4], template_version=2),
            record(tile=7, costs=[2e-4], workload_key="0" * 64),
        ]
    )
    assert store.best(KEY, FP, "dense", 1).config["tile_x"] == 3
    assert store.best(KEY, FP, template_version=2).config["tile_x"] == 6
    assert store.best(KEY, FP, "conv2d") is None
    assert store.best(KEY, OTHER_FP).config["tile_x"] == 5
    assert store.best(KEY, "1111111111111111") is None


def test_in_model_timings_decide_the_best_until_a_newer_search(store, tmp_path):
    """In-model records after a workload's last search measurement decide its best (the
    default may win there although it lost alone); a later search measurement hands the
    choice back to the isolated timings, which in-model ones never mix with."""
    store.extend(
        [
            record(tile=1, costs=[5e-3]),  # the default
            record(tile=3, costs=[4e-3]),  # fastest alone
            record(tile=3, costs=[9e-3], retimed=True, in_model=True),
            record(tile=1, costs=[6e-3], retimed=True, in_model=True),
        ]
    )
    assert store.best(KEY, FP).config["tile_x"] == 1
    assert [r.config["tile_x"] for r in store.ranked(KEY, FP)] == [1, 3]
    path = tmp_path / "best.jsonl"
    assert store.export_jsonl(path, best_only=True) == 1
    (exported,) = FileLog(path).records()
    assert exported.in_model and exported.config["tile_x"] == 1
    store.append(record(tile=5, costs=[4.5e-3]))  # a later search's measurement
    assert store.best(KEY, FP).config["tile_x"] == 3


def test_only_the_last_in_model_check_decides(store):
    """Two checks of one workload (best-only exports of two sessions, merged): their timings,
    taken on different days, do not compare; the later check, which timed the earlier
    choice beside its own candidates, decides."""
    day = 86400.0
    store.extend(
        [
            record(tile=1, costs=[4e-3], retimed=True, in_model=True),
            record(tile=3, costs=[5e-3], retimed=True, in_model=True, timestamp=1700000000 + day),
            record(tile=1, costs=[6e-3], retimed=True, in_model=True, timestamp=1700000001 + day),
        ]
    )
    assert store.best(KEY, FP).config["tile_x"] == 3
    assert [r.config["tile_x"] for r in store.ranked(KEY, FP)] == [3, 1]


def test_the_previous_choice_is_the_last_check_before_the_latest_search(store):
    """What builds applied before a workload's latest search: the fastest record of the last
    in-model check before its last search measurement (here the default, which won the
    first check), not the search's configs timed alone; none before any check, none while
    no search came after the last check, and a check of another template version is not
    this one's."""
    assert store.previous_choice(KEY, FP, "dense", 1) is None
    store.extend(
        [
            record(tile=1, costs=[5e-3]),  # the default
            record(tile=3, costs=[4e-3]),
            record(tile=3, costs=[4.5e-3], retimed=True),
        ]
    )
    assert store.previous_choice(KEY, FP, "dense", 1) is None  # never checked
    store.extend(
        [
            record(tile=2, costs=[3e-3], retimed=True, in_model=True, template_version=2),
            record(tile=3, costs=[9e-3], retimed=True, in_model=True),
            record(tile=1, costs=[6e-3], retimed=True, in_model=True),
        ]
    )
    assert store.previous_choice(KEY, FP, "dense", 1) is None  # nothing searched since
    store.extend([record(tile=5, costs=[2e-3]), record(tile=6, costs=[2.5e-3])])
    previous = store.previous_choice(KEY, FP, "dense", 1)
    assert previous.in_model and previous.config["tile_x"] == 1
    assert store.best(KEY, FP, "dense", 1).config["tile_x"] == 5
    assert store.previous_choice(KEY, FP, "dense", 2) is None  # searched in version 1 only
    assert store.previous_choice(KEY, OTHER_FP, "dense", 1) is None


def test_a_best_only_export_keeps_what_best_answers_and_nothing_else(store, tmp_path):
    """One record per workload, machine and template version, the one `best` returns; a
    file log compacted onto its own path answers `best` as before."""
    written = [
        record(tile=1, costs=[5e-3]),
        record(tile=3, costs=[4e-3]),
        record(tile=4, error="wrong_answer", error_detail="max error 3.1"),
        record(tile=5, costs=[1e-4], fingerprint=OTHER_FP),
        record(tile=6, costs=[1e-4], template_version=2),
        record(tile=7, error="timeout", workload_key="0" * 64),
    ]
    store.extend(written)
    path = tmp_path / "best.jsonl"
    assert store.export_jsonl(path, best_only=True) == 3
    assert FileLog(path).records() == [written[1], written[3], written[4]]
    log = FileLog(tmp_path / "log.jsonl")
    log.extend(written)
    assert log.export_jsonl(log.path, best_only=True) == 3
    assert len(log.records()) == 3 and log.best(KEY, FP, "dense", 1) == written[1]
    assert log.best(KEY, OTHER_FP) == written[3]


def test_best_ignores_a_task_that_only_failed(store):
    store.append(record(tile=1, error="build_error", error_detail="llvm: bad IR"))
    assert store.best(KEY, FP) is None


def test_measured_holds_ok_and_failed_configs_of_the_task(store):
    store.extend(
        [record(tile=1), record(tile=2, error="timeout"), record(tile=3, fingerprint=OTHER_FP)]
    )
    assert store.measured(KEY, FP) == {record(tile=1).config_key, record(tile=2).config_key}
    assert store.measured("0" * 64, FP) == set()


def test_records_filter_and_keep_log_order(store):
    written = [record(tile=t, fingerprint=FP if t % 2 else OTHER_FP) for t in range(6)]
    for one in written:
        store.append(one)
    assert list(store) == written
    assert store.records(fingerprint=FP) == written[1::2]
    assert store.records(KEY, OTHER_FP) == written[0::2]
    assert store.records(workload_key="0" * 64) == []


def test_export_then_import_adds_no_duplicates(store, open_store, tmp_path):
    written = [record(tile=t, timestamp=float(t)) for t in range(5)]
    store.extend(written)
    path = tmp_path / "exported" / "tuning.jsonl"
    assert store.export_jsonl(path) == 5
    assert [TuningRecord.from_json(line) for line in path.read_text().splitlines()] == written

    assert store.import_jsonl(path) == 0  # everything is already there
    path.write_text(
        path.read_text() + record(tile=99).to_json() + "\n" + written[0].to_json() + "\n"
    )
    assert open_store().import_jsonl(path) == 1
    assert list(store) == [*written, record(tile=99)]


def test_a_second_instance_sees_appends_after_the_first_read(open_store):
    reader, writer = open_store(), open_store()
    writer.extend([record(tile=1), record(tile=2)])
    first = reader.records()
    assert len(first) == 2
    writer.append(record(tile=3, costs=[1e-6]))
    now = reader.records()
    assert [r.config["tile_x"] for r in now] == [1, 2, 3]
    assert all(a is b for a, b in zip(first, now[:2], strict=True))  # cached, not re-parsed
    assert reader.best(KEY, FP).config["tile_x"] == 3


def test_open_log_picks_the_backend(tmp_path):
    file_log = open_log(tmp_path / "t.jsonl")
    assert (
        isinstance(file_log, FileLog) and open_log(str(tmp_path / "t.jsonl")).path == file_log.path
    )
    assert open_log(file_log) is file_log
    redis_log = open_log(REDIS_URL)
    assert isinstance(redis_log, RedisLog) and isinstance(redis_log, TuningLog)
    redis_log.close()
    with pytest.raises(TypeError):
        open_log(42)


# --------------------------------------------------------------------------- the file backend


def test_a_truncated_last_line_is_skipped_with_a_warning(tmp_path, caplog):
    path = tmp_path / "tuning.jsonl"
    FileLog(path).extend([record(tile=1), record(tile=2)])
    with path.open("ab") as file:  # what a writer killed mid-write leaves
        file.write(record(tile=3).to_json().encode()[:40])
    log = FileLog(path)
    with caplog.at_level(logging.WARNING, logger="compiler_core.autotune.records"):
        assert [r.config["tile_x"] for r in log] == [1, 2]
    assert "truncated" in caplog.text and log.skipped == 0

    FileLog(path).append(record(tile=4))  # the next writer must not glue onto the torn line
    assert [r.config["tile_x"] for r in log] == [1, 2, 4]
    assert log.skipped == 1


def test_malformed_lines_are_skipped_and_counted(tmp_path):
    path = tmp_path / "tuning.jsonl"
    lines = [record(tile=1).to_json(), "{oops", "", '{"costs": []}', record(tile=2).to_json()]
    path.write_text("\n".join(lines) + "\n")
    log = FileLog(path)
    assert [r.config["tile_x"] for r in log] == [1, 2]
    assert log.skipped == 2


def test_a_missing_file_is_an_empty_log_and_a_rewritten_one_is_read_anew(tmp_path):
    path = tmp_path / "sub" / "tuning.jsonl"
    log = FileLog(path, fsync=True)
    assert list(log) == [] and log.best(KEY, FP) is None
    log.extend([record(tile=1), record(tile=2)])
    assert len(log.records()) == 2
    path.write_text(record(tile=7).to_json() + "\n")  # replaced by a shorter file
    assert [r.config["tile_x"] for r in log] == [7]


WRITER = textwrap.dedent(
    """
    import os, sys, time
    from compiler_core.autotune.records import FileLog, TuningRecord
    path, go, writer, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    log = FileLog(path)
    base = dict(workload_key="k" * 64, workload="w" * 2000, target="llvm", fingerprint="f" * 16,
                template="dense", template_version=1, costs=(1e-3,))
    while not os.path.exists(go):  # start together, so the appends really overlap
        time.sleep(0.001)
    for i in range(count):
        batch = [TuningRecord(config={"writer": writer, "i": i, "half": h}, **base) for h in (0, 1)]
        log.extend(batch if i % 2 else batch[:1])
    """
)


def test_concurrent_writer_processes_lose_no_line(tmp_path):
    path, go = tmp_path / "tuning.jsonl", tmp_path / "go"
    writers, count = 4, 500
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(go), str(w), str(count)])
        for w in range(writers)
    ]
    time.sleep(0.3)
    go.touch()
    assert [proc.wait(timeout=60) for proc in procs] == [0] * writers

    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b""  # ends on a whole line
    parsed = [TuningRecord.from_json(line) for line in lines[:-1]]  # raises on a torn line
    expected = writers * (count + count // 2)
    assert len(parsed) == expected
    seen = {(r.config["writer"], r.config["i"], r.config["half"]) for r in parsed}
    assert len(seen) == expected
    log = FileLog(path)
    assert len(log.records()) == expected and log.skipped == 0


def test_records_are_immutable():
    one = record()
    with pytest.raises(dataclasses.FrozenInstanceError):
        one.error = "timeout"
