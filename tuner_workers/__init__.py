"""Kiln tuner workers package (filled by later issues)."""
