"""`kiln serve`: the whole platform on one machine, in the foreground.

Starts the runtime server, one Celery worker and the api as child processes on loopback,
sharing one data dir (embedded defaults: SQLite broker and ledger, filesystem store; or Redis
when KILN_REDIS_URL is set). SIGINT or SIGTERM stops all three; if one of them dies, the
others are stopped too and `kiln serve` exits non-zero.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

STOP_GRACE_SECONDS = 10.0


def dev_api_keys(data_dir: Path) -> str:
    """One development key, kept in DIR/dev-api-key so a restart keeps it."""
    path = data_dir / "dev-api-key"
    if path.exists():
        key = path.read_text().strip()
    else:
        key = "kiln-dev-" + secrets.token_urlsafe(24)
        path.touch(mode=0o600)
        path.write_text(key + "\n")
    print(f"kiln serve: development API key (tenant 'dev'): {key}  (saved in {path})", flush=True)
    return f"dev:{key}"


def child_commands(host: str, api_port: int, runtime_port: int) -> dict[str, list[str]]:
    python = sys.executable
    return {
        "runtime": [python, "-m", "runtime_server", "--host", host, "--port", str(runtime_port)],
        "worker": [python, "-m", "tuner_workers", "worker"],
        "api": [python, "-m", "api", "--host", host, "--port", str(api_port)],
    }


def serve(api_port: int, runtime_port: int, data_dir: Path, host: str = "127.0.0.1") -> int:
    data_dir = data_dir.expanduser().resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, KILN_DATA_DIR=str(data_dir))
    env["KILN_RUNTIME_URL"] = f"http://{host}:{runtime_port}"
    if not env.get("KILN_API_KEYS", "").strip():
        env["KILN_API_KEYS"] = dev_api_keys(data_dir)
    mode = f"Redis at {env['KILN_REDIS_URL']}" if env.get("KILN_REDIS_URL") else "embedded"
    print(
        f"kiln serve ({mode}, data in {data_dir}): api http://{host}:{api_port}, "
        f"runtime http://{host}:{runtime_port}",
        flush=True,
    )
    stopping = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: stopping.append(signum))
    children = {
        name: subprocess.Popen(command, env=env)
        for name, command in child_commands(host, api_port, runtime_port).items()
    }
    status = 0
    while not stopping:
        dead = {name: p.returncode for name, p in children.items() if p.poll() is not None}
        if dead:
            print(f"kiln serve: {dead} exited; stopping the others", file=sys.stderr, flush=True)
            status = 1
            break
        time.sleep(0.2)
    _stop(children)
    return status


def _stop(children: dict[str, subprocess.Popen]) -> None:
    """SIGTERM every child (a Celery worker then finishes its task: warm shutdown), and
    SIGKILL what is still there after the grace period: a killed job is taken up again by
    the next worker."""
    for process in reversed(children.values()):
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for process in children.values():
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
