"""The Kiln api (FastAPI): models, compilations, artifacts, deployments.

python -m api [--host 127.0.0.1] [--port 8000]     (settings from KILN_* variables)
"""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from api import console, errors, schemas
from api.routes import router
from api.services import Platform
from tuner_workers.settings import KilnSettings


def create_app(settings: KilnSettings | None = None) -> FastAPI:
    settings = settings or KilnSettings()
    app = FastAPI(
        title="Kiln",
        version=_version(),
        description="Upload ONNX models, compile them for a target, deploy the compiled modules.",
    )
    app.state.platform = Platform(settings)
    errors.install(app)
    app.include_router(router)
    console.install(app)
    _install_health_and_metrics(app)
    return app


def _version() -> str:
    from tuner_workers.service import compiler_version

    return compiler_version()


def _install_health_and_metrics(app: FastAPI) -> None:
    registry = CollectorRegistry()
    requests = Counter(
        "kiln_api_requests", "api requests", ["method", "route", "status"], registry=registry
    )
    latency = Histogram(
        "kiln_api_request_seconds", "api request latency", ["route"], registry=registry
    )

    @app.middleware("http")
    async def _count(request: Request, call_next):
        started = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        path = getattr(route, "path", "unmatched")
        requests.labels(request.method, path, str(response.status_code)).inc()
        latency.labels(path).observe(time.perf_counter() - started)
        return response

    @app.get("/health/live", response_model=schemas.Health, tags=["health"])
    def live():
        return {"status": "ok", "checks": {}}

    @app.get("/health/ready", response_model=schemas.Health, tags=["health"])
    def ready():
        platform = app.state.platform
        checks = {}
        for name, probe in (
            ("ledger", lambda: platform.ledger.get_job("-")),
            ("store", lambda: platform.store.list_manifests("models")),
        ):
            try:
                probe()
                checks[name] = "ok"
            except Exception as err:  # noqa: BLE001 - reported, not raised
                checks[name] = f"error: {type(err).__name__}"
        status = "ok" if all(v == "ok" for v in checks.values()) else "degraded"
        return {"status": status, "checks": checks}

    @app.get("/metrics", response_class=PlainTextResponse, tags=["health"])
    def metrics():
        return PlainTextResponse(generate_latest(registry).decode())
