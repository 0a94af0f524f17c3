"""A small reader for ./Dockerfile: its stages and their instructions (no Docker needed)."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
# The stages people build and run: the default (last) stage and the GPU workers' target.
IMAGE_STAGES = ("runtime", "cuda")


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]

    def last(self, keyword: str) -> str | None:
        found = self.all(keyword)
        return found[-1] if found else None


def instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) with continuation lines joined and comments dropped."""
    out, pending = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        line, pending = pending + line, ""
        keyword, _, args = line.partition(" ")
        out.append((keyword.upper(), args.strip()))
    return out


def stages(text: str | None = None) -> list[Stage]:
    text = DOCKERFILE.read_text() if text is None else text
    result, build_args = [], {}
    for keyword, args in instructions(text):
        if keyword == "ARG" and not result:  # global ARGs: usable in FROM lines
            arg, _, default = args.partition("=")
            build_args[arg] = default
        elif keyword == "FROM":
            words = re.sub(r"\$\{(\w+)\}", lambda m: build_args.get(m[1], m[0]), args).split()
            words = [w for w in words if not w.startswith("--platform")]
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else str(len(result))
            result.append(Stage(name, words[0]))
        elif result:
            result[-1].instructions.append((keyword, args))
    return result


def exec_form(args: str) -> tuple[str, ...]:
    """ENTRYPOINT/CMD arguments: the JSON (exec) form, or the shell form split."""
    args = args.strip()
    return tuple(json.loads(args)) if args.startswith("[") else tuple(shlex.split(args))


def image_entrypoints() -> dict[str, tuple[str, ...]]:
    by_name = {s.name: s for s in stages()}
    return {name: exec_form(by_name[name].last("ENTRYPOINT")) for name in IMAGE_STAGES}
