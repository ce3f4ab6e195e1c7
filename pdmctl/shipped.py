"""The documentation and scripts pdmctl's help and messages name (`docs/CLUSTER.md`, `scripts/engine-env.sh`),
wherever pdmctl is installed: `pdmctl docs [PATH]` prints where they are.

A help text or an error message names a file by its path in pdmctl's repository (`docs/CLUSTER.md`). A
checkout (an editable install) has it there; a wheel carries it as `pdmctl/_data/<path>` (setup.py copies
the Markdown of docs/ and the engine environment's script with its locks in), so every such name resolves
offline, with no repository or network at hand. The results' data, figures and CSV files under
docs/results/ stay in the repository; their pages ship.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

# what a wheel carries (setup.py's SHIPPED: the same folders and patterns), by folder of the repository
SHIPPED = {"docs": ("**/*.md",), "scripts": ("engine-env.sh", "engine-cuda.lock", "engine-cuda12.lock")}
_PACKAGE = Path(__file__).resolve().parent


def root() -> Path:
    """The folder that holds the shipped docs/ and scripts/: the wheel's `pdmctl/_data`, else the checkout."""
    bundled = _PACKAGE / "_data"
    return bundled if (bundled / "docs").is_dir() else _PACKAGE.parent


def files() -> list[str]:
    """Every shipped file by its repository path (`docs/CLUSTER.md`), sorted."""
    base = root()
    found = {p.relative_to(base).as_posix() for folder, patterns in SHIPPED.items() for pattern in patterns
             for p in (base / folder).glob(pattern) if p.is_file()}  # fmt: skip
    return sorted(found)


def locate(name: str) -> Path | None:
    """The installed file a help text or message names: a repository path (`docs/CLUSTER.md`,
    `scripts/engine-env.sh`), or a document's name alone (`CLUSTER.md`, `results/stress.md`); None where
    pdmctl does not ship it."""
    name = name.strip().strip("/")
    if not name or ".." in Path(name).parts:
        return None
    shipped = set(files())
    for candidate in (name, f"docs/{name}", f"scripts/{name}"):
        if candidate in shipped:
            return root() / candidate
    return None


def docs(
    path: Annotated[
        str | None,
        typer.Argument(metavar="[PATH]", help="A file that help or a message names: docs/CLUSTER.md, "
                       "scripts/engine-env.sh, or a document's name alone (CLUSTER.md)."),  # fmt: skip
    ] = None,
) -> None:
    """Print where pdmctl's documentation is: the folder of its Markdown docs, or with PATH that file's path
    (docs/… and scripts/… as help texts and messages name them), so that a wheel's user can read them."""
    from pdmctl.terminal import fail

    if path is None:
        print(root() / "docs")
        return
    found = locate(path)
    if found is None:
        fail(f"docs: {path}: not a file pdmctl ships (its docs: {root() / 'docs'}; the scripts: "
             f"{', '.join(f for f in files() if f.startswith('scripts/'))})")  # fmt: skip
    print(found)
