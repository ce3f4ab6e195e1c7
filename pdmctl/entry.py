"""The `pdmctl` console script: the command line (`pdmctl.cli`), imported under a Ctrl-C guard.

Importing the CLI takes a second (typer, rich, the mounted commands); a Ctrl-C then would otherwise print
Python's traceback of the import machinery instead of one line.
"""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from pdmctl.cli import interrupted
        from pdmctl.cli import main as run
    except KeyboardInterrupt:
        print("pdmctl: interrupted", file=sys.stderr)
        sys.exit(130)
    try:
        run()
    except KeyboardInterrupt:  # between the command's end and the exit
        interrupted()
    except SystemExit:
        raise
    except BaseException as exc:  # raised while a Ctrl-C was on its way out (a module it left half-imported)
        if _during_interrupt(exc):
            interrupted()
        raise


def _during_interrupt(exc: BaseException) -> bool:
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        if isinstance(link, KeyboardInterrupt):
            return True
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return False


if __name__ == "__main__":
    main()
