"""The platform end to end on embedded defaults (`make demo`): start `kiln serve` on loopback,
upload a model over HTTP, compile it (following the job's events as they arrive), deploy it,
send an inference with tritonclient, compare with ONNX Runtime, print the latencies, stop.

    .venv/bin/python -m bench.demo [--models resnet18 mlp] [--data-dir build/demo]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import tritonclient.http as triton

MODELS_DIR = Path(__file__).resolve().parents[2] / "shared" / "models"
INPUT_SHAPES = {"resnet18": [1, 3, 224, 224], "mlp": [1, 784], "mobilenet_v2": [1, 3, 224, 224]}
TIMED_REQUESTS = 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def kiln_serve(data_dir: Path, key: str):
    api_port, runtime_port = free_port(), free_port()
    env = dict(os.environ, KILN_API_KEYS=f"demo:{key}")
    env.pop("KILN_REDIS_URL", None)
    log = data_dir / "serve.log"
    kiln = str(Path(sys.executable).parent / "kiln")
    command = [kiln, "serve", "--api-port", str(api_port), "--runtime-port", str(runtime_port)]
    process = subprocess.Popen(
        [*command, "--data-dir", str(data_dir)],
        env=env,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    api, runtime = f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{runtime_port}"
    print(f"kiln serve (embedded; log {log}): api {api}, runtime {runtime}")
    try:
        for url in (api + "/health/ready", runtime + "/v2/health/ready"):
            wait_for(url, process, log)
        yield api, runtime
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        process.wait(30)
        print(f"kiln serve stopped (exit {process.returncode})")


def wait_for(url: str, process: subprocess.Popen, log: Path, seconds: float = 90) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(
                f"kiln serve exited ({process.returncode}):\n{log.read_text()[-2000:]}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=5).is_success:
                return
        time.sleep(0.3)
    raise SystemExit(f"{url} did not come up in {seconds} s:\n{log.read_text()[-2000:]}")


def follow(client: httpx.Client, job_id: str) -> dict:
    """Print the job's Server-Sent Events as they arrive; return the final job record."""
    with client.stream("GET", f"/v1/compilations/{job_id}/events", timeout=None) as response:
        response.raise_for_status()
        event = {}
        for line in response.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                detail = {k: v for k, v in event.items() if k not in ("type", "time")}
                print(f"    [{event['type']}] {detail or ''}")
    return client.get(f"/v1/compilations/{job_id}").json()


def demo_model(client: httpx.Client, runtime: str, name: str) -> dict:
    path = MODELS_DIR / f"{name}.onnx"
    shape = INPUT_SHAPES[name]
    started = time.perf_counter()
    response = client.post("/v1/models", content=path.read_bytes(), headers={"X-Model-Name": name})
    response.raise_for_status()
    model = response.json()
    input_name = model["inputs"][0]["name"]
    print(
        f"\n== {name}: uploaded {model['size'] / 2**20:.1f} MiB in "
        f"{time.perf_counter() - started:.2f} s -> {model['id']} ({model['nodes']} nodes)"
    )
    response = client.post(
        "/v1/compilations",
        json={"model": model["id"], "target": "llvm", "shapes": {input_name: shape}},
    )
    response.raise_for_status()
    print(f"  compiling ({response.headers['Location']}):")
    job = follow(client, response.json()["id"])
    if job["status"] != "done":
        raise SystemExit(f"compilation {job['status']}: {job.get('error')}")
    artifact = job["artifact"]
    print(f"  artifact {artifact[:23]}..., verified: {job['verification']['passed']}")
    deployment = client.post("/v1/deployments", json={"artifact": artifact, "name": name})
    deployment.raise_for_status()
    print(f"  deployed at {deployment.json()['infer_url']}")
    return infer_and_compare(runtime, name, path, input_name, shape) | {
        "compile_s": time.time() - job["created"],
        "in_process_ms": job["best_latency_ms"],
    }


def infer_and_compare(runtime: str, name: str, path: Path, input_name: str, shape) -> dict:
    client = triton.InferenceServerClient(runtime.removeprefix("http://"))
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    request = triton.InferInput(input_name, shape, "FP32")
    request.set_data_from_numpy(x, binary_data=True)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    expected = session.run(None, {input_name: x})
    result = client.infer(name, [request])
    worst = 0.0
    for output, reference in zip(session.get_outputs(), expected, strict=True):
        got = result.as_numpy(output.name)
        worst = max(worst, float(np.abs(got - reference).max() / np.abs(reference).max()))
    http_ms, ort_ms = [], []
    for _ in range(TIMED_REQUESTS):
        started = time.perf_counter()
        client.infer(name, [request])
        http_ms.append((time.perf_counter() - started) * 1000)
    time.sleep(0.3)  # let ORT's spinning threads and ours settle apart
    for _ in range(TIMED_REQUESTS):
        started = time.perf_counter()
        session.run(None, {input_name: x})
        ort_ms.append((time.perf_counter() - started) * 1000)
    top = np.argsort(result.as_numpy(session.get_outputs()[0].name).reshape(-1))[::-1][:3]
    print(f"  inference via tritonclient: top classes {top.tolist()}, "
          f"max error vs ONNX Runtime {worst:.2e} of the output's scale "
          f"({'ok' if worst <= 1e-4 else 'MISMATCH'})")  # fmt: skip
    return {"ok": worst <= 1e-4, "http_ms": np.median(http_ms), "ort_ms": np.median(ort_ms)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["resnet18", "mlp"], choices=INPUT_SHAPES)
    parser.add_argument("--data-dir", default="build/demo")
    args = parser.parse_args()
    data_dir = Path(args.data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(16)
    results = {}
    with kiln_serve(data_dir, key) as (api, runtime):
        client = httpx.Client(base_url=api, headers={"X-API-Key": key}, timeout=600)
        for name in args.models:
            results[name] = demo_model(client, runtime, name)
    print(f"\n{'model':14s} {'match':>6s} {'compile s':>10s} {'module ms':>10s} "
          f"{'HTTP ms':>9s} {'ORT ms':>8s}")  # fmt: skip
    for name, r in results.items():
        module_ms = "-" if r["in_process_ms"] is None else f"{r['in_process_ms']:.3f}"
        print(f"{name:14s} {'yes' if r['ok'] else 'NO':>6s} {r['compile_s']:10.1f} "
              f"{module_ms:>10s} {r['http_ms']:9.3f} {r['ort_ms']:8.3f}")  # fmt: skip
    print("(module ms: the compiled module in-process, measured by the worker; HTTP ms: "
          "tritonclient round trip to the runtime server; ORT ms: ONNX Runtime in-process, "
          "default threads; medians)")  # fmt: skip
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
