"""The error contract of every command: bad input ends with one line naming the key and what is
valid, and exit status 2. Only command modules (a `main` run as `python -m ...`) import this.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, List

from workbench.errors import ConfigError, InputError
from workbench.places import show_traceback
from workbench.startup import fewer_gc_passes

EXIT_BAD_INPUT = 2


class ArgParser(argparse.ArgumentParser):
    """argparse whose usage errors are bad input like any other: one line, exit 2 (`guarded`)
    instead of argparse's usage block."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise InputError(f"{self.prog}: {message}")


def report_and_exit(err: Exception) -> None:
    """The one-line contract; WORKBENCH_TRACEBACK=1 shows the traceback too."""
    if show_traceback():
        import traceback

        traceback.print_exc()
    line = " ".join(str(err).split())
    print(f"error: {line}", file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)


def guarded(main: Callable[[List[str]], int]) -> Callable[[List[str]], int]:
    """Wrap a command's main so that bad input exits 2 with one line, never a traceback."""

    def wrapper(argv: List[str]) -> int:
        fewer_gc_passes()  # every command is a process of its own (workbench/startup.py)
        try:
            return main(argv)
        except (ConfigError, InputError, FileNotFoundError) as e:
            report_and_exit(e)
        return EXIT_BAD_INPUT

    return wrapper
