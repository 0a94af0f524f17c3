"""The api's routes: thin shells over `api.services.Platform`."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated

from fastapi import APIRouter, Header, Path, Request, Response
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from api import schemas
from api.deps import PlatformDep, Tenant
from api.errors import ApiError, responses
from tuner_workers.ledger import TERMINAL

router = APIRouter(prefix="/v1")
ModelId = Annotated[str, Path(max_length=100)]
JobId = Annotated[str, Path(max_length=100)]
Digest = Annotated[str, Path(pattern=schemas.DIGEST_PATTERN)]
DeploymentName = Annotated[str, Path(pattern=schemas.NAME_PATTERN)]
EVENT_POLL_SECONDS = 0.5
KEEPALIVE_SECONDS = 15.0

ONNX_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "properties": {"file": {"type": "string", "format": "binary"}},
                    "required": ["file"],
                }
            },
        },
    }
}


async def _upload_chunks(request: Request):
    """The model's bytes, as they arrive: a raw body is streamed; a multipart form's `file`
    part is read from Starlette's spooled file in chunks."""
    content_type = request.headers.get("content-type", "")
    if content_type.startswith("multipart/form-data"):
        form = await request.form(max_files=1, max_fields=4)
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            raise ApiError(422, "Invalid upload", "the multipart form has no 'file' part")
        while chunk := await upload.read(1 << 20):
            yield chunk
        return
    if content_type and not content_type.startswith(
        ("application/octet-stream", "application/onnx", "application/x-protobuf")
    ):
        raise ApiError(
            415, "Unsupported Media Type", "send the model as application/octet-stream or multipart"
        )
    async for chunk in request.stream():
        yield chunk


@router.post(
    "/models",
    status_code=201,
    response_model=schemas.ModelInfo,
    openapi_extra=ONNX_BODY,
    responses=responses(400, 401, 413, 415, 422),
)
async def upload_model(
    request: Request,
    tenant: Tenant,
    platform: PlatformDep,
    name: Annotated[str | None, Header(alias="X-Model-Name", max_length=200)] = None,
):
    """Upload an ONNX model (raw body or a multipart `file`); the same bytes give the same id."""
    limit = platform.settings.max_upload_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit + (1 << 16):  # + room for multipart framing
        raise ApiError(413, "Content Too Large", f"the model is larger than {limit} bytes")
    return await platform.upload_model(tenant, _upload_chunks(request), name)


@router.get("/models", response_model=schemas.ModelList, responses=responses(401))
def list_models(tenant: Tenant, platform: PlatformDep):
    return {"models": platform.ledger.list_models(tenant)}


@router.get(
    "/models/{model_id}", response_model=schemas.ModelInfo, responses=responses(401, 404, 422)
)
def get_model(model_id: ModelId, tenant: Tenant, platform: PlatformDep):
    return platform.model(tenant, model_id)


@router.post(
    "/compilations",
    status_code=202,
    response_model=schemas.Compilation,
    responses=responses(400, 401, 404, 422, 503),
)
def create_compilation(
    body: schemas.CompilationRequest, response: Response, tenant: Tenant, platform: PlatformDep
):
    """Queue a compile job for a model and target; follow it at the `Location` it returns."""
    job = platform.create_compilation(tenant, body)
    response.headers["Location"] = f"/v1/compilations/{job['id']}"
    return job


@router.get("/compilations", response_model=schemas.CompilationList, responses=responses(401))
def list_compilations(tenant: Tenant, platform: PlatformDep):
    return {"compilations": platform.ledger.list_jobs(tenant)}


@router.get(
    "/compilations/{job_id}",
    response_model=schemas.Compilation,
    responses=responses(401, 404, 422),
)
def get_compilation(job_id: JobId, tenant: Tenant, platform: PlatformDep):
    return platform.compilation(tenant, job_id)


