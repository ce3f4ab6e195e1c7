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


if __name__ == "__main__":
    main()
