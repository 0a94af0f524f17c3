"""Dynamic batching: concurrent requests to one model version run together as one batch.

Only for archives compiled with batch buckets (`kiln compile --batch-buckets 1,2,4,8`): their
axis 0 is the batch of every input and output, and one run takes any batch up to the largest
bucket. A batch is the oldest waiting request and every other one already queued that still
fits the largest bucket, waiting up to `max_delay` seconds for more (0: none; requests that
queued while every instance was busy still run together, so batching costs no latency when
the server is idle). The batch's inputs are concatenated along axis 0, run once, and
each request gets its own rows of the outputs.

A request is checked on its own before it is queued, so a bad one fails alone with the
reason; a batch that fails while running fails each of its requests with that error.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

Outputs = dict[str, np.ndarray]


class BatcherClosed(RuntimeError):  # noqa: N818 - a state, as queue.Empty
    """A request reached a batcher whose model version was unloaded or replaced."""


@dataclass
class _Request:
    inputs: dict[str, np.ndarray]
    batch: int
    done: threading.Event = field(default_factory=threading.Event)
    outputs: Outputs | None = None
    error: BaseException | None = None


@dataclass
class BatchStats:
    batches: int = 0
    requests: int = 0
    largest: int = 0  # the most requests one batch held


class DynamicBatcher:
    """Leader and followers, no thread of its own: a request's thread that finds an instance
    free becomes the leader, takes the oldest queued requests that fit one batch (its own
    among them, or else it leads again afterwards) and runs them; the others wait until their
    rows are in, or until an instance frees and one of them leads the next batch. No hand-off
    to another thread on the way: at concurrency 1 a request runs on its own thread, as
    without batching."""

    def __init__(
        self,
        run: Callable[[Mapping[str, np.ndarray]], Outputs],
        check: Callable[[Mapping[str, np.ndarray]], int],
        max_batch: int,
        max_delay: float,
        workers: int,
    ):
        """`run(inputs) -> outputs` runs one batch on a free instance (`workers` of them);
        `check(inputs)` is a request's batch size, or raises the error saying why it cannot
        run."""
        self._run, self._check = run, check
        self.max_batch, self.max_delay = max_batch, max_delay
        self._pending: list[_Request] = []
        self._free = workers  # instances no leader holds
        self._changed = threading.Condition()
        self.stats = BatchStats()
        self._closed = False

    def submit(self, inputs: Mapping[str, np.ndarray]) -> Outputs:
        """Run `inputs` in the next batch that has room, and return its rows of the outputs."""
        arrays = {name: np.asarray(value) for name, value in inputs.items()}
        request = _Request(arrays, self._check(arrays))
        with self._changed:
            if self._closed:
                raise BatcherClosed("the model version was unloaded or replaced")
            self._pending.append(request)
            self._changed.notify_all()  # a leader waiting out max_delay looks again
            while not request.done.is_set():
                if self._free and self._pending:
                    self._free -= 1
                    batch = self._take()
                    self._changed.release()
                    try:
                        self._run_batch(batch)
                    finally:
                        self._changed.acquire()
                        self._free += 1
                        self._changed.notify_all()
                else:
                    self._changed.wait()
        if request.error is not None:
            raise request.error
        assert request.outputs is not None
        return request.outputs

    def close(self) -> None:
        """Refuse new requests; those already queued still run."""
        with self._changed:
            self._closed = True

    def _take(self) -> list[_Request]:
        """The oldest pending requests that fit one batch, waiting up to max_delay for more
        when the first ones leave room (called holding the condition)."""
        deadline = time.monotonic() + self.max_delay
        while True:
            batch, size = [], 0
            for request in self._pending:
                if size + request.batch > self.max_batch:
                    break
                batch.append(request)
                size += request.batch
            remaining = deadline - time.monotonic()
            if size >= self.max_batch or len(batch) < len(self._pending) or remaining <= 0:
                break
            self._changed.wait(remaining)  # a new request notifies: look again
        del self._pending[: len(batch)]
        return batch

    def _run_batch(self, batch: list[_Request]) -> None:
        try:
            if len(batch) == 1:
                batch[0].outputs = self._run(batch[0].inputs)
            else:
                names = list(batch[0].inputs)
                joined = {n: np.concatenate([r.inputs[n] for r in batch]) for n in names}
                outputs = self._run(joined)
                start = 0
                for request in batch:
                    rows = slice(start, start + request.batch)
                    request.outputs = {n: np.array(v[rows]) for n, v in outputs.items()}
                    start += request.batch
        except BaseException as err:  # noqa: BLE001 - every request of the batch learns why
            for request in batch:
                request.error = err
        finally:
            with self._changed:
                self.stats.batches += 1
                self.stats.requests += len(batch)
                self.stats.largest = max(self.stats.largest, len(batch))
            for request in batch:
                request.done.set()
