"""The one base class for errors in what a user gave Kiln.

A `UserError` is about the input: a malformed or unsupported model, a shape that cannot be bound,
a bad target string, a wrong inference input, a damaged archive, a bad command-line flag. Front
ends (the CLI, the services) report it as a message. Errors of the compiler itself (a schedule
that does not apply, a loop program that fails verification, a codegen or kernel rule that is
missing) are not UserErrors: they are bugs, and show their traceback.

This module imports nothing, so the runtime (which may import no other part of the compiler)
can use it.
"""

from __future__ import annotations


class UserError(ValueError):
    """Something wrong with the user's model, shapes, target, inputs or flags."""
