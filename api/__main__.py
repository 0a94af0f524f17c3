"""`python -m api [--host H] [--port P]`: serve the api with uvicorn (settings from KILN_*)."""

from __future__ import annotations

import argparse

import uvicorn

from api.app import create_app
from tuner_workers.settings import KilnSettings


def main() -> None:
    settings = KilnSettings()
    parser = argparse.ArgumentParser(prog="python -m api")
    parser.add_argument("--host", default=settings.api_host)
    parser.add_argument("--port", type=int, default=settings.api_port)
    args = parser.parse_args()
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
