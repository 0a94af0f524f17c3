"""Prometheus metrics of one runtime server app, in its own registry.

An app-owned registry (not prometheus_client's global one) lets several apps live in one
process, as the tests create them, without "duplicated timeseries" errors.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from compiler_core.runtime.library import workspace_cached_bytes

# From 0.1 ms: Prometheus' default buckets start at 5 ms, which puts every request of a small
# model (an MLP runs in ~0.3 ms) in the first bucket and makes its p50/p99 meaningless.
INFERENCE_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0, float("inf"),
)  # fmt: skip


def outcome_of(status: int) -> str:
    if status < 400:
        return "success"
    return "client_error" if status < 500 else "server_error"


class _BatchCollector:
    """Dynamic batching's counters, read from the repository at scrape time."""

    def __init__(self, batch_stats: Callable[[], list]):
        self._batch_stats = batch_stats

    def collect(self):
        batches = CounterMetricFamily(
            "kiln_runtime_batches",
            "Runs of dynamically batched model versions (one per batch)",
            labels=["model", "version"],
        )
        requests = CounterMetricFamily(
            "kiln_runtime_batched_requests",
            "Inference requests those runs served (requests / batches: the mean batch)",
            labels=["model", "version"],
        )
        for model, version, stats in self._batch_stats():
            batches.add_metric([model, version], stats.batches)
            requests.add_metric([model, version], stats.requests)
        yield batches
        yield requests


class Metrics:
    def __init__(
        self, ready_count: Callable[[], int], batch_stats: Callable[[], list] = lambda: []
    ):
        self.registry = CollectorRegistry()
        self.registry.register(_BatchCollector(batch_stats))
        self.requests = Counter(
            "kiln_runtime_requests",
            "HTTP requests by route template, method and outcome",
            ["route", "method", "outcome"],
            registry=self.registry,
        )
        self.inference_seconds = Histogram(
            "kiln_runtime_inference_seconds",
            "Time to run one inference, waiting for a free instance included",
            ["model", "version"],
            buckets=INFERENCE_BUCKETS,
            registry=self.registry,
        )
        self.loaded_models = Gauge(
            "kiln_runtime_loaded_models",
            "Model versions loaded and ready",
            registry=self.registry,
        )
        # Read at scrape time, so the gauge can never drift from the repository.
        self.loaded_models.set_function(ready_count)
        self.workspace_cached = Gauge(
            "kiln_runtime_workspace_cached_bytes",
            "Kernel scratch blocks the process keeps between runs, beside the models' planned "
            "workspaces (a manifest's memory.kernel_scratch_bytes is one call's)",
            registry=self.registry,
        )
        self.workspace_cached.set_function(lambda: workspace_cached_bytes() or 0)

    @contextmanager
    def time_inference(self, model: str, version: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - started
            self.inference_seconds.labels(model, version).observe(elapsed)


class RequestCounter:
    """ASGI middleware counting requests by route *template* (not the raw path), which keeps
    the label set bounded whatever model names clients send."""

    def __init__(self, app, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # an exception escaping the app reaches the client as a 500

        async def send_with_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(template, scope["method"], outcome_of(status)).inc()
