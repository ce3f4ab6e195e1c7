"""What every pdmctl command shares at the terminal: the consoles, and user errors as one line, exit 2.

Both `pdmctl.cli` and the commands other packages mount on it (`pdmctl.report.cli`) import these
from here, so neither CLI module imports the other's private parts.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import typer
from rich.console import Console

console = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 200)

EXIT_BAD_INPUT = 2


def fail(message: str, code: int = EXIT_BAD_INPUT) -> None:
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _user_errors() -> tuple[type[BaseException], ...]:
    # imported when an error is on its way out: a command's start stays free of the heavy modules
    from pdmctl.executors.base import ExecutorError
    from pdmctl.grid import GridError
    from pdmctl.ledger import LedgerError
    from pdmctl.orchestrate import RunDirError, RunNotFound
    from pdmctl.spec import SpecError

    return (GridError, SpecError, LedgerError, ExecutorError, RunNotFound, RunDirError)


@contextlib.contextmanager
def guard() -> Iterator[None]:
    """Turn a user's mistake into one line and exit code 2, never a traceback."""
    try:
        yield
    except _user_errors() as exc:
        text = str(exc).strip()
        fail(text.splitlines()[0] if text else type(exc).__name__)
