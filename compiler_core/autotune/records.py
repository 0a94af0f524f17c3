"""The tuning log: measured configs as data, one JSON object per line (DESIGN.md §3).

The log is append-only and is the only truth; "the best config of a task on a target" is a
view computed from it. Two backends share one interface: `FileLog`, a JSON-lines file that
several tuner processes may append to at once, and `RedisLog`, a Redis list shared by the
tuning workers. Both cache the parsed records and read only what was appended since the
last look, so asking for the best config during a long tuning run stays cheap.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import fcntl
import json
import logging
import math
import numbers
import os
import statistics
import tempfile
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from compiler_core.errors import UserError

log = logging.getLogger(__name__)

ERROR_CODES = ("ok", "invalid_config", "build_error", "run_error", "timeout", "wrong_answer")

# Fields a line must carry; the others have defaults so that a sparse record still reads.
REQUIRED_FIELDS = (
    "workload_key",
    "workload",
    "target",
    "fingerprint",
    "template",
    "template_version",
    "config",
    "costs",
)
FLAGS = ("retimed", "in_model", "default")  # written only when true
STRING_FIELDS = (
    "workload_key",
    "workload",
    "target",
    "fingerprint",
    "template",
    "error",
    "error_detail",
    "compiler_version",
    "feature_set",
)
NUMBER_FIELDS = ("flops", "timestamp")


class RecordError(UserError):
    """A tuning record that cannot be built or read; the message names the problem."""


# --------------------------------------------------------------------------- the record


def _is_int(value: Any) -> bool:
    # bool is an int subclass, but True as a split factor is a bug, not a knob value.
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or float knob or cost value (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_config(config: Any) -> dict[str, int | str]:
    if not isinstance(config, dict):
        raise RecordError(f"config must be an object of knob -> value, got {type(config).__name__}")
    for knob, value in config.items():
        if not isinstance(knob, str):
            raise RecordError(f"config knob names must be strings, got {knob!r}")
        if not (_is_int(value) or isinstance(value, str)):
            raise RecordError(f"config knob {knob!r} must be an int or a string, got {value!r}")
    return dict(config)


def _finite_numbers(values: Any, what: str) -> tuple[float, ...]:
    """A list of finite numbers (numpy's too: the feature extractor returns float32s)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise RecordError(f"{what} must be a list of numbers, got {values!r}")
    values = tuple(values)
    for value in values:
        if (
            isinstance(value, bool)
            or not isinstance(value, numbers.Real)
            or not math.isfinite(value)
        ):
            raise RecordError(f"{what} must be finite numbers, got {value!r}")
    return tuple(float(value) for value in values)


def _check_costs(costs: Any, error: str) -> tuple[float, ...]:
    costs = _finite_numbers(costs, "costs")
    if any(cost < 0 for cost in costs):
        raise RecordError(f"costs must be finite, non-negative seconds, got {costs!r}")
    if error != "ok" and costs:
        raise RecordError(f"a record with error {error!r} carries no costs, got {costs!r}")
    return costs


@dataclasses.dataclass(frozen=True)
class TuningRecord:
    """One measurement of one config of one task on one machine.

    Construction validates every field, so any record that exists can be written as JSON and
    read back unchanged.
    """

    workload_key: str  # sha256 hex of the workload's canonical text (one task)
    workload: str  # the canonical text itself: op, shapes, dtypes, layout
    target: str  # e.g. "llvm -mcpu=znver4"
    fingerprint: str  # the target fingerprint: records from other hardware are never applied
    template: str  # template name, e.g. "dense"
    template_version: int
    config: dict[str, int | str]  # knob name -> value
    costs: tuple[float, ...]  # all measured seconds (repeats); empty when error != "ok"
    error: str = "ok"  # one of ERROR_CODES
    error_detail: str = ""  # first line of what went wrong
    flops: float = 0.0  # of one run of the workload
    compiler_version: str = ""
    timestamp: float = 0.0  # time.time() when measured
    # The candidate's loop-program features (`autotune.features`) and the name of their
    # layout: what lets a cost model learn from this record while tuning another workload
    # (transfer), without the workload's program at hand. Empty in older records.
    features: tuple[float, ...] = ()
    feature_set: str = ""
    # A repeat of a config measured before, taken when the search ended (`Tuner.retime`): the
    # few best configs and the default timed again side by side, so a config first timed in
    # a noisy minute is not judged by that minute alone. Not a trial of the search.
    retimed: bool = False
    # A re-timing inside the whole model (`check_in_model`): the kernels of the task's groups
    # timed one by one over the model's own workspace, after the kernels before them, cold
    # where the model leaves them cold. Where a workload has such records, they alone decide
    # its best: an isolated timing can rank two configs the other way round (resnet18's
    # 14x14 3x3 convs: Winograd F(4x4) 0.38 ms alone, 0.73 in the model; F(2x2) 0.43, 0.46).
    in_model: bool = False
    # The config is its task's default (the template's rules): the reference a cost model
    # reads the workload's other configs against (`autotune.search`), which is what lets one
    # workload's records rank another's configs.
    default: bool = False

    def __post_init__(self) -> None:
        for name in STRING_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, str):
                raise RecordError(f"{name} must be a string, got {value!r}")
        if self.error not in ERROR_CODES:
            raise RecordError(f"error must be one of {', '.join(ERROR_CODES)}, got {self.error!r}")
        if not _is_int(self.template_version) or self.template_version < 0:
            raise RecordError(
                f"template_version must be a non-negative int, got {self.template_version!r}"
            )
        for name in NUMBER_FIELDS:
            value = getattr(self, name)
            if not is_number(value) or not math.isfinite(value):
                raise RecordError(f"{name} must be a finite number, got {value!r}")
            object.__setattr__(self, name, float(value))
        # Frozen, so normalise through object.__setattr__: a private copy of the config (the
        # caller's dict may change later) and the costs as a tuple of floats.
        object.__setattr__(self, "config", _check_config(self.config))
        object.__setattr__(self, "costs", _check_costs(self.costs, self.error))
        object.__setattr__(self, "features", _finite_numbers(self.features, "features"))
        for flag in FLAGS:
            if not isinstance(getattr(self, flag), bool):
                raise RecordError(f"{flag} must be true or false, got {getattr(self, flag)!r}")

    @property
    def ok(self) -> bool:
        return self.error == "ok"

    @property
    def cost(self) -> float:
        """Median of the repeats (robust to one noisy run); inf when there is nothing to rank."""
        if not self.ok or not self.costs:
            return math.inf
        return statistics.median(self.costs)

    @property
    def gflops(self) -> float:
        cost = self.cost
        if not math.isfinite(cost) or cost <= 0:
            return 0.0
        return self.flops / cost / 1e9

    @property
    def config_key(self) -> str:
        """Canonical JSON of the config: identifies one config within a workload."""
        return json.dumps(self.config, sort_keys=True, separators=(",", ":"))

    def to_dict(self) -> dict[str, Any]:
        fields = dataclasses.asdict(self)
        fields["costs"] = list(self.costs)
        fields["features"] = list(self.features)
        if not self.features:  # a record without them reads and writes as before they existed
            del fields["features"], fields["feature_set"]
        for flag in FLAGS:  # likewise a search's own measurement
            if not fields[flag]:
                del fields[flag]
        return fields

    def to_json(self) -> str:
        """One line, sorted keys: equal records give equal lines, which is how duplicates go."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_dict(cls, fields: Any) -> TuningRecord:
        """Build from a decoded JSON object; unknown keys are ignored (newer writers)."""
        if not isinstance(fields, dict):
            raise RecordError(f"a tuning record is a JSON object, got {type(fields).__name__}")
        missing = [name for name in REQUIRED_FIELDS if name not in fields]
        if missing:
            raise RecordError(f"tuning record lacks field(s): {', '.join(missing)}")
        known = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{name: value for name, value in fields.items() if name in known})
        except TypeError as err:  # e.g. a value of a type the checks above never expected
            raise RecordError(f"malformed tuning record: {err}") from err

    @classmethod
    def from_json(cls, line: str | bytes) -> TuningRecord:
        try:
            # Python's json accepts NaN/Infinity; a log we wrote never holds them, so refuse.
            fields = json.loads(line, parse_constant=_refuse_constant)
        except (ValueError, UnicodeDecodeError) as err:
            raise RecordError(f"tuning record is not valid JSON: {err}") from err
        return cls.from_dict(fields)


def _refuse_constant(name: str) -> float:
    raise RecordError(f"tuning record holds {name}, which JSON does not allow")


# --------------------------------------------------------------------------- the log


class TuningLog(abc.ABC):
    """An append-only store of tuning records with a cached, incrementally refreshed view.

    Subclasses supply `extend` (write) and `_read_new` (records appended since the last call);
    this class keeps them in order, indexed by task, and answers the queries. Instances are
    safe to share between threads; several processes each use their own instance.
    """

    def __init__(self) -> None:
        self.skipped = 0  # malformed lines seen and passed over
        self._lock = threading.RLock()
        self._records: list[TuningRecord] = []
        self._by_task: dict[tuple[str, str], list[TuningRecord]] = {}

    # -- what a backend provides

    @abc.abstractmethod
    def extend(self, records: Iterable[TuningRecord]) -> None:
        """Append records in one atomic write, so concurrent writers never interleave lines."""

    @abc.abstractmethod
    def _read_new(self) -> list[TuningRecord]:
        """Records appended since the last call (by anyone), in log order."""

    def _forget(self) -> None:
        """Drop the cache: the backend saw its store shrink or be replaced."""
        self._records = []
        self._by_task = {}
        self.skipped = 0

    def close(self) -> None:  # noqa: B027 (a hook, not abstract: most backends hold nothing)
        """Release connections; the log must not be used afterwards."""

    # -- writing

    def append(self, record: TuningRecord) -> None:
        self.extend([record])

    def import_jsonl(self, path: str | os.PathLike[str]) -> int:
        """Append the records of a JSON-lines file that this log lacks; return how many.

        Exact duplicates (same JSON line) are skipped, whether already in the log or repeated
        in the file, so importing the same file twice adds nothing the second time.
        """
        seen = {record.to_json() for record in self.records()}
        new = []
        for record in read_jsonl(path):
            line = record.to_json()
            if line not in seen:
                seen.add(line)
                new.append(record)
        if new:
            self.extend(new)
        return len(new)

    def export_jsonl(self, path: str | os.PathLike[str], best_only: bool = False) -> int:
        """Write every record (with `best_only`, the best ok record of each workload, machine
        and template version: all a build applies) to a JSON-lines file; return how many.

        The file is written beside its destination and renamed into place, so a failure never
        leaves a half-written export behind (and a log may be compacted onto its own path).
        """
        records = self.records()
        if best_only:
            records = best_records(records)
        _write_atomically(Path(path), "".join(record.to_json() + "\n" for record in records))
        return len(records)

    # -- reading

    def refresh(self) -> None:
        """Fold in what was appended since the last look; every query calls this first."""
        with self._lock:
            for record in self._read_new():
                self._records.append(record)
                task = (record.workload_key, record.fingerprint)
                self._by_task.setdefault(task, []).append(record)

    def records(
        self, workload_key: str | None = None, fingerprint: str | None = None
    ) -> list[TuningRecord]:
        """Records in log order, optionally only those of one workload and/or one fingerprint."""
        with self._lock:
            self.refresh()
            if workload_key is not None and fingerprint is not None:
                return list(self._by_task.get((workload_key, fingerprint), ()))
            return [
                record
                for record in self._records
                if workload_key in (None, record.workload_key)
                and fingerprint in (None, record.fingerprint)
            ]

    def __iter__(self) -> Iterator[TuningRecord]:
        return iter(self.records())

    def best(
        self,
        workload_key: str,
        fingerprint: str,
        template: str | None = None,
        template_version: int | None = None,
    ) -> TuningRecord | None:
        """The ok record with the lowest median cost, or None.

        Only records measured on `fingerprint` count: a config tuned on other hardware is
        never applied. `template` / `template_version`, when given, must match too, because a
        config of another template version may name knobs that no longer mean the same.
        On equal cost the earlier record wins, so the answer is stable as the log grows.
        """
        return next(iter(self.ranked(workload_key, fingerprint, template, template_version)), None)

    def checked_in_model(self, workload_key: str, fingerprint: str, template_version: int) -> bool:
        """Whether in-model timings decide the workload's best (none came after them)."""
        ranked = self.ranked(workload_key, fingerprint, template_version=template_version)
        return bool(ranked) and ranked[0].in_model

    def ranked(
        self,
        workload_key: str,
        fingerprint: str,
        template: str | None = None,
        template_version: int | None = None,
    ) -> list[TuningRecord]:
        """The ok records `best` chooses from, fastest first (earlier first on equal cost)."""
        return _ranked(
            record
            for record in self.records(workload_key, fingerprint)
            if template in (None, record.template)
            and template_version in (None, record.template_version)
        )

    def previous_choice(
        self, workload_key: str, fingerprint: str, template: str, template_version: int
    ) -> TuningRecord | None:
        """What builds applied before the workload's latest search: the fastest record of the
        last in-model check that came before its last search measurement; None when no check
        came before it. A later session's search compares its own configs with each other;
        the in-model check then times this one beside them, so a re-tune cannot replace what
        ran fastest in the model on the strength of isolated timings taken on another day."""
        return _previous_check(
            record
            for record in self.records(workload_key, fingerprint)
            if (record.template, record.template_version) == (template, template_version)
        )

    def measured(self, workload_key: str, fingerprint: str) -> set[str]:
        """Config keys already recorded for a task, ok or failed: a resumed tuner skips them."""
        return {record.config_key for record in self.records(workload_key, fingerprint)}

    def __enter__(self) -> TuningLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def best_records(records: Iterable[TuningRecord]) -> list[TuningRecord]:
    """The best ok record per (workload, fingerprint, template, template version), in log
    order: what `TuningLog.best` answers for each, and nothing else."""
    records = list(records)
    groups: dict[tuple, list[TuningRecord]] = {}
    for record in records:
        group = (record.workload_key, record.fingerprint, record.template)
        groups.setdefault((*group, record.template_version), []).append(record)
    chosen = {id(ranked[0]) for ranked in map(_ranked, groups.values()) if ranked}
    return [record for record in records if id(record) in chosen]


