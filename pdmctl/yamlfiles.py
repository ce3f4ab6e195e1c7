"""Named YAML files (sweeps/, clusters/, reports/): found by name or path, read with one-line errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a name too long for the file system, a loop of links: not a file we can read
        return False


def load_named(
    name_or_path: str, directory: Path, what: str, error: type[Exception]
) -> tuple[Path, dict[str, Any]]:
    """`directory/NAME.yaml`, a bare NAME or file found there, or any path -> (path, mapping).

    Every problem raises `error` with one line starting with `what`.
    """
    path = Path(name_or_path)
    if not _is_file(path):
        candidates = (directory / name_or_path, directory / f"{name_or_path}.yaml")
        path = next((c for c in candidates if _is_file(c)), path)
    if not _is_file(path):
        known = ", ".join(sorted(p.stem for p in directory.glob("*.yaml"))) or "none"
        shown = name_or_path if len(name_or_path) <= 200 else f"{name_or_path[:200]}..."
        raise error(f"{what}: {shown!r} not found (known: {known})")
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
