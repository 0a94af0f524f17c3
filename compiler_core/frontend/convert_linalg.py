"""Converters for linear-algebra operators."""

from __future__ import annotations

from compiler_core.frontend.convert_utils import Converter, direct

CONVERTERS: dict[str, dict[int, Converter]] = {"Det": {11: direct()}}
