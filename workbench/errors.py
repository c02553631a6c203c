"""The two kinds of bad input every layer raises; below everything else in the package, so that
a data reader or a tracker reports bad input without importing the command line.

`workbench.cli.guarded` turns either into one line on stderr and exit status 2.
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A bad value in the user's configuration: the key, the value and what would be valid."""

    def __init__(self, key: str, value: Any, valid: str):
        self.key, self.value, self.valid = key, value, valid
        super().__init__(f"{key}={value!r}: {valid}")


class InputError(Exception):
    """Bad input that is not a config value (a missing file, a corrupt checkpoint, ...)."""
