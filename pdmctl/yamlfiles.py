"""Named YAML files (sweeps/, clusters/, reports/): found by name or path, read with one-line errors."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a name too long for the file system, a loop of links: not a file we can read
        return False


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    """` (did you mean 'x'?)` for the closest of `choices` to a mistyped `word`, else ''."""
    import difflib

    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


def load_named(
    name_or_path: str, directory: Path | Sequence[Path], what: str, error: type[Exception]
) -> tuple[Path, dict[str, Any]]:
    """`directory/NAME.yaml`, a bare NAME or file found there, or any path -> (path, mapping).

    `directory` may be a search path (a list of folders): the first that holds NAME wins.
    Every problem raises `error` with one line starting with `what`.
    """
    directories = [directory] if isinstance(directory, Path) else list(directory)
    path = Path(name_or_path)
    if not _is_file(path):
        candidates = [c for d in directories for c in (d / name_or_path, d / f"{name_or_path}.yaml")]
        path = next((c for c in candidates if _is_file(c)), path)
    if not _is_file(path):
        names = sorted({p.stem for d in directories for p in d.glob("*.yaml")})
        shown = name_or_path if len(name_or_path) <= 200 else f"{name_or_path[:200]}..."
        hint = did_you_mean(Path(name_or_path).stem, names) if len(name_or_path) <= 200 else ""
        raise error(f"{what}: {shown!r} not found{hint} (known: {', '.join(names) or 'none'})")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise error(f"{what}: {path} cannot be read ({exc.strerror or exc})") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{what}: {path} is not UTF-8 text (byte {exc.start}: {raw[exc.start:exc.start + 1]!r})") from exc
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise error(f"{what}: {path} is not valid YAML: {str(exc).splitlines()[0]}") from exc
    if not isinstance(data, dict):
        raise error(f"{what}: {path} must be a mapping")
    return path, data
