"""Kiln runtime server package (filled by later issues)."""
