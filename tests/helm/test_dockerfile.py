"""The image (./Dockerfile), checked without Docker: hadolint and its content."""

from __future__ import annotations

import fnmatch
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helm.dockerfile import (
    DOCKERFILE,
    IMAGE_STAGES,
    REPO,
    exec_form,
    image_entrypoints,
    instructions,
    stages,
)

BIN = Path(sys.executable).parent


def pyproject_keys(table: str) -> set[str]:
    """The keys of one table of pyproject.toml (tomllib is 3.11+; the project supports 3.10)."""
    text = (REPO / "pyproject.toml").read_text()
    section = re.search(rf"^\[{re.escape(table)}\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
    assert section, f"no [{table}] in pyproject.toml"
    return set(re.findall(r"^([A-Za-z0-9_.-]+)\s*=", section[1], re.M))


def test_hadolint_passes():
    result = subprocess.run(
        [BIN / "hadolint", "--no-color", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        cwd=REPO,  # picks up .hadolint.yaml
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_can_fail(tmp_path):
    """The check above means something: hadolint flags a careless Dockerfile."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN cd /src && pip install flask\n")
    result = subprocess.run(
        [BIN / "hadolint", "--no-color", str(bad)], capture_output=True, text=True, cwd=REPO
    )
    assert result.returncode != 0
    assert "DL3007" in result.stdout  # `latest`


def test_stages_and_targets():
    names = [s.name for s in stages()]
    assert set(IMAGE_STAGES) <= set(names)
    # `docker build .` makes the CPU image: the last stage.
    assert names[-1] == "runtime"
    by_name = {s.name: s for s in stages()}
    assert "slim" in by_name["runtime"].base
    assert by_name["cuda"].base.startswith("nvidia/cuda:")


def copies(stage):
    for args in stage.all("COPY"):
        words = [w for w in args.split() if not w.startswith("--chown")]
        yield words


def test_every_copy_source_exists_and_is_in_the_build_context():
    ignore = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def excluded(path: str) -> bool:
        """.dockerignore semantics for the patterns used there: the last match wins."""
        verdict = False
        for pattern in ignore:
            negate = pattern.startswith("!")
            pattern = pattern.lstrip("!").rstrip("/")
            if fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(path.split("/")[0], pattern):
                verdict = not negate
        return verdict

    sources = 0
    for stage in stages():
        for words in copies(stage):
            if any(w.startswith("--from=") for w in words):
                continue
            for source in words[:-1]:
                path = REPO / source
                assert path.exists(), f"COPY {source} in stage {stage.name}: no such path"
                assert not excluded(source.rstrip("/")), f"{source} is in .dockerignore"
                sources += 1
    assert sources >= 7


def test_copy_from_names_an_earlier_stage():
    seen = set()
    for stage in stages():
        for words in copies(stage):
            for word in words:
                if word.startswith("--from="):
                    assert word.removeprefix("--from=") in seen, word
        seen.add(stage.name)


@pytest.mark.parametrize("stage", IMAGE_STAGES)
def test_runs_as_a_non_root_user(stage):
    by_name = {s.name: s for s in stages()}
    user = by_name[stage].last("USER")
    assert user, f"stage {stage} sets no USER"
    uid = user.split(":")[0]
    # Numeric, so that Kubernetes' runAsNonRoot can verify it; and not root.
    assert uid.isdigit() and int(uid) != 0
    # The chart runs the pods as the same user.
    import yaml

    values = yaml.safe_load((REPO / "helm" / "kiln" / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == int(uid)


def test_entrypoints_exist_in_pyproject():
    scripts = pyproject_keys("project.scripts")
    from compiler_core.cli import SERVICE_COMMANDS

    by_name = {s.name: s for s in stages()}
    for stage, entrypoint in image_entrypoints().items():
        assert entrypoint[0] in scripts, entrypoint
        cmd = exec_form(by_name[stage].last("CMD"))
        assert cmd[0] in SERVICE_COMMANDS


def test_gpu_image_installs_the_cuda_extra():
    assert "cuda" in pyproject_keys("project.optional-dependencies")
    runs = " ".join(a for s in stages() if s.base.startswith("nvidia/cuda:") for a in s.all("RUN"))
    assert "[cuda]" in runs


@pytest.mark.parametrize("stage", IMAGE_STAGES)
def test_run_time_packages_are_the_linker_and_openmp_only(stage):
    """Compiling links with `cc -shared -pthread ... -lm` (compiler_core/codegen/native.py);
    libgomp stays for archives built before Kiln had its own thread pool."""
    by_name = {s.name: s for s in stages()}
    runs = " ".join(by_name[stage].all("RUN"))
    installed = set()
    for command in runs.split("&&"):
        words = command.split()
        if words[:2] == ["apt-get", "install"]:
            installed |= {w for w in words[2:] if not w.startswith("-")}
    assert {"gcc", "libc6-dev", "libgomp1"} <= installed
    assert not installed & {"build-essential", "g++", "make", "git", "curl", "wget"}
    assert "--no-install-recommends" in runs and "rm -rf /var/lib/apt/lists" in runs


def test_instruction_reader():
    text = 'FROM a AS b\n# note\nRUN x \\\n  # inside\n  && y\nENTRYPOINT ["kiln"]\n'
    assert instructions(text) == [("FROM", "a AS b"), ("RUN", "x && y"), ("ENTRYPOINT", '["kiln"]')]
    (stage,) = stages(text)
    assert (stage.name, stage.base, exec_form(stage.last("ENTRYPOINT"))) == ("b", "a", ("kiln",))