def _ranked(records: Iterable[TuningRecord]) -> list[TuningRecord]:
    """One workload's ok records that decide its best (`_deciding`), fastest first and the
    earlier first on equal cost: the rule of `TuningLog.ranked` and `best_records` alike."""
    candidates = [record for record in records if math.isfinite(record.cost)]
    return sorted(_deciding(candidates), key=lambda record: record.cost)


def _previous_check(records: Iterable[TuningRecord]) -> TuningRecord | None:
    """The fastest ok record of the last run of in-model records (one check's, a check
    appends them together) before the last search measurement (`previous_choice`)."""
    candidates = [record for record in records if math.isfinite(record.cost)]
    checked = [k for k, r in enumerate(candidates[: _last_search(candidates)]) if r.in_model]
    if not checked:
        return None
    start = end = checked[-1]
    while start > 0 and candidates[start - 1].in_model:
        start -= 1
    return min(candidates[start : end + 1], key=lambda record: record.cost)


# A check writes its records together, within a second; checks are minutes apart at least.
CHECK_SECONDS = 60.0


def _deciding(candidates: list[TuningRecord]) -> list[TuningRecord]:
    """The records (in log order) that decide a workload's best: the last in-model check's
    timings when they came after its last search measurement, else the others (a newer
    search has not been checked in the model; in-model times do not compare with isolated
    ones). Only the last check's: two checks' timings, taken on different days, do not
    compare either, and a check times the choice before it beside its own candidates. (The
    logs of two Zen 3 VMs, merged: GEMM 1024^3's older check read packed A 13.4 ms, the
    newer Strassen 13.7, and packed A won; side by side Strassen ran 12.2 ms, packed A 13.4.)"""
    in_model = [r for r in candidates[_last_search(candidates) + 1 :] if r.in_model]
    if in_model:
        latest = max(record.timestamp for record in in_model)
        return [r for r in in_model if r.timestamp >= latest - CHECK_SECONDS]
    return [r for r in candidates if not r.in_model]


