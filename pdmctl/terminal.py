"""What every pdmctl command shares at the terminal: the consoles, and user errors as one line, exit 2.

Both `pdmctl.cli` and the commands other packages mount on it (`pdmctl.report.cli`) import these
from here, so neither CLI module imports the other's private parts.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import typer
from rich.console import Console

MAX_COLUMNS = 10_000  # a $COLUMNS beyond it is a typo, not a screen


def width(stream, piped: int) -> int | None:
    """A console's width: a terminal's own (None: rich reads it, $COLUMNS first, and follows a resize); piped,
    $COLUMNS where it is a positive number, else `piped` (wide enough that a table in a log file wraps no
    cell). Colour is rich's to decide: none piped (unless $FORCE_COLOR), none wherever $NO_COLOR is set."""
    import os

    if stream is not None and stream.isatty():
        return None
    columns = os.environ.get("COLUMNS", "").strip()
    return int(columns) if columns.isdigit() and 0 < int(columns) <= MAX_COLUMNS else piped


console = Console(width=width(sys.stdout, 160))
err = Console(stderr=True, width=width(sys.stderr, 200))

EXIT_BAD_INPUT = 2


def fail(message: str, code: int = EXIT_BAD_INPUT) -> None:
    from rich.markup import escape

    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)  # [x] is text here
    raise typer.Exit(code)


def check_output(path: Path, what: str, *, directory: bool) -> None:
    """Refuse (one line, exit 2) an output path that could not be written, before any work is done.

    `directory`: the path is a directory to write into (made if missing), else a file to (over)write.
    """
    import os

    try:
        if directory and path.exists() and not path.is_dir():
            fail(f"{what} {path}: a file is there, not a directory")
        if not directory and path.is_dir():
            fail(f"{what} {path}: is a directory")
        parent = path if directory else path.parent
        existing = next((p for p in (parent, *parent.parents) if p.exists()), None)
        if not directory and existing != parent:
            fail(f"{what} {path}: directory {parent} does not exist")
        if existing is None or not existing.is_dir():
            fail(f"{what} {path}: {existing} is not a directory")
        target = path if path.exists() else existing
        if not os.access(target, os.W_OK) or (target.is_dir() and not os.access(target, os.X_OK)):
            fail(f"{what} {path}: {target} is not writable")
        if not path.exists():  # access() says yes to root everywhere, /proc included: try, leave no trace
            first = path if existing == path.parent else next(p for p in path.parents if p.parent == existing)
            try:
                if directory or first != path:
                    first.mkdir()
                    first.rmdir()
                else:
                    os.close(os.open(first, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
                    first.unlink()
            except OSError as exc:
                fail(f"{what} {path}: cannot be created in {existing} ({exc.strerror or exc})")
    except OSError as exc:  # a name too long, a loop of links, a filesystem that takes no new files
        fail(f"{what} {path}: {exc.strerror or exc}")


def _user_errors() -> tuple[type[BaseException], ...]:
    # imported when an error is on its way out: a command's start stays free of the heavy modules
    from pdmctl.executors.base import ExecutorError
    from pdmctl.grid import GridError
    from pdmctl.ledger import LedgerError
    from pdmctl.orchestrate import RunDirError, RunNotFound
    from pdmctl.plugins import PluginError
    from pdmctl.spec import SpecError
    from pdmctl.testhooks import TestHookError

    return (GridError, SpecError, LedgerError, ExecutorError, RunNotFound, RunDirError, TestHookError, PluginError)


@contextlib.contextmanager
def guard() -> Iterator[None]:
    """Turn a user's mistake into one line and exit code 2, never a traceback."""
    try:
        yield
    except KeyboardInterrupt:  # on its way out as it is: the user errors' modules are not imported for it
        raise
    except _user_errors() as exc:
        text = str(exc).strip()
        fail(text.splitlines()[0] if text else type(exc).__name__)
    finally:
        if "pdmctl.ledger" in sys.modules:  # a refusal after reading leaves no -wal/-shm beside the store
            sys.modules["pdmctl.ledger"].close_stores()


TAIL_BLOCK = 1 << 20  # the log goes to stdout a block at a time, never whole into memory


def tail(path: Path, follow: bool, still_running, poll: float = 1.0) -> str | None:
    """Print the log at `path`; with `follow`, what it gains until the run ends. Returns why following
    stopped early (the log was removed or replaced: it will never grow again), else None."""
    import codecs
    import os
    import time

    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character cut by a block's end
    fh, seen = None, None
    try:
        while True:
            if fh is None and path.exists():
                fh = open(path, "rb")  # noqa: SIM115 (closed below; kept open across polls, as tail -f)
                seen = os.fstat(fh.fileno()).st_ino
            if fh is not None:
                while block := fh.read(TAIL_BLOCK):
                    sys.stdout.write(decoder.decode(block))
                sys.stdout.write(decoder.decode(b"", final=not follow))
                sys.stdout.flush()
            if not follow:
                return None
            if fh is not None:
                try:
                    now = path.stat().st_ino
                except OSError:
                    now = None
                if now != seen:
                    return f"its log {path} was {'removed' if now is None else 'replaced'} while following"
            if not still_running():
                return None
            time.sleep(poll)
    finally:
        if fh is not None:
            fh.close()
