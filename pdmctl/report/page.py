"""The HTML pages of `pdmctl report` and `pdmctl report --tune`: Jinja2 templates under pdmctl/templates/
(one stylesheet, one header), and what every page's header says: pdmctl's version, its commit, the store."""

from __future__ import annotations

import functools
from pathlib import PurePosixPath
from urllib.parse import urlparse

import jinja2

from pdmctl import __version__
from pdmctl.provenance import git_state


@functools.cache
def environment() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.PackageLoader("pdmctl", "templates"), autoescape=True,
                              undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)  # fmt: skip


def render(template: str, **context: object) -> str:
    return environment().get_template(template).render(**context)


def store_name(uri: str) -> str:
    """The store as a reader can name it, without this machine's directories or any credentials:
    `mlflow.db (sqlite)`, `mlruns (file)`, `db.example.org:5432/mlflow (postgresql)`, `http://host:5000`."""
    parsed = urlparse(uri)
    scheme = parsed.scheme.split("+")[0]
    if scheme in ("", "file", "sqlite"):
        name = PurePosixPath(parsed.path).name or uri
        return f"{name} ({scheme or 'file'})"
    host = parsed.hostname or ""
    if parsed.port:
        host += f":{parsed.port}"
    if scheme in ("http", "https"):
        return f"{scheme}://{host}{parsed.path.rstrip('/')}"
    return f"{host}{parsed.path} ({scheme})"


@functools.cache
def code_commit() -> str:
    """The commit of the pdmctl drawing the page (`provenance.git_state`: its own clone's, else the one its
    wheel was built from, else `unknown`), `-dirty` appended where its tracked files differed from it."""
    state = git_state()
    commit = state["commit"][:12] if state["commit"] != "unknown" else "unknown"
    return commit + ("-dirty" if state["dirty"] == "yes" else "")


def header(uri: str) -> dict[str, str]:
    """What every page's header names: pdmctl's version and commit, and the store."""
    return {"version": __version__, "commit": code_commit(), "store": store_name(uri)}