def _last_search(records: list[TuningRecord]) -> int:
    """The index of the last search measurement (a record neither re-timed nor timed in the
    model), -1 when there is none."""
    return max((k for k, r in enumerate(records) if not r.retimed), default=-1)


def _parse_line(line: bytes, where: str) -> TuningRecord | None:
    """A record, or None for a malformed line (logged): one bad line must not sink a log."""
    try:
        return TuningRecord.from_json(line)
    except RecordError as err:
        log.warning("skipping malformed tuning record at %s: %s", where, err)
        return None


def read_jsonl(path: str | os.PathLike[str]) -> list[TuningRecord]:
    """The well-formed records of a JSON-lines file; malformed and blank lines are skipped."""
    records = []
    with open(path, "rb") as file:
        for number, line in enumerate(file, start=1):
            if line.strip():
                record = _parse_line(line, f"{path}:{number}")
                if record is not None:
                    records.append(record)
    return records


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise


# --------------------------------------------------------------------------- file backend


class FileLog(TuningLog):
    """A JSON-lines file, append-only, shared safely by concurrent processes on one host.

    Each `extend` writes all its lines with one `os.write` on an O_APPEND descriptor under an
    exclusive `flock`, so lines from different writers never interleave. Readers take a shared
    lock and read from the offset they reached last time. A last line without its newline is
    what a crash mid-write leaves: it is skipped with a warning and never fails the log.
    `fsync=True` makes each append durable before it returns, at a cost per append.
    """

    def __init__(self, path: str | os.PathLike[str], fsync: bool = False) -> None:
        super().__init__()
        self.path = Path(path)
        self.fsync = fsync
        self._offset = 0  # bytes of the file already parsed: always just after a newline
        self._inode: int | None = None
        self._warned_tail: int | None = None  # offset of the torn tail already warned about

    def __repr__(self) -> str:
        return f"FileLog({str(self.path)!r})"

    def extend(self, records: Iterable[TuningRecord]) -> None:
        data = "".join(record.to_json() + "\n" for record in records).encode()
        if not data:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if _ends_torn(fd):
                # Close a line a crashed writer left open, or our first record would be glued
                # onto it and lost with it; the torn line becomes one skipped malformed line.
                data = b"\n" + data
            _write_all(fd, data)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)  # closing also drops the flock

    def _read_new(self) -> list[TuningRecord]:
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            self._reset_if_replaced(None, 0)
            return []
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # never see half of a batch being written
            stat = os.fstat(fd)
            self._reset_if_replaced(stat.st_ino, stat.st_size)
            data = _read_from(fd, self._offset, stat.st_size)
        finally:
            os.close(fd)
        return self._parse_tail(data)

    def _reset_if_replaced(self, inode: int | None, size: int) -> None:
        # A new file under the same name, or a shorter one, invalidates all we parsed.
        if inode != self._inode or size < self._offset:
            if self._offset or self._records:
                log.warning("tuning log %s was replaced or truncated: reading it anew", self.path)
            self._forget()
            self._offset = 0
            self._warned_tail = None
            self._inode = inode

    def _parse_tail(self, data: bytes) -> list[TuningRecord]:
        """Parse the complete lines of `data` (read at self._offset) and advance the offset.

        Bytes after the last newline are not consumed: if they are a torn write we warn once;
        if a writer later closes that line, the next read parses it then.
        """
        end = data.rfind(b"\n") + 1
        records = []
        position = self._offset
        for line in data[:end].splitlines(keepends=True):
            if line.strip():
                record = _parse_line(line, f"{self.path}@{position}")
                if record is None:
                    self.skipped += 1
                else:
                    records.append(record)
            position += len(line)
        self._offset += end
        if end < len(data) and self._warned_tail != self._offset:
            log.warning(
                "tuning log %s ends in a truncated line (%d bytes at offset %d): skipping it",
                self.path,
                len(data) - end,
                self._offset,
            )
            self._warned_tail = self._offset
        return records


