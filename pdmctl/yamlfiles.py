"""Named YAML files (sweeps/, clusters/, reports/): found by name or path, read with one-line errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def load_named(
    name_or_path: str, directory: Path, what: str, error: type[Exception]
) -> tuple[Path, dict[str, Any]]:
    """`directory/NAME.yaml`, a bare NAME or file found there, or any path -> (path, mapping).

    Every problem raises `error` with one line starting with `what`.
    """
    path = Path(name_or_path)
    if not path.is_file():
        candidates = (directory / name_or_path, directory / f"{name_or_path}.yaml")
        path = next((c for c in candidates if c.is_file()), path)
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in directory.glob("*.yaml"))) or "none"
        raise error(f"{what}: {name_or_path!r} not found (known: {known})")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise error(f"{what}: {path} is not valid YAML: {str(exc).splitlines()[0]}") from exc
    if not isinstance(data, dict):
        raise error(f"{what}: {path} must be a mapping")
    return path, data