@router.delete(
    "/compilations/{job_id}",
    response_model=schemas.Compilation,
    responses=responses(401, 404, 409, 422),
)
def cancel_compilation(job_id: JobId, tenant: Tenant, platform: PlatformDep):
    """Cancel a job that has not ended (a running job stops at its next stage)."""
    return platform.cancel_compilation(tenant, job_id)


@router.get(
    "/compilations/{job_id}/events",
    responses={
        200: {"description": "Server-Sent Events", "content": {"text/event-stream": {}}},
        **responses(401, 404, 422),
    },
)
async def compilation_events(
    job_id: JobId,
    tenant: Tenant,
    platform: PlatformDep,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID", max_length=64)] = None,
):
    """The job's progress as Server-Sent Events; resumable with `Last-Event-ID`. The stream
    ends after the job's final event."""
    platform.compilation(tenant, job_id)
    return StreamingResponse(
        _event_stream(platform, job_id, last_event_id),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _event_stream(platform, job_id: str, after: str | None):
    """Events after `after`, as they are appended, until the job's final event. A job's
    status turns final a moment before its final event is appended: once the status is final,
    one more read after a poll interval picks that event up."""
    idle, ending = 0.0, False
    while True:
        events = await run_in_threadpool(platform.ledger.read_events, job_id, after)
        for event_id, event in events:
            after = event_id
            yield f"id: {event_id}\nevent: {event['type']}\ndata: {json.dumps(event)}\n\n"
            if event["type"] in TERMINAL:
                return
        if ending:
            return
        idle = 0.0 if events else idle + EVENT_POLL_SECONDS
        job = await run_in_threadpool(platform.ledger.get_job, job_id)
        ending = job is None or job["status"] in TERMINAL
        await asyncio.sleep(EVENT_POLL_SECONDS)
        if idle >= KEEPALIVE_SECONDS:
            idle = 0.0
            yield ": keep-alive\n\n"


@router.get(
    "/artifacts/{digest}",
    responses={
        200: {"description": "the module archive (zip)", "content": {"application/zip": {}}},
        **responses(401, 404, 422, 503),
    },
)
def download_artifact(digest: Digest, tenant: Tenant, platform: PlatformDep):
    data = platform.artifact(tenant, digest)
    name = digest.split(":")[1][:16]
    return Response(
        data,
        media_type="application/zip",
        headers={"Content-Disposition": f'attachment; filename="{name}.kiln"', "ETag": digest},
    )


@router.get("/artifacts/{digest}/manifest", responses=responses(401, 404, 422))
def artifact_manifest(digest: Digest, tenant: Tenant, platform: PlatformDep) -> dict:
    """What the artifact was built from: model, target, options, verification, signature."""
    return platform.artifact_manifest(tenant, digest)


@router.post(
    "/deployments",
    status_code=201,
    response_model=schemas.Deployment,
    responses=responses(400, 401, 404, 409, 422, 502, 503),
)
async def create_deployment(body: schemas.DeploymentRequest, tenant: Tenant, platform: PlatformDep):
    """Make the runtime server load an artifact under a name and version."""
    return await platform.deploy(tenant, body)


@router.get("/deployments", response_model=schemas.DeploymentList, responses=responses(401))
def list_deployments(tenant: Tenant, platform: PlatformDep):
    return {"deployments": platform.ledger.list_deployments(tenant)}


@router.get(
    "/deployments/{name}", response_model=schemas.Deployment, responses=responses(401, 404, 422)
)
def get_deployment(name: DeploymentName, tenant: Tenant, platform: PlatformDep):
    return platform.deployment(tenant, name)


@router.delete(
    "/deployments/{name}",
    response_model=schemas.Deployment,
    responses=responses(401, 404, 422, 502, 503),
)
async def delete_deployment(name: DeploymentName, tenant: Tenant, platform: PlatformDep):
    """Unload a deployment from the runtime server."""
    return await platform.undeploy(tenant, name)