def _ends_torn(fd: int) -> bool:
    size = os.fstat(fd).st_size
    return size > 0 and os.pread(fd, 1, size - 1) != b"\n"


def _write_all(fd: int, data: bytes) -> None:
    # One write covers a batch on any regular file; the loop only guards against a short
    # write (disk full, signal), which still lands whole because we hold the lock.
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read_from(fd: int, offset: int, size: int) -> bytes:
    chunks = []
    while offset < size:
        chunk = os.pread(fd, size - offset, offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


# --------------------------------------------------------------------------- Redis backend


class RedisLog(TuningLog):
    """A Redis list of JSON lines shared by tuning workers on many hosts.

    RPUSH of a batch is one atomic command, so concurrent writers never interleave; readers
    LRANGE from the index they reached. "Best" is recomputed from the cached records rather
    than kept in a side index, so there is nothing that can disagree with the list.
    """

    def __init__(self, url: str, key: str = "kiln:tuning") -> None:
        super().__init__()
        import redis  # only the shared backend needs the client library

        self.url = url
        self.key = key
        self.client = redis.Redis.from_url(url)
        self._offset = 0  # list entries already parsed

    def __repr__(self) -> str:
        return f"RedisLog({self.url!r}, key={self.key!r})"

    def extend(self, records: Iterable[TuningRecord]) -> None:
        lines = [record.to_json() for record in records]
        if lines:
            self.client.rpush(self.key, *lines)

    def _read_new(self) -> list[TuningRecord]:
        if self.client.llen(self.key) < self._offset:  # the list was deleted or trimmed
            log.warning("tuning log %s shrank: reading it anew", self)
            self._forget()
            self._offset = 0
        lines = self.client.lrange(self.key, self._offset, -1)
        records = []
        for index, line in enumerate(lines, start=self._offset):
            record = _parse_line(line, f"{self.key}[{index}]")
            if record is None:
                self.skipped += 1
            else:
                records.append(record)
        self._offset += len(lines)
        return records

    def close(self) -> None:
        self.client.close()


# --------------------------------------------------------------------------- opening


REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def open_log(spec: str | os.PathLike[str] | TuningLog) -> TuningLog:
    """A log from what a user passes as `tuning=`: a Redis URL, a path, or a log itself."""
    if isinstance(spec, TuningLog):
        return spec
    if isinstance(spec, str) and spec.startswith(REDIS_SCHEMES):
        return RedisLog(spec)
    if isinstance(spec, (str, os.PathLike)):
        return FileLog(spec)
    raise TypeError(f"a tuning log is a path, a redis:// URL or a TuningLog, got {spec!r}")
