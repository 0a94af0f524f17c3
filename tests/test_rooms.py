"""The rooms' import rules (DESIGN §2): the api never imports the compiler (only the tuning
log's reader), and the artifact store imports nothing of ours."""

from __future__ import annotations

import subprocess
import sys


def loaded_after(statement: str) -> set[str]:
    probe = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    output = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    return set(output.split())


# The console shows the shared tuning log, so the api reads it with the log's own reader: a
# stdlib-only module of the compiler, whose packages import nothing themselves.
TUNING_LOG_READER = {
    "compiler_core",
    "compiler_core.autotune",
    "compiler_core.autotune.records",
    "compiler_core.errors",
}


def test_the_api_does_not_import_the_compiler():
    modules = loaded_after("import api.app, api.routes, api.services, api.console")
    compiler = {m for m in modules if m.split(".")[0] in ("compiler_core", "llvmlite", "lightgbm")}
    assert compiler <= TUNING_LOG_READER, compiler - TUNING_LOG_READER


def test_the_artifact_store_imports_nothing_of_ours():
    modules = loaded_after("import artifact_store")
    ours = ("compiler_core", "api", "tuner_workers", "runtime_server")
    assert not {m for m in modules if m.split(".")[0] in ours}


def test_the_client_needs_only_httpx_and_numpy():
    modules = loaded_after("import api.client")
    heavy = ("fastapi", "starlette", "celery", "compiler_core", "tuner_workers", "llvmlite")
    assert not {m for m in modules if m.split(".")[0] in heavy}
