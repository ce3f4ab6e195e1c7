"""Where a run's numbers came from: what each attempt of a job records before it trains.

The job (`pdmctl.job`) calls `collect` once per attempt and hands the result to the ledger
(`RunLogger.record_provenance`): the code's commit and whether its tree was dirty, the versions of
pdmctl and of the engine (VeRL, vLLM, torch), the digest of the resolved run config, and what the
backend adds (`Backend.provenance`: the data manifest's digest, the evaluation's sampling parameters).
The report (`pdmctl.report`) shows them per row and says when a row pools runs that differ.

Values are short strings (MLflow tags); a value that cannot be found is "unknown", a package that is
not installed "absent", never an exception: provenance never stops a run.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import tomllib
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = ("pdmctl", "verl", "vllm", "torch")  # the versions recorded (the engine's, as this job imports them)
# the fields whose values must agree across a row's runs for its mean to be one experiment's
POOLING_FIELDS = ("commit", "dirty", *(f"version.{p}" for p in PACKAGES), "data", "config")
SOURCE_DIR = Path(__file__).resolve().parent.parent  # the checkout (or site-packages) pdmctl runs from
# a wheel's: the commit it was built from and whether that tree was dirty (written by setup.py)
COMMIT_FILE = Path(__file__).resolve().parent / "_commit.json"
_COMMIT = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")  # a SHA-1 or SHA-256 object name


def versions() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[f"version.{name}"] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[f"version.{name}"] = "absent"
    return out


def is_own_clone(directory: Path) -> bool:
    """Whether `directory` is the top of a git work tree that is pdmctl's own clone (its pyproject.toml names
    pdmctl): a checkout or an editable install. An installed package's parent (site-packages) is not, even
    where it sits inside some other git project, e.g. a virtualenv in the user's own repository."""
    try:
        if not (directory / ".git").exists():
            return False
        with open(directory / "pyproject.toml", "rb") as fh:
            if tomllib.load(fh).get("project", {}).get("name") != "pdmctl":
                return False
    except (OSError, ValueError, AttributeError):  # tomllib.TOMLDecodeError is a ValueError
        return False
    top = _git(directory, "rev-parse", "--show-toplevel")
    try:
        return top is not None and Path(top).resolve() == directory.resolve()
    except (OSError, RuntimeError):
        return False


def _git(directory: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(directory), *args], capture_output=True, text=True, timeout=20,
                              check=False, env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"})  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def built_commit(path: Path = COMMIT_FILE) -> dict[str, str]:
    """The commit an installed wheel was built from and whether its tree was dirty then
    (`pdmctl/_commit.json`, which setup.py writes at build time); "unknown" where the file is missing or not
    as setup.py writes it."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"commit": "unknown", "dirty": "unknown"}
    commit = data.get("commit") if isinstance(data, dict) else None
    if not isinstance(commit, str) or not _COMMIT.fullmatch(commit):
        return {"commit": "unknown", "dirty": "unknown"}
    dirty = data.get("dirty")
    return {"commit": commit, "dirty": dirty if dirty in ("yes", "no") else "unknown"}


def git_state(directory: Path = SOURCE_DIR) -> dict[str, str]:
    """The commit of pdmctl's code and whether its tracked files differ from it. git is asked only where
    `directory` is the top of pdmctl's own clone (`is_own_clone`); an installed wheel reports the commit it
    was built from (`built_commit`), never that of a git project it happens to be installed in; "unknown"
    where neither is known. Provenance, `pdmctl --version`, the report's header and the ledger's source
    commit all read it here."""
    if not is_own_clone(directory):
        return built_commit(directory / "pdmctl" / COMMIT_FILE.name)
    commit = _git(directory, "rev-parse", "HEAD")
    if commit is None:
        return {"commit": "unknown", "dirty": "unknown"}
    status = _git(directory, "status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": "unknown" if status is None else ("yes" if status else "no")}


def config_digest(config: Mapping[str, Any]) -> str:
    """sha256 (first 16 hex digits) of the canonical JSON of the resolved run config."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def file_digest(paths: list[Path]) -> str:
    """sha256 (16 hex digits) over the named files' names and bytes, in order; "missing: NAME" if one is not
    there."""
    h = hashlib.sha256()
    for path in paths:
        if not path.is_file():
            return f"missing: {path.name}"
        h.update(path.name.encode() + b"\0")
        with open(path, "rb") as fh:
            for block in iter(lambda f=fh: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


def collect(config: Mapping[str, Any], backend_fields: Callable[[], Mapping[str, str]] | None = None) -> dict[str, str]:
    """Every field of one attempt's provenance (see the module's docstring)."""
    out = {**git_state(), **versions(), "config": config_digest(config)}
    if backend_fields is not None:
        try:
            out.update({k: str(v) for k, v in backend_fields().items()})
        except Exception as exc:  # a data file that cannot be read: said, not fatal
            out["data"] = f"unknown ({type(exc).__name__})"
    return out
