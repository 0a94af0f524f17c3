"""`python -m runtime_server [--host H] [--port P] [--load name=sha256:... ...]`: one process."""

from __future__ import annotations

import argparse
import sys

import uvicorn

from runtime_server.app import create_app
from runtime_server.repository import ModelRepository, RepositoryError
from runtime_server.settings import RuntimeSettings


def parse_preload(text: str) -> tuple[str, str, str | None]:
    """'name=sha256:...' or 'name:version=sha256:...' -> (name, artifact, version)."""
    target, sep, artifact = text.partition("=")
    if not sep or not target or not artifact:
        raise argparse.ArgumentTypeError(f"expected name=sha256:<hex>, got {text!r}")
    name, _, version = target.partition(":")
    return name, artifact, version or None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m runtime_server",
        description="Serve module archives over the Open Inference Protocol (KServe v2 REST).",
    )
    parser.add_argument("--host", help="bind address (default: KILN_RUNTIME_HOST)")
    parser.add_argument("--port", type=int, help="port (default: KILN_RUNTIME_PORT)")
    parser.add_argument(
        "--load",
        action="append",
        default=[],
        type=parse_preload,
        metavar="NAME[:VERSION]=sha256:HEX",
        help="load an artifact from the store before serving (repeatable)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = RuntimeSettings()
    repository = ModelRepository(
        settings.store(), settings.runtime_instances, settings.num_threads, settings.batch_delay
    )
    for name, artifact, version in args.load:
        try:
            repository.load(name, artifact, version)
        except RepositoryError as err:
            print(f"runtime_server: cannot load {name!r}: {err}", file=sys.stderr)
            return 2
    app = create_app(settings, repository)
    host = args.host or settings.runtime_host
    port = settings.runtime_port if args.port is None else args.port
    # No access log: at sub-millisecond inference it was about a tenth of the event loop's
    # time; requests are counted in /metrics instead.
    uvicorn.run(app, host=host, port=port, access_log=settings.runtime_access_log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
