"""Errors as `application/problem+json` (RFC 9457): one model, one exception, three handlers."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

PROBLEM_TYPE = "application/problem+json"


class Problem(BaseModel):
    type: str = "about:blank"
    title: str
    status: int
    detail: str
    errors: list[dict] | None = None


class ApiError(Exception):
    def __init__(self, status: int, title: str, detail: str, headers: dict | None = None):
        super().__init__(detail)
        self.status, self.title, self.detail, self.headers = status, title, detail, headers


def not_found(what: str, ident: str) -> ApiError:
    # Another tenant's resource answers exactly like a missing one: ids never leak.
    return ApiError(404, "Not Found", f"no {what} {ident!r}")


def problem_response(
    status: int, title: str, detail: str, headers: dict | None = None, errors=None
) -> JSONResponse:
    body = Problem(title=title, status=status, detail=detail, errors=errors)
    return JSONResponse(
        body.model_dump(exclude_none=True),
        status_code=status,
        media_type=PROBLEM_TYPE,
        headers=headers,
    )


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, err: ApiError):
        return problem_response(err.status, err.title, err.detail, err.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, err: RequestValidationError):
        errors = [
            {"loc": list(e.get("loc", ())), "msg": str(e.get("msg", ""))} for e in err.errors()
        ]
        detail = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors)
        return problem_response(422, "Unprocessable Content", detail, errors=errors)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, err: StarletteHTTPException):
        return problem_response(err.status_code, str(err.detail), str(err.detail), err.headers)


def responses(*statuses: int) -> dict:
    """OpenAPI declarations of a route's problem responses."""
    titles = {
        400: "Bad request",
        401: "Missing or invalid API key",
        404: "Not found (or another tenant's)",
        409: "Conflict",
        413: "Upload too large",
        415: "Unsupported media type",
        422: "Invalid input",
        502: "The runtime server refused",
        503: "A backing service is unavailable",
    }
    # The schema goes under problem+json itself: with `model=Problem`, FastAPI would document
    # it as application/json, a media type these answers never have.
    content = {PROBLEM_TYPE: {"schema": Problem.model_json_schema()}}
    return {status: {"description": titles[status], "content": content} for status in statuses}
