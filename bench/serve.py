"""The runtime server under load: a bounded run over loopback, next to the same module run in
process, measured in the same run on the same machine.

    .venv/bin/python -m bench.serve [--models mlp resnet18] [--requests 2000] [--concurrency 8]
        [--sequential 300] [--instances 2] [--threads 1] [--wait-idle 0]
        [--json bench/serve_results.json]

Per model: compile, put the archive in a fresh filesystem store, start `python -m
runtime_server` on it as a subprocess (KILN_RUNTIME_INSTANCES=--instances,
KILN_NUM_THREADS=--threads, access log on as shipped), warm up every connection, then:

1. Concurrency 1: blocks of in-process `module.run`, of HTTP requests from one keep-alive
   `httpx.Client`, and of the same requests from a bare-socket client alternate (a pause
   before each block, its first run dropped), so all three medians see the same machine
   state. **Server overhead = HTTP p50 - in-process p50**, with httpx and with the bare client.
2. Concurrency C: --requests requests from C threads, each with its own keep-alive
   `httpx.Client`: throughput, p50/p90/p99 latency, errors.

Every request carries its input in the binary tensor extension and asks for binary outputs
(`Inference-Header-Content-Length` framing), and every response must be a 200 whose outputs
equal, bit for bit, what the in-process module (same archive, same thread count) returned for
that input; anything else counts as an error.

What the overhead includes: everything between "the client has the request bytes" and "the
client has the response bytes", minus the model's own run: the client's HTTP work (httpx:
building the request, parsing the response; about 1 ms of CPU on a slow core, which is why
the bare-socket client is measured too), loopback TCP both ways, uvicorn's h11 parsing,
FastAPI's middleware, routing and dependencies, the hops from the event loop to worker
threads and back, the JSON header decode, the input copy, borrowing an instance, the response
encode and the access-log line. Request bodies are built before timing, and responses are
decoded and checked after it, so the client's numpy work is not in the figures. Beside it:
the server's own inference timer (its Prometheus histogram: pool.run alone, so HTTP p50 minus
it is the HTTP stack's share), the client thread's CPU time per request and the server
process's CPU time per request (/proc/<pid>/stat).

Fairness on a small machine: client and server share the CPU. The defaults give each of the
two instances one thread (two cores, no oversubscription), and the in-process module
uses the same thread count, so phase 1 compares like with like; at concurrency 1 only one of
client and server runs at a time. In phase 2 the client's threads take CPU from the server
(see client CPU): throughput there is a lower bound on a server with the machine to itself,
and latencies at concurrency C include queueing for a free instance. Other processes (a test
suite, say) would inflate everything: the "others" column says how many cores they kept busy
during each phase, and --wait-idle waits for a quiet machine before each model.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

import compiler_core
from api.client import decode_infer_response, encode_infer_request
from artifact_store import open_store
from bench.run import cpu_name
from compiler_core.runtime import load
from runtime_server.protocol import HEADER_LENGTH

REPO = Path(__file__).resolve().parents[1]
MODELS_DIR = REPO.parent / "shared" / "models"
MODEL_SHAPES = {"mlp": {"x": [1, 784]}, "resnet18": None}
DISTINCT_INPUTS = 16  # requests cycle through these, so a stale or mixed-up output shows
BLOCK = 20  # kept runs of one engine before switching to the next
SETTLE_SECONDS = 0.05  # lets the worker threads of the engine that just ran go back to sleep
WARMUP_PER_CLIENT = 5
READY_TIMEOUT = 120.0
REQUEST_TIMEOUT = 60.0  # resnet18 at concurrency 8 queues for an instance: generous
CLOCK_TICK = os.sysconf("SC_CLK_TCK")
OTHER_LOAD_WARNING = 0.1  # cores: on a 2-core box anything more moves the figures


# --- wire format -------------------------------------------------------------------------------


def response_ok(status, content, header_length, expected: dict[str, np.ndarray]) -> bool:
    if status != 200 or header_length is None:
        return False
    try:
        outputs = decode_infer_response(content, header_length)
    except (KeyError, TypeError, ValueError):
        return False
    return outputs.keys() == expected.keys() and all(
        np.array_equal(outputs[name], value) for name, value in expected.items()
    )


class RawClient:
    """HTTP/1.1 keep-alive over a bare socket, requests prebuilt: next to no client work, so
    its round trip is (nearly) the server's and the loopback's alone. httpx costs about 1 ms
    of CPU per request on a slow core, which would otherwise hide the server's share."""

    def __init__(self, base: str):
        host, port = base.removeprefix("http://").rsplit(":", 1)
        self.host = f"{host}:{port}"
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.pending = b""

    def prepare(self, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        lines = [f"POST {path} HTTP/1.1", f"Host: {self.host}", f"Content-Length: {len(body)}"]
        lines += [f"{key}: {value}" for key, value in headers.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + body

    def post(self, request: bytes) -> tuple[int, dict[str, str], bytes]:
        """(status, headers with lower-case names, body) of one prepared request."""
        self.sock.sendall(request)
        data = self.pending
        while b"\r\n\r\n" not in data:
            data += self._recv()
        head, data = data.split(b"\r\n\r\n", 1)
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in header_lines:
            key, _, value = line.partition(":")
            headers[key.strip().lower()] = value.strip()
        length = int(headers["content-length"])
        while len(data) < length:
            data += self._recv()
        self.pending = data[length:]
        return int(status_line.split()[1]), headers, data[:length]

    def _recv(self) -> bytes:
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        return chunk

    def close(self) -> None:
        self.sock.close()


# --- the server --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(
    data_dir: Path, name: str, digest: str, instances: int, threads: int, batch_delay_ms: float
):
    """(process, base URL, log path) of a runtime server serving one model."""
    port = free_port()
    env = {
        **os.environ,
        "KILN_DATA_DIR": str(data_dir),
        "KILN_RUNTIME_INSTANCES": str(instances),
        "KILN_NUM_THREADS": str(threads),
        "KILN_RUNTIME_BATCH_DELAY_MS": str(batch_delay_ms),
    }
    log = data_dir / "server.log"
    # A log file, not a pipe: uvicorn writes an access-log line per request, and a pipe that
    # nobody reads would fill up and stall the server mid-run.
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "runtime_server", "--host", "127.0.0.1", "--port", str(port)]
            + ["--load", f"{name}={digest}"],
            cwd=REPO,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    return process, f"http://127.0.0.1:{port}", log


