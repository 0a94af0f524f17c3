"""Kiln api package (filled by later issues)."""
