"""The one base class of the errors a user can fix: a config key, a data row, a file, a checkpoint, a model.

The command line prints such an error as one line, ``error: <message>``, and exits 2; any other exception is a bug
and keeps its traceback. Each package's own error class derives from ``UserError`` (and from the builtin it always
was, so existing ``except ValueError`` sites keep working); its message names the thing and what was expected.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input the user can correct; the message alone says what and where."""


class ConfigError(UserError, ValueError):
    """A configuration value is missing, unknown, of the wrong type or inconsistent; the message names the key."""
