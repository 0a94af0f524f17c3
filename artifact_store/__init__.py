"""Kiln artifact store package (filled by later issues)."""
