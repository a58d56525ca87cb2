"""The base class of user errors: bad input that no retry can fix.

A stage raises a subclass (a malformed config, an unknown key, a corrupt checkpoint or manifest) with
a message that names the file, the key and what was expected; ``python -m lrattnres`` prints it as
one line and exits 2.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input: printed as one line by the command line, exit code 2."""


class SpecError(UserError, ValueError):
    """A stage's settings (its ``--spec`` object, or its block of the config) that it cannot run: the
    message names the key and what was expected."""


class InputError(UserError, ValueError):
    """An input file that is not what a stage reads: not JSON, a key missing, a value of the wrong
    kind (a truncated or hand-edited result of an earlier stage)."""


def one_line(exc: BaseException) -> str:
    """An exception's message on one line."""
    return " ".join(str(exc).split()) or type(exc).__name__
