"""The optional extras a command names when a module it needs is not installed.

`pip install pdmctl` alone is the login node's install: it plans, submits, follows, resumes and cancels
sweeps. The report's statistics (scipy) and figures (matplotlib) are the [report] extra, the CPU testbed
(torch, with the report its quickstart writes) the [testbed] extra. A command that needs one refuses in one
line naming it, before any work, never with an ImportError's traceback.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence

REPORT = ("scipy", "matplotlib")  # `pdmctl report` and `pdmctl seeds`: the statistics and the figures


def missing(modules: Sequence[str]) -> list[str]:
    """The modules of `modules` this interpreter cannot import; looked up, not imported."""
    gone = []
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent that does not import, a module set to None
            found = False
        if not found:
            gone.append(module)
    return gone


def refusal(what: str, extra: str, modules: Sequence[str] = REPORT) -> str | None:
    """The one line refusing `what` (a command) where a module of `modules` is missing, naming the extra that
    installs it; None where all are there."""
    gone = missing(modules)
    if not gone:
        return None
    return (f"{what} needs {' and '.join(gone)}, not installed in {sys.executable}: "
            f"pip install 'pdmctl[{extra}]'")  # fmt: skip
