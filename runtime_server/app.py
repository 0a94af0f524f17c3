"""The Open Inference Protocol (KServe v2 REST) server: thin routes over the repository.

Status codes: 404 for an unknown model, 400 for a request the client must fix, including
inference on a known model that is not loaded (the client unloaded it or must load it first:
a request error, never a 5xx), 503 only when the server itself cannot reach its store. The
model-ready endpoint answers 400 for "not ready": the protocol says readiness is the status
code itself, 200 for true and 4xx for false, and Triton uses 400.
"""

from __future__ import annotations

import contextlib
import json
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime_server import protocol
from runtime_server.fastpath import InferFastPath
from runtime_server.metrics import Metrics, RequestCounter
from runtime_server.protocol import ProtocolError
from runtime_server.repository import (
    ArtifactMissing,
    InvalidRequest,
    ModelNotFound,
    ModelNotReady,
    ModelRepository,
    RepositoryError,
    StoreUnavailable,
)
from runtime_server.settings import RuntimeSettings
from runtime_server.sync import DeploymentSync

SERVER_NAME = "kiln"
PLATFORM = "kiln_native"
EXTENSIONS = ["binary_tensor_data", "model_repository"]

ERROR_STATUS: dict[type[Exception], int] = {
    ModelNotFound: 404,
    ArtifactMissing: 404,
    ModelNotReady: 400,
    StoreUnavailable: 503,
    InvalidRequest: 400,
    ProtocolError: 400,
}


def server_version() -> str:
    try:
        return package_version("kiln")
    except PackageNotFoundError:
        return "0+unknown"


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


# -- dependencies ------------------------------------------------------------------------


# Async on purpose: FastAPI runs a plain `def` dependency in the thread pool, and these two
# would cost every inference two thread round trips for an attribute read.
async def get_repository(request: Request) -> ModelRepository:
    return request.app.state.repository


async def get_metrics(request: Request) -> Metrics:
    return request.app.state.metrics


RepositoryDep = Annotated[ModelRepository, Depends(get_repository)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]

router = APIRouter()


# -- health and metadata -----------------------------------------------------------------


@router.get("/v2/health/live")
def live() -> dict:
    return {"live": True}


@router.get("/v2/health/ready")
def ready() -> dict:
    # Preloads finish before the server starts listening, so serving means ready.
    return {"ready": True}


@router.get("/v2")
def server_metadata() -> dict:
    return {"name": SERVER_NAME, "version": server_version(), "extensions": EXTENSIONS}


@router.get("/v2/models/{model}")
@router.get("/v2/models/{model}/versions/{version}")
def model_metadata(repository: RepositoryDep, model: str, version: str = "") -> dict:
    meta = repository.metadata(model, version or None)
    return {
        "name": meta.name,
        "versions": meta.versions,
        "platform": PLATFORM,
        "inputs": protocol.tensor_metadata(meta.inputs),
        "outputs": protocol.tensor_metadata(meta.outputs),
    }


@router.get("/v2/models/{model}/ready")
@router.get("/v2/models/{model}/versions/{version}/ready")
def model_ready(repository: RepositoryDep, model: str, version: str = "") -> Response:
    try:
        entry = repository.get(model, version or None)
    except ModelNotReady as err:
        return error(400, str(err))
    return JSONResponse({"name": model, "version": entry.version, "ready": True})


# -- inference ---------------------------------------------------------------------------


@router.post("/v2/models/{model}/infer")
@router.post("/v2/models/{model}/versions/{version}/infer")
async def infer(
    request: Request,
    repository: RepositoryDep,
    metrics: MetricsDep,
    model: str,
    version: str = "",
) -> Response:
    body = await request.body()
    header_length = request.headers.get(protocol.HEADER_LENGTH)
    # Decoding, the run and encoding all leave the event loop: a large JSON tensor is as
    # slow to parse as a small model is to run.
    content, headers, media_type = await run_in_threadpool(
        run_inference, repository, metrics, model, version or None, body, header_length
    )
    return Response(content, media_type=media_type, headers=headers)


def run_inference(
    repository: ModelRepository,
    metrics: Metrics,
    model: str,
    version: str | None,
    body: bytes,
    header_length: str | None,
) -> tuple[bytes, dict[str, str], str]:
    entry = repository.get(model, version)
    request = protocol.decode_infer_request(body, header_length)
    pool = entry.pool
    if pool is None:  # unloaded since get()
        raise ModelNotReady(f"model '{model}' version '{entry.version}' is not ready")
    protocol.check_inputs(request.inputs, pool.inputs, model)
    selection = protocol.select_outputs(request, pool.outputs, model)
    with metrics.time_inference(model, entry.version):
        outputs = pool.run(request.inputs)
    return protocol.encode_infer_response(model, entry.version, outputs, selection, request.id)


