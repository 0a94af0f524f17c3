"""A small typed client for the Kiln api and runtime server (httpx and numpy only).

    client = Client("http://127.0.0.1:8000", api_key)
    model = client.upload("mlp.onnx")
    job = client.compile(model, "llvm", shapes={"x": [1, 784]}, tuning={"trials": 60})
    for event in client.events(job):        # Server-Sent Events, resumed after a drop
        print(event.type, event.data)
    job = client.wait(job)
    client.download(job, "mlp.kiln")
    client.deploy(job, "mlp")
    outputs = client.infer("mlp", {"x": x})  # numpy in, numpy out (binary tensor extension)

Every error the api answers (application/problem+json) raises `KilnApiError`; a server that
cannot be reached raises `KilnConnectionError`. This module must stay importable with the base
install: no FastAPI, Celery or compiler imports here.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np

# The wire format is the runtime server's: one table of datatypes (numpy only, no server code).
from runtime_server.protocol import BINARY_TYPE, DATATYPES, HEADER_LENGTH, datatype_of

TERMINAL_EVENTS = frozenset({"done", "failed", "cancelled"})
# The api sends a keep-alive comment every 15 s on an idle stream: a read that waits much
# longer than that means the connection is gone.
STREAM_READ_TIMEOUT = 60.0
RESUME_ATTEMPTS = 5


class KilnError(Exception):
    """Anything the client raises on purpose."""


class KilnApiError(KilnError):
    """An error answer of the api or runtime server, with its problem+json fields."""

    def __init__(self, status: int, title: str, detail: str, type: str = "about:blank"):  # noqa: A002
        super().__init__(f"{status} {title}: {detail}")
        self.status, self.title, self.detail, self.type = status, title, detail, type


class KilnConnectionError(KilnError):
    """The server could not be reached (refused, unknown host, dropped for good)."""


@dataclass(frozen=True)
class Event:
    """One Server-Sent Event of a compilation: `type` is queued, stage, tuning, measured,
    requeued, done, failed or cancelled; `data` is its JSON payload."""

    id: str | None
    type: str
    data: dict = field(default_factory=dict)

    @property
    def terminal(self) -> bool:
        return self.type in TERMINAL_EVENTS


def _ident(value: str | Mapping[str, Any], key: str = "id") -> str:
    """Accept either an id or the record the api returned for it."""
    return value if isinstance(value, str) else str(value[key])


def _artifact_digest(value: str | Mapping[str, Any]) -> str:
    if isinstance(value, str):
        return value
    digest = value.get("artifact")
    if not digest:
        status = value.get("status")
        raise KilnError(f"compilation {value.get('id')!r} has no artifact (status {status!r})")
    return digest


def raise_for_problem(response: httpx.Response) -> None:
    """A 4xx/5xx answer as `KilnApiError`: problem+json from the api, `{"error": ...}` from
    the runtime server, or whatever text a proxy sent."""
    if response.is_success:
        return
    title, detail, kind = response.reason_phrase or "Error", "", "about:blank"
    try:
        body = response.json()
    except (ValueError, UnicodeDecodeError):
        body = None
    if isinstance(body, dict):
        title = str(body.get("title") or title)
        detail = str(body.get("detail") or body.get("error") or "")
        kind = str(body.get("type") or kind)
    if not detail:
        detail = response.text.strip()[:500] or title
    raise KilnApiError(response.status_code, title, detail, kind)


class Client:
    """The api at `url` with an API key; `runtime_url` is the runtime server's base URL for
    `infer` (derived from a deployment's `infer_url` when not given)."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        runtime_url: str | None = None,
        timeout: float = 120.0,
        transport: httpx.BaseTransport | None = None,
    ):
        self.url = url.rstrip("/")
        self.runtime_url = runtime_url.rstrip("/") if runtime_url else None
        headers = {"X-API-Key": api_key} if api_key else {}
        self._http = httpx.Client(
            base_url=self.url, headers=headers, timeout=timeout, transport=transport
        )
        # The runtime server needs no key, and is another origin: a client of its own.
        self._runtime = httpx.Client(timeout=timeout, transport=transport)

    def close(self) -> None:
        self._http.close()
        self._runtime.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- plumbing ---------------------------------------------------------------------------

    def _request(self, method: str, path: str, **kwargs) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as err:
            raise KilnConnectionError(f"cannot reach the Kiln api at {self.url}: {err}") from err
        raise_for_problem(response)
        return response

    def _json(self, method: str, path: str, **kwargs) -> dict:
        return self._request(method, path, **kwargs).json()

    def compilation_url(self, compilation: str | Mapping[str, Any]) -> str:
        return f"{self.url}/v1/compilations/{_ident(compilation)}"

    # --- models -----------------------------------------------------------------------------

    def upload(self, model: str | Path | bytes, name: str | None = None) -> dict:
        """Upload an ONNX model (a path or its bytes); the same bytes give the same id."""
        if isinstance(model, bytes | bytearray):
            data = bytes(model)
        else:
            path = Path(model)
            data = path.read_bytes()
            name = name or path.stem
        headers = {"Content-Type": "application/octet-stream"}
        if name:
            headers["X-Model-Name"] = name
        return self._json("POST", "/v1/models", content=data, headers=headers)

    def model(self, model: str | Mapping[str, Any]) -> dict:
        return self._json("GET", f"/v1/models/{_ident(model)}")

    def models(self) -> list[dict]:
        return self._json("GET", "/v1/models")["models"]

    # --- compilations -----------------------------------------------------------------------

    def compile(
        self,
        model: str | Mapping[str, Any],
        target: str = "llvm",
        shapes: Mapping[str, list[int]] | None = None,
        tuning: Mapping[str, float] | None = None,
    ) -> dict:
        """Queue a compile job; `tuning` is {"trials": N} and/or {"time_budget": seconds}."""
        body: dict[str, Any] = {"model": _ident(model), "target": target}
        if shapes:
            body["shapes"] = {name: list(dims) for name, dims in shapes.items()}
        if tuning:
            body["tuning"] = dict(tuning)
        return self._json("POST", "/v1/compilations", json=body)

    def compilation(self, compilation: str | Mapping[str, Any]) -> dict:
        return self._json("GET", f"/v1/compilations/{_ident(compilation)}")

    def compilations(self) -> list[dict]:
        return self._json("GET", "/v1/compilations")["compilations"]

    def cancel(self, compilation: str | Mapping[str, Any]) -> dict:
        return self._json("DELETE", f"/v1/compilations/{_ident(compilation)}")

    def events(
        self, compilation: str | Mapping[str, Any], last_event_id: str | None = None
    ) -> Iterator[Event]:
        """The job's events until its final one (done, failed or cancelled). A connection
        that drops is opened again with `Last-Event-ID`, so no event is lost or repeated;
        pass `last_event_id` to start after an event seen earlier."""
        path = f"/v1/compilations/{_ident(compilation)}/events"
        failures, seen = 0, False
        while True:
            try:
                with contextlib.closing(self._stream(path, last_event_id)) as stream:
                    for event in stream:
                        # Progress: the next drop gets the full set of retries.
                        failures, seen = 0, True
                        last_event_id = event.id or last_event_id
                        yield event
                        if event.terminal:
                            return
            except httpx.TransportError as err:
                failures += 1
                # A refused first connection is a wrong URL or a server that is down, not
                # a drop: say so at once rather than after the retries.
                refused = isinstance(err, httpx.ConnectError) and not seen
                if refused or failures > RESUME_ATTEMPTS:
                    raise KilnConnectionError(
                        f"the event stream at {self.url}{path} failed ({failures} tries): {err}"
                    ) from err
                time.sleep(min(0.2 * 2**failures, 5.0))
            # A stream that ended without a final event (a proxy's idle cut): reopen it.

    def _stream(self, path: str, last_event_id: str | None) -> Iterator[Event]:
        headers = {"Accept": "text/event-stream"}
        if last_event_id:
            headers["Last-Event-ID"] = last_event_id
        timeout = httpx.Timeout(self._http.timeout.connect, read=STREAM_READ_TIMEOUT)
        with self._http.stream("GET", path, headers=headers, timeout=timeout) as response:
            if not response.is_success:
                response.read()
                raise_for_problem(response)
            yield from parse_sse(response.iter_lines())

    def wait(self, compilation: str | Mapping[str, Any], timeout: float | None = None) -> dict:
        """Follow the job to its end; returns its final record (whatever its status)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for _ in self.events(compilation):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"compilation {_ident(compilation)} did not end in {timeout} s")
        return self.compilation(compilation)

    # --- artifacts and deployments ----------------------------------------------------------

    def download(self, artifact: str | Mapping[str, Any], path: str | Path) -> Path:
        """Save an artifact's module archive (a zip) at `path`; `artifact` is its digest or
        a finished compilation."""
        digest = _artifact_digest(artifact)
        path = Path(path)
        try:
            with self._http.stream("GET", f"/v1/artifacts/{digest}") as response:
                if not response.is_success:
                    response.read()
                    raise_for_problem(response)
                partial = path.with_name(path.name + ".part")
                with partial.open("wb") as out:
                    for chunk in response.iter_bytes(1 << 20):
                        out.write(chunk)
                partial.replace(path)  # never leave a truncated archive under the real name
        except httpx.TransportError as err:
            raise KilnConnectionError(f"cannot download {digest} from {self.url}: {err}") from err
        return path

    def manifest(self, artifact: str | Mapping[str, Any]) -> dict:
        return self._json("GET", f"/v1/artifacts/{_artifact_digest(artifact)}/manifest")

    def deploy(self, artifact: str | Mapping[str, Any], name: str, version: str = "1") -> dict:
        """Have the runtime server load an artifact as `name`/`version`."""
        body = {"artifact": _artifact_digest(artifact), "name": name, "version": str(version)}
        deployment = self._json("POST", "/v1/deployments", json=body)
        self._remember_runtime(deployment)
        return deployment

    def deployment(self, name: str) -> dict:
        return self._json("GET", f"/v1/deployments/{name}")

    def deployments(self) -> list[dict]:
        return self._json("GET", "/v1/deployments")["deployments"]

    def undeploy(self, name: str) -> dict:
        return self._json("DELETE", f"/v1/deployments/{name}")

    def _remember_runtime(self, deployment: Mapping[str, Any]) -> None:
        if self.runtime_url is None and deployment.get("infer_url"):
            parts = urlsplit(deployment["infer_url"])
            self.runtime_url = f"{parts.scheme}://{parts.netloc}"

    # --- inference --------------------------------------------------------------------------

    def infer(
        self, name: str, inputs: Mapping[str, np.ndarray], version: str | None = None
    ) -> dict[str, np.ndarray]:
        """Run a deployed model on the runtime server (binary tensor extension)."""
        if self.runtime_url is None:
            self._remember_runtime(self.deployment(name))
        if self.runtime_url is None:
            raise KilnError(f"no runtime URL for {name!r}: pass runtime_url to Client")
        path = f"/v2/models/{name}" + (f"/versions/{version}" if version else "") + "/infer"
        body, headers = encode_infer_request(inputs)
        try:
            response = self._runtime.post(self.runtime_url + path, content=body, headers=headers)
        except httpx.TransportError as err:
            raise KilnConnectionError(
                f"cannot reach the runtime server at {self.runtime_url}: {err}"
            ) from err
        raise_for_problem(response)
        return decode_infer_response(response.content, response.headers.get(HEADER_LENGTH))


# --- Server-Sent Events -----------------------------------------------------------------------


def parse_sse(lines: Iterator[str]) -> Iterator[Event]:
    """Events from the lines of a text/event-stream. An event counts only once its closing
    blank line arrived: one cut short by a dropped connection is read again on resume."""
    event_id, kind, data = None, "message", []
    for line in lines:
        if not line:
            if data:
                yield _make_event(event_id, kind, "\n".join(data))
            event_id, kind, data = None, "message", []
            continue
        if line.startswith(":"):
            continue  # a comment: the api's keep-alive
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "id":
            event_id = value
        elif name == "event":
            kind = value
        elif name == "data":
            data.append(value)


def _make_event(event_id: str | None, kind: str, text: str) -> Event:
    try:
        data = json.loads(text)
    except ValueError:
        data = {"text": text}
    if not isinstance(data, dict):
        data = {"value": data}
    return Event(event_id, data.get("type", kind) if kind == "message" else kind, data)


# --- binary tensor extension ------------------------------------------------------------------


def _datatype(dtype: np.dtype) -> str:
    try:
        return datatype_of(dtype)
    except ValueError as err:
        raise KilnError(str(err)) from None


def encode_infer_request(inputs: Mapping[str, np.ndarray]) -> tuple[bytes, dict[str, str]]:
    """(body, headers): a JSON header naming each input, then its raw little-endian bytes;
    every output is asked for in binary."""
    tensors, chunks = [], []
    for name, value in inputs.items():
        array = np.asarray(value)
        raw = np.ascontiguousarray(array, array.dtype.newbyteorder("<")).tobytes()
        tensors.append(
            {
                "name": name,
                "datatype": _datatype(array.dtype),
                "shape": list(array.shape),
                "parameters": {"binary_data_size": len(raw)},
            }
        )
        chunks.append(raw)
    header = json.dumps(
        {"inputs": tensors, "parameters": {"binary_data_output": True}}, separators=(",", ":")
    ).encode()
    headers = {"Content-Type": BINARY_TYPE, HEADER_LENGTH: str(len(header))}
    return header + b"".join(chunks), headers


def decode_infer_response(body: bytes, header_length: str | None) -> dict[str, np.ndarray]:
    """The outputs of an inference response, binary or JSON, as numpy arrays."""
    length = int(header_length) if header_length else len(body)
    header = json.loads(body[:length])
    binary, offset = body[length:], 0
    outputs = {}
    for tensor in header.get("outputs", []):
        dtype = DATATYPES[tensor["datatype"]]
        shape = tuple(tensor["shape"])
        size = (tensor.get("parameters") or {}).get("binary_data_size")
        if size is None:
            outputs[tensor["name"]] = np.asarray(tensor["data"], dtype).reshape(shape)
            continue
        raw = binary[offset : offset + size]
        offset += size
        # A copy: the slice of the body may start at any byte, and callers may write to it.
        array = np.frombuffer(raw, dtype.newbyteorder("<")).astype(dtype).reshape(shape)
        outputs[tensor["name"]] = array
    return outputs
