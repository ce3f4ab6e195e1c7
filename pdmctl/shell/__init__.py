"""What pdmctl offers scripts and the shell around its commands: JSON documents on stdout (`print_document`,
`"schema": 1`, docs/JSON.md), the exit codes in each command's help (`exits`), the completion of names
(`complete`), the status table and its document (`status`), waiting on runs and a Ctrl-C while waiting
(`waiting`), and the question before cancelling (`confirm`).

Light at import time: the CLI imports this package on every start."""

from __future__ import annotations

import json
import math
import sys
from typing import Any

SCHEMA = 1  # a change to a document that breaks a reader raises it (docs/JSON.md)


def print_document(document: dict[str, Any]) -> None:
    """`document` as one JSON object on stdout, `schema` first, and nothing else there (a command's messages
    go to stderr). A number that is not finite is null: JSON has none, and a strict reader refuses them."""
    text = json.dumps(_clean({"schema": SCHEMA, **document}), indent=1, ensure_ascii=False, allow_nan=False)
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def number(value: Any, digits: int = 6) -> float | None:
    """A number for a document, rounded to `digits` decimals; None where there is none or it is not finite."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return round(float(value), digits)


def _clean(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    if value is None or isinstance(value, str | int | bool):
        return value
    return str(value)
