"""The inference route as plain ASGI, in front of FastAPI.

Measured on mlp (0.33 ms per run): FastAPI's route matching and dependency solving cost
~0.6 ms per request, twice the model. This path matches `/v2/models/{m}[/versions/{v}]/infer`
with one regular expression and calls the very same `run_inference` (decode, checks, run,
encode) and error mapping as the FastAPI route, which stays declared for the OpenAPI document
and for any request this path does not take.
"""

from __future__ import annotations

import json
import re
import time

from starlette.concurrency import run_in_threadpool

from runtime_server.metrics import outcome_of
from runtime_server.protocol import HEADER_LENGTH, ProtocolError
from runtime_server.repository import RepositoryError

INFER_PATH = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]+))?/infer$")
TEMPLATES = ("/v2/models/{model}/infer", "/v2/models/{model}/versions/{version}/infer")


# A request whose model runs faster than this, arriving when no other inference is in flight,
# runs on the event loop: the hop to a worker thread and back costs ~0.4 ms on a busy 2-core
# machine, more than such a model. Under concurrency the thread pool keeps runs parallel.
INLINE_SECONDS = 0.001


class InferFastPath:
    def __init__(self, app, repository, metrics, run_inference, status_of):
        self.app = app
        self.repository, self.metrics = repository, metrics
        self.run_inference, self.status_of = run_inference, status_of
        self.header = HEADER_LENGTH.lower().encode()
        self.in_flight = 0
        self.recent: dict[tuple[str, str | None], float] = {}  # typical seconds per request

    async def __call__(self, scope, receive, send):
        match = None
        if scope["type"] == "http" and scope["method"] == "POST":
            match = INFER_PATH.match(scope["path"])
        if match is None:
            await self.app(scope, receive, send)
            return
        model, version = match.group(1), match.group(2)
        body = await _read_body(receive)
        header_length = next(
            (value.decode("latin-1") for key, value in scope["headers"] if key == self.header),
            None,
        )
        args = (self.repository, self.metrics, model, version or None, body, header_length)
        key = (model, version)
        inline = self.in_flight == 0 and self.recent.get(key, 1.0) < INLINE_SECONDS
        self.in_flight += 1
        started = time.perf_counter()
        try:
            if inline:
                content, headers, media_type = self.run_inference(*args)
            else:
                content, headers, media_type = await run_in_threadpool(self.run_inference, *args)
            status = 200
            elapsed = time.perf_counter() - started
            self.recent[key] = 0.8 * self.recent.get(key, elapsed) + 0.2 * elapsed
        except (RepositoryError, ProtocolError) as err:
            status = self.status_of(err)
            content, headers = json.dumps({"error": str(err)}).encode(), {}
            media_type = "application/json"
        finally:
            self.in_flight -= 1
        await _respond(send, status, content, media_type, headers)
        template = TEMPLATES[version is not None]
        self.metrics.requests.labels(template, "POST", outcome_of(status)).inc()


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


async def _respond(send, status: int, content: bytes, media_type: str, headers: dict) -> None:
    raw = [
        (b"content-type", media_type.encode()),
        (b"content-length", str(len(content)).encode()),
        *((k.lower().encode(), str(v).encode()) for k, v in headers.items()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": content})
