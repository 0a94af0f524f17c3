"""The OpenAPI document: it loads and validates (schemathesis), every operation declares the
error statuses it can answer, and generated requests never get a server error and get answers
that conform to the document.

The app runs in-process over ASGI with its own data dir, no worker, and a runtime server url
on a closed port (a deployment of an unowned artifact is refused before it is contacted).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from api.app import create_app
from tests.api.conftest import KEYS, free_port, kiln_settings

HEADERS = {"X-API-Key": KEYS["a"]}
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


def build_asgi_app():
    """The app over a data dir of its own, removed when the session ends. (It is built at
    import: schemathesis parametrizes from a loaded schema, and its `from_fixture` does not
    work with pytest 9.)"""
    data_dir = Path(tempfile.mkdtemp(prefix="kiln-asgi-"))
    atexit.register(shutil.rmtree, data_dir, ignore_errors=True)
    closed_port = free_port()  # bound, then released: nothing listens there
    return create_app(kiln_settings(data_dir, f"http://127.0.0.1:{closed_port}"))


schema = schemathesis.openapi.from_asgi("/openapi.json", build_asgi_app())


@pytest.fixture
def api_schema():
    return schema


@schema.parametrize()
@settings(
    max_examples=50,
    derandomize=True,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_generated_requests_get_no_server_error(case):
    case.call_and_validate(headers=HEADERS, checks=CHECKS)


# --- completeness of the document -----------------------------------------------------------

# What each operation must declare, beyond its success answer.
EXPECTED_ERRORS = {
    ("post", "/v1/models"): {400, 401, 413, 415, 422},
    ("get", "/v1/models"): {401},
    ("get", "/v1/models/{model_id}"): {401, 404, 422},
    ("post", "/v1/compilations"): {400, 401, 404, 422, 503},
    ("get", "/v1/compilations"): {401},
    ("get", "/v1/compilations/{job_id}"): {401, 404, 422},
    ("delete", "/v1/compilations/{job_id}"): {401, 404, 409, 422},
    ("get", "/v1/compilations/{job_id}/events"): {401, 404, 422},
    ("get", "/v1/artifacts/{digest}"): {401, 404, 422},
    ("get", "/v1/artifacts/{digest}/manifest"): {401, 404, 422},
    ("post", "/v1/deployments"): {400, 401, 404, 409, 422, 502, 503},
    ("get", "/v1/deployments"): {401},
    ("get", "/v1/deployments/{name}"): {401, 404, 422},
    ("delete", "/v1/deployments/{name}"): {401, 404, 422, 502, 503},
    # the console's routes (api/console.py)
    ("get", "/v1/artifacts/{digest}/kernels"): {401, 404, 422, 503},
    ("get", "/v1/deployments/{name}/stats"): {401, 404, 422, 502, 503},
    ("post", "/v1/deployments/{name}/infer"): {400, 401, 404, 422, 502, 503},
    ("get", "/v1/tuning"): {401, 503},
}


def operations(document: dict):
    for path, item in document["paths"].items():
        for method, operation in item.items():
            if method in ("get", "post", "put", "patch", "delete"):
                yield method, path, operation


def test_the_document_loads_and_lists_every_route(api_schema):
    document = api_schema.raw_schema
    assert document["openapi"].startswith("3.")
    found = {(m, p) for m, p, _ in operations(document) if p.startswith("/v1/")}
    assert found == set(EXPECTED_ERRORS)
    assert {"/health/live", "/health/ready", "/metrics"} <= set(document["paths"])
    # schemathesis resolved every operation without an error.
    for result in api_schema.get_all_operations():
        assert result.ok(), result


def test_every_operation_declares_its_error_responses(api_schema):
    document = api_schema.raw_schema
    for method, path, operation in operations(document):
        declared = {int(code) for code in operation["responses"] if code.isdigit()}
        assert any(200 <= code < 300 for code in declared), (method, path)
        missing = EXPECTED_ERRORS.get((method, path), set()) - declared
        assert not missing, f"{method.upper()} {path} does not declare {sorted(missing)}"
        for code in declared - {200, 201, 202}:
            content = operation["responses"][str(code)].get("content", {})
            assert "application/problem+json" in content, (method, path, code)


def test_every_v1_operation_requires_an_api_key(api_schema):
    document = api_schema.raw_schema
    schemes = document["components"]["securitySchemes"]
    assert {"type": "apiKey", "in": "header", "name": "X-API-Key"} in schemes.values()
    assert any(s.get("scheme", "").lower() == "bearer" for s in schemes.values())
    for method, path, operation in operations(document):
        if path.startswith("/v1/"):
            assert operation.get("security"), (method, path)
