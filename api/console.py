"""The web console: static files at `/ui`, and the few read-mostly routes it needs beyond the
core api (a compiled artifact's kernels, a deployment's live stats, inference through the api,
the tuning log). The console itself talks only to public HTTP routes, like any other client.

Every route here is key-scoped and answers errors as problem+json, like `api.routes`.
"""

from __future__ import annotations

import io
import json
import math
import zipfile
from pathlib import Path
from typing import Annotated, Literal

import httpx
from fastapi import APIRouter, FastAPI, Request
from fastapi import Path as PathParam
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field

from api import schemas
from api.deps import PlatformDep, Tenant
from api.errors import ApiError, responses

# The tuning log's reader is stdlib-only Python (records hold no model data, so the api may
# show them); it is the one module of the compiler the api imports (tests/test_rooms.py).
from compiler_core.autotune.records import RecordError, TuningLog, open_log

STATIC_DIR = Path(__file__).parent / "static"
INFERENCE_HISTOGRAM = "kiln_runtime_inference_seconds"
RUNTIME_TIMEOUT = 60.0

router = APIRouter(prefix="/v1", tags=["console"])
Digest = Annotated[str, PathParam(pattern=schemas.DIGEST_PATTERN)]
DeploymentName = Annotated[str, PathParam(pattern=schemas.NAME_PATTERN)]


# --- bodies ---------------------------------------------------------------------------------


class Kernel(BaseModel):
    name: str
    schedule: Literal["tuned", "default"]
    template: str | None = None
    config: dict[str, int | str] | None = None
    workload_key: str | None = None
    measured_us: float | None = None
    gflops: float | None = None
    share: float | None = Field(
        default=None, description="measured_us over the model's measured latency (0..1)"
    )


class ArtifactKernels(BaseModel):
    artifact: str
    target: str | None = None
    kernels: list[Kernel]
    distinct_kernels: int | None = None
    workspace_bytes: int | None = Field(default=None, description="the run's planned buffers")
    kernel_scratch_bytes: int | None = Field(
        default=None, description="the most one kernel takes beside the workspace in a call"
    )
    compile_seconds: float | None = None
    tuning_seconds: float | None = Field(
        default=None, description="from the job that built it: tuning stage to building stage"
    )
    latency_ms: float | None = Field(default=None, description="the job's measured latency")
    compilation: str | None = Field(default=None, description="the job that built it")


class VersionState(BaseModel):
    version: str
    state: str
    reason: str | None = None


class DeploymentStats(BaseModel):
    name: str
    version: str
    artifact: str
    state: str = Field(description="the deployed version's state on the runtime server")
    versions: list[VersionState]
    requests: int = Field(description="inferences served, all versions")
    mean_ms: float | None = None
    p50_ms: float | None = Field(default=None, description="estimated from histogram buckets")
    p99_ms: float | None = Field(default=None, description="estimated from histogram buckets")
    p50_bucket_ms: float | None = Field(
        default=None, description="upper bound of the histogram bucket that holds the median"
    )
    p99_bucket_ms: float | None = Field(
        default=None, description="upper bound of the histogram bucket that holds the p99"
    )


Scalar = bool | int | float | str


class InferTensor(BaseModel):
    name: str = Field(min_length=1, max_length=200)
    shape: list[int] = Field(max_length=16)
    datatype: str = Field(min_length=1, max_length=16)
    data: list[Scalar]


class InferRequest(BaseModel):
    id: str | None = Field(default=None, max_length=200)
    inputs: list[InferTensor] = Field(min_length=1, max_length=64)


class InferResponse(BaseModel):
    model_name: str
    model_version: str | None = None
    id: str | None = None
    outputs: list[InferTensor]


class BestRecord(BaseModel):
    template: str
    template_version: int
    config: dict[str, int | str]
    measured_us: float
    gflops: float
    timestamp: float


class TargetTuning(BaseModel):
    fingerprint: str
    target: str
    trials: int = Field(description="configs measured for this workload on this target")
    errors: int = Field(description="trials that failed to build, run or verify")
    best: BestRecord | None = None


class Workload(BaseModel):
    workload_key: str
    workload: str
    targets: list[TargetTuning]


class TuningSummary(BaseModel):
    backend: Literal["file", "redis"]
    records: int
    skipped: int = Field(description="malformed lines passed over")
    workloads: list[Workload]


# --- artifacts ------------------------------------------------------------------------------


