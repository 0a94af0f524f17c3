"""Load compiled modules and run them. Imports nothing else from the compiler."""

from compiler_core.runtime.module import ArchiveError, InputError, Module, load

__all__ = ["ArchiveError", "InputError", "Module", "load"]
