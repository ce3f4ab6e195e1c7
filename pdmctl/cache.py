"""pdmctl's cache directory on this machine: `$PDMCTL_CACHE`, else ~/.cache/pdmctl.

What lives there: the submission lock of a tracking server's ledger (`locks/`, shared by every shell
that submits to that server, whatever its current directory) and the toy backend's warmed-up base
models. An empty value is the default (an unset variable in a script); a relative one is refused, since
two shells in two directories would then hold two locks for one store.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "PDMCTL_CACHE"


class CacheError(ValueError):
    """A cache directory that cannot be used; the message is one line."""


def cache_dir(default: Path) -> Path:
    """`$PDMCTL_CACHE` as an absolute path, else `default`."""
    value = os.environ.get(CACHE_ENV, "").strip()
    if not value:
        return default
    path = Path(value).expanduser()
    if not path.is_absolute():
        raise CacheError(f"{CACHE_ENV}={value!r}: must be an absolute path (a relative one depends on the "
                         "directory each command runs in)")  # fmt: skip
    return path


def check_writable_dir(path: Path, what: str) -> None:
    """`path` is a directory this process can write into, or can be made one (CacheError, one line)."""
    try:
        existing = next(p for p in (path, *path.parents) if p.exists())
        if not existing.is_dir():
            raise CacheError(f"{what} {path}: {existing} is a file, not a directory")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise CacheError(f"{what} {path}: {existing} is not writable")
    except OSError as exc:  # a name too long, a loop of links
        raise CacheError(f"{what} {path}: {exc.strerror or exc}") from None
