"""Converters for the conv transpose operators."""

from __future__ import annotations

from compiler_core.frontend.convert_utils import Converter

CONVERTERS: dict[str, dict[int, Converter]] = {}
