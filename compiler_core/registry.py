"""The explicit registries (plain dicts) are each assembled from per-family tables."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TypeVar

V = TypeVar("V")


def merge_tables(tables: Iterable[Mapping[str, V]], what: str) -> dict[str, V]:
    """One registry from family tables; a name two families define is a bug, not an
    override: `what` names the entries in the error ("kernel", "converter", ...)."""
    merged: dict[str, V] = {}
    for table in tables:
        for name, entry in table.items():
            if name in merged:
                raise RuntimeError(f"{what} for {name!r} is defined twice")
            merged[name] = entry
    return merged