@router.get(
    "/artifacts/{digest}/kernels",
    response_model=ArtifactKernels,
    responses=responses(401, 404, 422, 503),
)
def artifact_kernels(digest: Digest, tenant: Tenant, platform: PlatformDep):
    """Per kernel of a compiled model: tuned (template, config, measured µs, share of the
    model's time) or the default schedule; read from the archive's own manifest."""
    data = platform.artifact(tenant, digest)
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            manifest = json.loads(archive.read("manifest.json"))
    except (zipfile.BadZipFile, KeyError, ValueError) as err:
        raise ApiError(503, "Service Unavailable", f"the archive has no manifest: {err}") from None
    job = _job_of(platform, tenant, digest)
    latency_ms = job.get("best_latency_ms") if job else None
    kernels = []
    for name, note in (manifest.get("kernels") or {}).items():
        if isinstance(note, dict) and note.get("schedule") == "tuned":
            measured = note.get("measured_us")
            share = measured / (latency_ms * 1000) if measured and latency_ms else None
            kernels.append(
                Kernel(
                    name=name,
                    schedule="tuned",
                    template=note.get("template"),
                    config=note.get("config"),
                    workload_key=note.get("workload_key"),
                    measured_us=measured,
                    gflops=note.get("gflops"),
                    share=round(share, 4) if share is not None else None,
                )
            )
        else:
            kernels.append(Kernel(name=name, schedule="default"))
    store_manifest = platform.artifact_manifest(tenant, digest)
    memory = manifest.get("memory") or {}
    return ArtifactKernels(
        artifact=digest,
        target=manifest.get("target"),
        kernels=kernels,
        distinct_kernels=manifest.get("distinct_kernels"),
        workspace_bytes=memory.get("workspace_bytes"),
        kernel_scratch_bytes=memory.get("kernel_scratch_bytes"),
        compile_seconds=store_manifest.get("compile_seconds"),
        tuning_seconds=_tuning_seconds(platform, job) if job else None,
        latency_ms=latency_ms,
        compilation=job["id"] if job else None,
    )


def _job_of(platform, tenant: str, digest: str) -> dict | None:
    """The tenant's latest job that built (not merely reused) this artifact, else any."""
    jobs = [j for j in platform.ledger.list_jobs(tenant) if j.get("artifact") == digest]
    built = [j for j in jobs if j.get("best_latency_ms") is not None]
    return (built or jobs or [None])[-1]


def _tuning_seconds(platform, job: dict) -> float | None:
    """Seconds from the job's `tuning` stage event to its `building` one (events carry their
    append time), None when it did not tune."""
    started = ended = None
    for _, event in platform.ledger.read_events(job["id"]):
        if event.get("type") == "stage" and event.get("stage") == "tuning" and event.get("tuned"):
            started = event.get("time")
        elif event.get("type") == "stage" and event.get("stage") == "building":
            ended = event.get("time")
    if started is None or ended is None:
        return None
    return round(ended - started, 3)


# --- deployments ----------------------------------------------------------------------------


@router.get(
    "/deployments/{name}/stats",
    response_model=DeploymentStats,
    responses=responses(401, 404, 422, 502, 503),
)
async def deployment_stats(name: DeploymentName, tenant: Tenant, platform: PlatformDep):
    """The deployment's state and versions on the runtime server, and its request count and
    latency quantiles from the server's Prometheus histogram."""
    record = platform.deployment(tenant, name)
    async with _runtime_client(platform) as client:
        index = await _runtime_call(client, "POST", "/v2/repository/index", json={})
        metrics = await _runtime_call(client, "GET", "/metrics")
    versions = [
        VersionState(version=row["version"], state=row["state"], reason=row.get("reason") or None)
        for row in index.json()
        if row.get("name") == name
    ]
    state = next((v.state for v in versions if v.version == record["version"]), "UNAVAILABLE")
    count, total, buckets = _histogram(metrics.text, name)
    p50, p50_bucket = _quantile(0.5, buckets, count)
    p99, p99_bucket = _quantile(0.99, buckets, count)
    return DeploymentStats(
        name=name,
        version=record["version"],
        artifact=record["artifact"],
        state=state,
        versions=versions,
        requests=int(count),
        mean_ms=round(total / count * 1000, 4) if count else None,
        p50_ms=p50,
        p99_ms=p99,
        p50_bucket_ms=p50_bucket,
        p99_bucket_ms=p99_bucket,
    )


