"""losses operators (filled in by the conformance work)."""

from __future__ import annotations

from compiler_core.graph.ops.base import OpDef

OPS: dict[str, OpDef] = {}
