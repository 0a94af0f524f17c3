"""Request and response bodies of the api."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

NAME_PATTERN = r"^[a-z0-9]([a-z0-9_.-]{0,62}[a-z0-9])?$"
DIGEST_PATTERN = r"^sha256:[0-9a-f]{64}$"


class TensorSpec(BaseModel):
    name: str
    dtype: str
    shape: list[int | str]


class ModelInfo(BaseModel):
    id: str
    digest: str
    name: str | None = None
    size: int
    ir_version: int
    opsets: dict[str, int]
    producer: str | None = None
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    op_histogram: dict[str, int]
    nodes: int
    created: float


class ModelList(BaseModel):
    models: list[ModelInfo]


class Tuning(BaseModel):
    model_config = ConfigDict(extra="forbid")
    trials: int | None = Field(default=None, ge=1, le=1_000_000)
    time_budget: float | None = Field(default=None, gt=0, le=7 * 24 * 3600, description="seconds")


class CompilationRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1, max_length=100, description="a model id from /v1/models")
    target: str = Field(default="llvm", min_length=1, max_length=200)
    shapes: dict[str, list[int]] | None = Field(
        default=None, description="binds symbolic input dims, e.g. {'x': [1, 784]}"
    )
    tuning: Tuning | None = None


Status = Literal["queued", "running", "done", "failed", "cancelled"]


class Progress(BaseModel):
    tasks_done: int = 0
    tasks_total: int = 0
    # The tuned workloads' time in one model run (occurrences x best measured), once each
    # has a measurement.
    estimated_ms: float | None = None


class Compilation(BaseModel):
    id: str
    model: str
    target: str
    shapes: dict[str, list[int]] | None = None
    tuning: Tuning | None = None
    status: Status
    stage: str
    progress: Progress
    best_latency_ms: float | None = None
    artifact: str | None = None
    error: str | None = None
    verification: dict | None = None
    attempts: int = 0
    created: float
    updated: float


class CompilationList(BaseModel):
    compilations: list[Compilation]


class DeploymentRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    artifact: str = Field(pattern=DIGEST_PATTERN)
    name: str = Field(pattern=NAME_PATTERN, description="the name the runtime server serves")
    version: str = Field(default="1", pattern=r"^[0-9]{1,9}$")


class Deployment(BaseModel):
    name: str
    version: str
    artifact: str
    infer_url: str
    created: float


class DeploymentList(BaseModel):
    deployments: list[Deployment]


class Health(BaseModel):
    status: Literal["ok", "degraded"]
    checks: dict[str, str]