def wait_ready(process: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/v2/health/ready", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"server not ready after {READY_TIMEOUT:.0f} s:\n{log.read_text()}")


def stop_server(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)  # uvicorn's graceful shutdown
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def busy_seconds() -> float:
    """CPU time every core of the machine spent busy since boot (idle and iowait excluded)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / CLOCK_TICK


def wait_idle(limit: float) -> None:
    """Wait (at most `limit` seconds) for a second in which other processes use < 0.1 core."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        before = busy_seconds()
        time.sleep(1.0)
        if busy_seconds() - before < OTHER_LOAD_WARNING:
            return


def inference_seconds(client: httpx.Client, base: str) -> tuple[float, int]:
    """(sum, count) of the server's own inference timer (pool.run: a free instance, then the
    module's run), from its Prometheus metrics."""
    total = count = 0.0
    for line in client.get(f"{base}/metrics").text.splitlines():
        if line.startswith("kiln_runtime_inference_seconds_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("kiln_runtime_inference_seconds_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, int(count)


def run_mean_ms(before: tuple[float, int], after: tuple[float, int]) -> float:
    return (after[0] - before[0]) / max(after[1] - before[1], 1) * 1e3


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a whole process (all its threads), from /proc."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    # Fields after the ')' closing the command name: state is [0], utime [11], stime [12].
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICK


class CpuMeter:
    """Wall time and CPU time of the server, of this process, and of everything else."""

    def __init__(self, pid: int):
        self.pid = pid
        self.wall = time.perf_counter()
        self.server, self.client, self.busy = cpu_seconds(pid), time.process_time(), busy_seconds()

    def read(self) -> dict:
        wall = time.perf_counter() - self.wall
        server = cpu_seconds(self.pid) - self.server
        client = time.process_time() - self.client
        # Whatever else ran (another test suite, say) took CPU from both client and server:
        # the figures are only worth reading when this is near zero.
        others = (busy_seconds() - self.busy - server - client) / wall
        return {"wall": wall, "server": server, "client": client, "others": max(others, 0.0)}


# --- measurements ------------------------------------------------------------------------------


def percentiles_ms(seconds) -> dict:
    ms = np.asarray(seconds) * 1e3
    return {
        "p50_ms": float(np.percentile(ms, 50)),
        "p90_ms": float(np.percentile(ms, 90)),
        "p99_ms": float(np.percentile(ms, 99)),
    }


def sequential(module, client, raw: RawClient, url, cases, samples: int, pid: int) -> dict:
    """Concurrency 1: in-process, httpx and bare-socket runs in alternating blocks of BLOCK
    kept runs each, so all three medians see the same machine state."""
    path = "/" + url.split("/", 3)[3]
    prepared = [raw.prepare(path, body, headers) for _, _, body, headers in cases]
    times: dict[str, list[float]] = {"in_process": [], "http": [], "http_bare": []}
    client_cpu: list[float] = []
    errors = requests = 0

    def local(i):
        module.run(cases[i][0])
        return True

    def remote(i):
        response = client.post(url, content=cases[i][2], headers=cases[i][3])
        return response.status_code, response.content, response.headers.get(HEADER_LENGTH)

    def bare(i):
        status, headers, content = raw.post(prepared[i])
        return status, content, headers.get(HEADER_LENGTH.lower())

    meter = CpuMeter(pid)
    for block in range(-(-samples // BLOCK)):
        for name, run in (("in_process", local), ("http", remote), ("http_bare", bare)):
            time.sleep(SETTLE_SECONDS)
            for k in range(BLOCK + 1):
                i = (block * BLOCK + k) % len(cases)
                cpu_started = time.thread_time()
                started = time.perf_counter()
                outcome = run(i)
                elapsed = time.perf_counter() - started
                if k:  # the first run of a block pays for the switch between engines
                    times[name].append(elapsed)
                    if run is remote:
                        client_cpu.append(time.thread_time() - cpu_started)
                if run is not local:
                    requests += 1
                    errors += not response_ok(*outcome, cases[i][1])
    # The server is idle during in-process blocks and pauses, so its CPU time here is the
    # HTTP requests' (to within uvicorn's once-a-second housekeeping).
    cpu = meter.read()
    figures = {name: percentiles_ms(values) for name, values in times.items()}
    in_process = figures["in_process"]["p50_ms"]
    return {
        "samples": len(times["http"]),
        **figures,
        "overhead_p50_ms": figures["http"]["p50_ms"] - in_process,
        "overhead_bare_p50_ms": figures["http_bare"]["p50_ms"] - in_process,
        "client_cpu_per_request_ms": float(np.median(client_cpu) * 1e3),
        "server_cpu_per_request_ms": cpu["server"] / requests * 1e3,
        "errors": errors,
        "other_load_cores": cpu["others"],
    }


def under_load(clients, url, cases, total: int, pid: int) -> dict:
    """`total` requests from len(clients) threads, one keep-alive client each."""
    counter = itertools.count()  # next() on it is atomic under the GIL
    records: list = [None] * total

    def worker(client: httpx.Client) -> None:
        while (i := next(counter)) < total:
            _, _, body, headers = cases[i % len(cases)]
            started = time.perf_counter()
            try:
                response = client.post(url, content=body, headers=headers)
                outcome = (response.status_code, response.content, response.headers)
            except httpx.HTTPError:
                outcome = (None, b"", {})
            # Checked after the run: comparing arrays here would take CPU from the server.
            records[i] = (time.perf_counter() - started, *outcome)

    threads = [threading.Thread(target=worker, args=(client,)) for client in clients]
    meter = CpuMeter(pid)
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    cpu = meter.read()
    errors = sum(
        not response_ok(status, content, headers.get(HEADER_LENGTH), cases[i % len(cases)][1])
        for i, (_, status, content, headers) in enumerate(records)
    )
    return {
        "requests": total,
        "concurrency": len(clients),
        "seconds": cpu["wall"],
        "throughput_rps": total / cpu["wall"],
        **percentiles_ms([record[0] for record in records]),
        "errors": errors,
        "client_cpu_per_request_ms": cpu["client"] / total * 1e3,
        "server_cpu_per_request_ms": cpu["server"] / total * 1e3,
        "other_load_cores": cpu["others"],
    }


def bench_model(name: str, args, work: Path) -> dict:
    started = time.perf_counter()
    archive = compiler_core.compile(
        str(MODELS_DIR / f"{name}.onnx"),
        "llvm",
        MODEL_SHAPES[name],
        batch_buckets=args.batch_buckets,
    )
    compile_seconds = time.perf_counter() - started
    data = archive.to_bytes()
    data_dir = work / name
    digest = open_store(str(data_dir / "store")).put_blob(data)
    # The same archive and thread count as each server instance, so outputs match bit for bit.
    module = load(data, num_threads=args.threads)
    rng = np.random.default_rng(0)
    cases = []
    for _ in range(DISTINCT_INPUTS):
        # One row per request: a bucketed archive's signature is its largest bucket's.
        feeds = {n: rng.standard_normal((1, *s[1:])).astype(d) for n, s, d in module.inputs}
        cases.append((feeds, module.run(feeds), *encode_infer_request(feeds)))

    process, base, log = start_server(
        data_dir, name, digest, args.instances, args.threads, args.batch_delay_ms
    )
    clients = [httpx.Client(timeout=REQUEST_TIMEOUT) for _ in range(args.concurrency)]
    try:
        wait_ready(process, base, log)
        url = f"{base}/v2/models/{name}/infer"
        # Warm up every connection (and the server's worker threads) before anything counts.
        under_load(clients, url, cases, WARMUP_PER_CLIENT * len(clients), process.pid)
        for _ in range(WARMUP_PER_CLIENT):
            module.run(cases[0][0])
        raw = RawClient(base)
        try:
            timer = inference_seconds(clients[0], base)
            one = sequential(module, clients[0], raw, url, cases, args.sequential, process.pid)
            one["server_run_mean_ms"] = run_mean_ms(timer, inference_seconds(clients[0], base))
        finally:
            raw.close()
        timer = inference_seconds(clients[0], base)
        many = under_load(clients, url, cases, args.requests, process.pid)
        many["server_run_mean_ms"] = run_mean_ms(timer, inference_seconds(clients[0], base))
    finally:
        for client in clients:
            client.close()
        stop_server(process)
    return {
        "model": name,
        "compile_seconds": round(compile_seconds, 2),
        "concurrency_1": one,
        "concurrency_c": many,
    }


def print_tables(results: dict) -> None:
    print(
        "\nconcurrency 1 (ms; p50 unless said; overhead = HTTP - in-process; CPU per request)\n"
        f"{'model':9s} {'in-proc':>8s} {'srv run':>8s} {'HTTP':>8s} {'overhead':>8s} "
        f"{'bare':>8s} {'overhead':>8s} {'cli CPU':>8s} {'srv CPU':>8s} {'errors':>6s} "
        f"{'others':>6s}"
    )
    for r in results["models"]:
        one = r["concurrency_1"]
        print(
            f"{r['model']:9s} {one['in_process']['p50_ms']:8.3f} {one['server_run_mean_ms']:8.3f} "
            f"{one['http']['p50_ms']:8.3f} {one['overhead_p50_ms']:8.3f} "
            f"{one['http_bare']['p50_ms']:8.3f} {one['overhead_bare_p50_ms']:8.3f} "
            f"{one['client_cpu_per_request_ms']:8.3f} {one['server_cpu_per_request_ms']:8.3f} "
            f"{one['errors']:6d} {one['other_load_cores']:6.2f}"
        )
    print(
        f"\nconcurrency {results['concurrency']}, {results['requests']} requests (ms; CPU per "
        "request)\n"
        f"{'model':9s} {'req/s':>8s} {'p50':>8s} {'p90':>8s} {'p99':>8s} {'srv run':>8s} "
        f"{'cli CPU':>8s} {'srv CPU':>8s} {'errors':>6s} {'others':>6s}"
    )
    for r in results["models"]:
        many = r["concurrency_c"]
        print(
            f"{r['model']:9s} {many['throughput_rps']:8.1f} {many['p50_ms']:8.2f} "
            f"{many['p90_ms']:8.2f} {many['p99_ms']:8.2f} {many['server_run_mean_ms']:8.2f} "
            f"{many['client_cpu_per_request_ms']:8.3f} {many['server_cpu_per_request_ms']:8.3f} "
            f"{many['errors']:6d} {many['other_load_cores']:6.2f}"
        )
    print(
        "srv run: mean of the server's own inference timer (at concurrency C it includes the "
        "wait for a free instance); bare: a bare-socket client instead of httpx; cli CPU: the "
        "client thread's (all client threads' at concurrency C); srv CPU: the server "
        "process's, model run included; others: cores other processes kept busy"
    )
    worst = max(
        max(r["concurrency_1"]["other_load_cores"], r["concurrency_c"]["other_load_cores"])
        for r in results["models"]
    )
    if worst > OTHER_LOAD_WARNING:
        print(f"warning: other processes kept {worst:.2f} cores busy: the figures are inflated")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODEL_SHAPES), choices=MODEL_SHAPES)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--sequential", type=int, default=300, help="kept runs at concurrency 1")
    parser.add_argument("--instances", type=int, default=2, help="KILN_RUNTIME_INSTANCES")
    parser.add_argument("--threads", type=int, default=1, help="KILN_NUM_THREADS")
    parser.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each model, wait up to this long for other processes to go quiet",
    )
    parser.add_argument(
        "--batch-buckets",
        type=lambda text: [int(b) for b in text.split(",")],
        default=None,
        help="compile with these batch buckets (e.g. 1,2,4,8): the server batches requests",
    )
    parser.add_argument(
        "--batch-delay-ms",
        type=float,
        default=0.0,
        help="KILN_RUNTIME_BATCH_DELAY_MS (negative: batching off)",
    )
    parser.add_argument("--json", type=Path, default=Path("bench/serve_results.json"))
    args = parser.parse_args()

    print(
        f"CPU: {cpu_name()} ({os.cpu_count()} cores); server: {args.instances} instances x "
        f"{args.threads} threads; {args.requests} requests at concurrency {args.concurrency}; "
        f"batch buckets {args.batch_buckets or 'none'}, batch delay {args.batch_delay_ms} ms"
    )
    results = {
        "date": datetime.date.today().isoformat(),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "instances": args.instances,
        "threads": args.threads,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "batch_buckets": args.batch_buckets,
        "batch_delay_ms": args.batch_delay_ms,
        "models": [],
    }
    with tempfile.TemporaryDirectory(prefix="kiln-serve-bench-") as work:
        for name in args.models:
            wait_idle(args.wait_idle)
            results["models"].append(bench_model(name, args, Path(work)))
            print(f"{name}: done", flush=True)  # the whole run takes minutes: show progress
    print_tables(results)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))
    print(f"results: {args.json}")


if __name__ == "__main__":
    main()
