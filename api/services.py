"""The api's service functions: the routers are thin shells over these.

The api holds the artifact store, the ledger and a Celery app it sends tasks to by name; it
never imports the compiler.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import httpx
from starlette.concurrency import run_in_threadpool

from api.errors import ApiError, not_found
from api.onnx_summary import InvalidModelError, describe, read_model
from artifact_store import BlobNotFound, CorruptBlob, TooLarge
from tuner_workers.celery_app import COMPILE_TASK, make_app, queue_for_target
from tuner_workers.ledger import TERMINAL, open_ledger
from tuner_workers.service import compiler_version, job_key
from tuner_workers.settings import KilnSettings

UPLOAD_CHUNK = 1 << 20


class Platform:
    def __init__(self, settings: KilnSettings):
        self.settings = settings
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        self.store = settings.store()
        self.ledger = open_ledger(settings)
        self.celery = make_app(settings)
        self.version = compiler_version()

    # --- models ---------------------------------------------------------------------------

    async def upload_model(self, tenant: str, chunks: AsyncIterator[bytes], name: str | None):
        """Stream an upload into the store (incremental sha256, size limit), validate it, and
        only then publish it: a refused upload leaves nothing behind."""
        limit = self.settings.max_upload_bytes
        with self.store.stage(max_bytes=limit) as staged:
            try:
                async for chunk in chunks:
                    staged.write(chunk)
            except TooLarge:
                raise ApiError(
                    413, "Content Too Large", f"the model is larger than the limit of {limit} bytes"
                ) from None
            try:
                summary = describe(await run_in_threadpool(read_model, staged.path))
            except InvalidModelError as err:
                raise ApiError(422, "Invalid ONNX model", str(err)) from None
            digest = staged.commit()
        size = self.store.blob_size(digest)
        self.store.put_manifest("models", digest, {"model": digest, "size": size})
        record = {
            "id": "m-" + digest.split(":")[1][:20],
            "digest": digest,
            "name": name,
            "size": size,
            **summary,
            "created": time.time(),
        }
        return self.ledger.add_model(tenant, record)

    def model(self, tenant: str, model_id: str) -> dict:
        record = self.ledger.get_model(tenant, model_id)
        if record is None:
            raise not_found("model", model_id)
        return record

    # --- compilations -----------------------------------------------------------------------

    def create_compilation(self, tenant: str, request) -> dict:
        model = self.model(tenant, request.model)
        self._check_shapes(model, request.shapes)
        options = {
            "shapes": request.shapes,
            "tuning": request.tuning.model_dump(exclude_none=True) if request.tuning else None,
        }
        try:
            queue = queue_for_target(request.target, tuned=bool(options["tuning"]))
        except ValueError as err:
            raise ApiError(422, "Invalid target", str(err)) from None
        now = time.time()
        job = {
            "id": "c-" + uuid.uuid4().hex[:20],
            "tenant": tenant,
            "model": model["id"],
            "model_digest": model["digest"],
            "target": request.target,
            **options,
            "key": job_key(model["digest"], request.target, options, self.version),
            "compiler_version": self.version,
            "queue": queue,
            "status": "queued",
            "stage": "queued",
            "progress": {"tasks_done": 0, "tasks_total": 0},
            "attempts": 0,
            "created": now,
            "updated": now,
        }
        self.ledger.create_job(job)
        self.ledger.append_event(job["id"], {"type": "queued", "queue": queue})
        try:
            self.celery.send_task(COMPILE_TASK, args=[job["id"]], queue=queue)
        except Exception as err:  # the broker is down: say so, and leave no phantom job
            self.ledger.update_job(job["id"], status="failed", error=f"broker unavailable: {err}")
            raise ApiError(503, "Service Unavailable", "the job broker is unavailable") from None
        return job

    @staticmethod
    def _check_shapes(model: dict, shapes: dict | None) -> None:
        names = {spec["name"] for spec in model["inputs"]}
        for name, dims in (shapes or {}).items():
            if name not in names:
                raise ApiError(
                    422,
                    "Invalid shapes",
                    f"the model has no input {name!r} (it has {sorted(names)})",
                )
            if any(d <= 0 for d in dims):
                raise ApiError(422, "Invalid shapes", f"input {name!r}: dimensions must be > 0")

    def compilation(self, tenant: str, job_id: str) -> dict:
        job = self.ledger.get_job(job_id)
        if job is None or job["tenant"] != tenant:
            raise not_found("compilation", job_id)
        return job

    def cancel_compilation(self, tenant: str, job_id: str) -> dict:
        job = self.compilation(tenant, job_id)
        if job["status"] in TERMINAL:
            raise ApiError(
                409, "Conflict", f"compilation {job_id} has already ended: {job['status']}"
            )
        cancelled = self.ledger.update_job(job_id, status="cancelled", stage="cancelled")
        if cancelled is None:  # it ended between the read and the write
            return self.compilation(tenant, job_id)
        self.ledger.append_event(job_id, {"type": "cancelled"})
        return cancelled

    # --- artifacts and deployments ----------------------------------------------------------

    def artifact(self, tenant: str, digest: str) -> bytes:
        if not self.ledger.owns_artifact(tenant, digest):
            raise not_found("artifact", digest)
        try:
            return self.store.get_blob(digest)
        except BlobNotFound:
            raise not_found("artifact", digest) from None
        except CorruptBlob as err:
            raise ApiError(
                503, "Service Unavailable", f"the stored artifact is damaged: {err}"
            ) from None

    def artifact_manifest(self, tenant: str, digest: str) -> dict:
        if not self.ledger.owns_artifact(tenant, digest):
            raise not_found("artifact", digest)
        return self.store.get_manifest("artifacts", digest)

    async def deploy(self, tenant: str, request) -> dict:
        if not self.ledger.owns_artifact(tenant, request.artifact):
            raise not_found("artifact", request.artifact)
        existing = self.ledger.get_deployment(request.name)
        if existing is not None and existing["tenant"] != tenant:
            raise ApiError(409, "Conflict", f"the name {request.name!r} is taken")
        body = {"parameters": {"artifact": request.artifact, "version": request.version}}
        await self._runtime("POST", f"/v2/repository/models/{request.name}/load", body)
        # Every runtime replica converges on these manifests (runtime_server/sync.py); they
        # also keep the deployed artifact from garbage collection.
        self.store.put_manifest(
            "deployments",
            f"{request.name}/{request.version}",
            {"name": request.name, "version": request.version, "artifact": request.artifact},
        )
        record = {
            "name": request.name,
            "version": request.version,
            "artifact": request.artifact,
            "tenant": tenant,
            "infer_url": (
                f"{self.settings.runtime_url}/v2/models/{request.name}"
                f"/versions/{request.version}/infer"
            ),
            "created": time.time(),
        }
        self.ledger.put_deployment(record)
        return record

    def deployment(self, tenant: str, name: str) -> dict:
        record = self.ledger.get_deployment(name)
        if record is None or record["tenant"] != tenant:
            raise not_found("deployment", name)
        return record

    async def undeploy(self, tenant: str, name: str) -> dict:
        record = self.deployment(tenant, name)
        for key in self.store.list_manifests("deployments"):
            if key.split("/")[0] == name:
                self.store.delete_manifest("deployments", key)
        await self._runtime("POST", f"/v2/repository/models/{name}/unload", {})
        self.ledger.delete_deployment(name, tenant)
        return record

    async def _runtime(self, method: str, path: str, body: dict) -> dict:
        url = self.settings.runtime_url + path
        try:
            async with httpx.AsyncClient(timeout=300) as client:
                response = await client.request(method, url, json=body)
        except httpx.HTTPError as err:
            raise ApiError(
                503, "Service Unavailable", f"the runtime server is unreachable: {err}"
            ) from None
        if response.status_code >= 400:
            try:
                message = response.json().get("error", response.text)
            except ValueError:
                message = response.text
            if response.status_code == 400:  # the artifact cannot be served there (a GPU
                # archive on a server without a GPU): the caller's to fix, not a bad gateway
                raise ApiError(
                    422, "Unprocessable Entity", f"the runtime server refused: {message}"
                )
            raise ApiError(502, "Bad Gateway", f"the runtime server refused: {message}")
        return response.json() if response.content else {}