def _histogram(text: str, model: str) -> tuple[float, float, dict[float, float]]:
    """(count, sum in s, {upper bound: cumulative count}) of one model, all versions summed."""
    count = total = 0.0
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != INFERENCE_HISTOGRAM:
            continue
        for sample in family.samples:
            if sample.labels.get("model") != model:
                continue
            if sample.name.endswith("_bucket"):
                bound = float(sample.labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + sample.value
            elif sample.name.endswith("_count"):
                count += sample.value
            elif sample.name.endswith("_sum"):
                total += sample.value
    return count, total, buckets


def _quantile(
    q: float, buckets: dict[float, float], count: float
) -> tuple[float | None, float | None]:
    """(estimate, bucket bound) of the q-quantile, in milliseconds. The estimate is Prometheus'
    histogram_quantile: linear interpolation inside the bucket that holds the q-th observation
    (from 0 for the first bucket), the last finite bound when it falls in +Inf. The bound says
    how coarse the estimate is."""
    finite = sorted(b for b in buckets if math.isfinite(b))
    if not count or not finite:
        return None, None
    rank, lower, below = q * count, 0.0, 0.0
    for bound in finite:
        cumulative = buckets[bound]
        if cumulative >= rank:
            inside = cumulative - below
            fraction = (rank - below) / inside if inside else 1.0
            estimate = lower + (bound - lower) * fraction
            return round(estimate * 1000, 4), round(bound * 1000, 4)
        lower, below = bound, cumulative
    return round(finite[-1] * 1000, 4), None


@router.post(
    "/deployments/{name}/infer",
    response_model=InferResponse,
    responses=responses(400, 401, 404, 422, 502, 503),
)
async def deployment_infer(
    name: DeploymentName, body: InferRequest, tenant: Tenant, platform: PlatformDep
):
    """One inference with JSON tensors (KServe v2), sent on to the runtime server for the
    tenant's own deployment."""
    record = platform.deployment(tenant, name)
    path = f"/v2/models/{name}/versions/{record['version']}/infer"
    async with _runtime_client(platform) as client:
        response = await _runtime_call(
            client, "POST", path, json=body.model_dump(exclude_none=True), refuse_4xx=False
        )
    if response.status_code >= 400:
        raise ApiError(400, "Inference refused", _runtime_message(response))
    return response.json()


def _runtime_client(platform) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=platform.settings.runtime_url, timeout=RUNTIME_TIMEOUT)


async def _runtime_call(
    client: httpx.AsyncClient, method: str, path: str, refuse_4xx: bool = True, **kwargs
) -> httpx.Response:
    try:
        response = await client.request(method, path, **kwargs)
    except httpx.HTTPError as err:
        raise ApiError(
            503, "Service Unavailable", f"the runtime server is unreachable: {err}"
        ) from None
    if response.status_code >= 500 or (refuse_4xx and response.status_code >= 400):
        message = _runtime_message(response)
        raise ApiError(502, "Bad Gateway", f"the runtime server refused: {message}")
    return response


def _runtime_message(response: httpx.Response) -> str:
    try:
        return str(response.json().get("error", response.text))
    except (ValueError, AttributeError):
        return response.text[:500]


# --- the tuning log -------------------------------------------------------------------------


@router.get("/tuning", response_model=TuningSummary, responses=responses(401, 503))
def tuning_summary(request: Request, tenant: Tenant, platform: PlatformDep):
    """The shared tuning log as a table: each workload seen, and per target fingerprint how
    many configs were measured and the best one. Records hold no model data, so every tenant
    sees the same log."""
    log = _tuning_log(request, platform.settings.resolved_tuning_log)
    try:
        records = log.records()
    except (OSError, RecordError) as err:
        message = f"the tuning log cannot be read: {err}"
        raise ApiError(503, "Service Unavailable", message) from None
    except Exception as err:  # redis' connection errors, without importing redis here
        if type(err).__module__.startswith("redis"):
            raise ApiError(503, "Service Unavailable", "the tuning log's Redis is down") from None
        raise
    workloads: dict[str, dict] = {}
    for record in records:
        workload = workloads.setdefault(
            record.workload_key,
            {"workload_key": record.workload_key, "workload": record.workload, "targets": {}},
        )
        target = workload["targets"].setdefault(
            record.fingerprint,
            {"fingerprint": record.fingerprint, "target": record.target, "trials": 0, "errors": 0},
        )
        target["trials"] += 0 if record.retimed else 1  # a re-timing is not a trial
        target["errors"] += 0 if record.ok else 1
    for workload in workloads.values():
        for target in workload["targets"].values():
            best = log.best(workload["workload_key"], target["fingerprint"])
            if best is not None:
                target["best"] = {
                    "template": best.template,
                    "template_version": best.template_version,
                    "config": best.config,
                    "measured_us": round(best.cost * 1e6, 3),
                    "gflops": round(best.gflops, 2),
                    "timestamp": best.timestamp,
                }
        workload["targets"] = list(workload["targets"].values())
    backend = "redis" if type(log).__name__ == "RedisLog" else "file"
    return {
        "backend": backend,
        "records": len(records),
        "skipped": log.skipped,
        "workloads": list(workloads.values()),
    }


def _tuning_log(request: Request, spec: str) -> TuningLog:
    """One log object per app: it caches what it parsed and reads only what was appended since
    the last look, so a console polling the page stays cheap on a long log."""
    log = getattr(request.app.state, "console_tuning_log", None)
    if log is None:
        log = request.app.state.console_tuning_log = open_log(spec)
    return log


# --- the static console ---------------------------------------------------------------------


def install(app: FastAPI) -> None:
    """Add the console's routes and serve its files at /ui (index.html at /ui/)."""
    app.include_router(router)

    @app.get("/ui", include_in_schema=False)
    def ui_root() -> RedirectResponse:
        return RedirectResponse("/ui/")

    app.mount("/ui", StaticFiles(directory=STATIC_DIR, html=True), name="ui")