# -- model repository extension ----------------------------------------------------------


async def optional_json(request: Request) -> dict:
    body = await request.body()
    if not body.strip():
        return {}
    return protocol.parse_json_object(body)


@router.post("/v2/repository/index")
async def repository_index(request: Request, repository: RepositoryDep) -> list[dict]:
    body = await optional_json(request)
    ready_only = body.get("ready", False)
    if not isinstance(ready_only, bool):
        raise ProtocolError("'ready' must be true or false")
    return repository.index(ready_only=ready_only)


@router.post("/v2/repository/models/{model}/load")
async def load_model(request: Request, repository: RepositoryDep, model: str) -> dict:
    artifact, version = load_parameters(await optional_json(request))
    # Fetching and loading N module instances is blocking work.
    await run_in_threadpool(repository.load, model, artifact, version)
    return {}


def load_parameters(body: dict) -> tuple[str | None, str | None]:
    """(artifact, version) of a load request, in our form or tritonclient's `config` form."""
    parameters = body.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise ProtocolError("'parameters' of a load request must be a JSON object")
    config = parameters.get("config")
    if config is not None:
        # tritonclient's load_model(config=...) sends the config as a JSON string.
        if isinstance(config, str):
            config = protocol.parse_json_object(config.encode(), "load 'config' parameter")
        if not isinstance(config, dict):
            raise ProtocolError("the load 'config' parameter must be a JSON object")
        parameters = {**parameters, **config}
    artifact = parameters.get("artifact")
    version = parameters.get("version")
    if artifact is not None and not isinstance(artifact, str):
        raise ProtocolError("'artifact' must be a 'sha256:<hex>' string")
    if isinstance(version, int) and not isinstance(version, bool):
        version = str(version)  # Triton's versions are integers; accept 2 as "2"
    if version is not None and not isinstance(version, str):
        raise ProtocolError("'version' must be a string")
    return artifact, version


@router.post("/v2/repository/models/{model}/unload")
def unload_model(repository: RepositoryDep, model: str) -> dict:
    # The body (tritonclient sends unload_dependents) has nothing for a model without
    # dependents, so it is not read.
    repository.unload(model)
    return {}


@router.get("/metrics")
def metrics_endpoint(metrics: MetricsDep) -> Response:
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


# -- errors ------------------------------------------------------------------------------


def status_of(err: Exception) -> int:
    for kind in type(err).__mro__:
        if kind in ERROR_STATUS:
            return ERROR_STATUS[kind]
    return 500


async def handle_known_error(request: Request, err: Exception) -> JSONResponse:
    return error(status_of(err), str(err))


async def handle_validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
    details = "; ".join(
        f"{'.'.join(str(part) for part in e.get('loc', ()))}: {e.get('msg')}" for e in err.errors()
    )
    return error(400, f"invalid request: {details}")


async def handle_http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
    detail: Any = err.detail
    message = detail if isinstance(detail, str) else json.dumps(detail)
    return JSONResponse({"error": message}, status_code=err.status_code, headers=err.headers)


# -- the app -----------------------------------------------------------------------------


def create_app(
    settings: RuntimeSettings | None = None, repository: ModelRepository | None = None
) -> FastAPI:
    """The server app. `repository` lets a caller preload models (see __main__)."""
    settings = settings or RuntimeSettings()
    if repository is None:
        repository = ModelRepository(
            settings.store(),
            settings.runtime_instances,
            settings.num_threads,
            settings.batch_delay,
        )
    store = repository.store if settings.runtime_sync_seconds > 0 else None

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        sync = None
        if store is not None:
            sync = DeploymentSync(repository, store, settings.runtime_sync_seconds)
            await run_in_threadpool(sync.start)
        yield
        if sync is not None:
            sync.stop()

    app = FastAPI(title="Kiln runtime server", version=server_version(), lifespan=lifespan)
    app.state.settings = settings
    app.state.repository = repository
    app.state.metrics = Metrics(repository.ready_count, repository.batch_stats)
    app.include_router(router)
    app.add_exception_handler(RepositoryError, handle_known_error)
    app.add_exception_handler(ProtocolError, handle_known_error)
    app.add_exception_handler(RequestValidationError, handle_validation_error)
    app.add_exception_handler(StarletteHTTPException, handle_http_error)
    app.add_middleware(RequestCounter, metrics=app.state.metrics)
    app.add_middleware(
        InferFastPath,
        repository=repository,
        metrics=app.state.metrics,
        run_inference=run_inference,
        status_of=status_of,
    )
    return app
