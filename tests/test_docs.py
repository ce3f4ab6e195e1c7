"""The documentation resolves: every Markdown link of README, CONTRIBUTING, CHANGELOG and docs/ names a file
that is there, every docs/results/ path the docs cite exists, and every docs/… or scripts/… file pdmctl's
help texts and messages name is one pdmctl ships (`pdmctl docs PATH` prints where; a wheel carries each as
pdmctl/_data/<path>: tests/test_package.py)."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

from pdmctl import shipped
from tests.conftest import pdmctl

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
RESULTS_PATH = re.compile(r"\bdocs/results/[^\s`'\"()\[\]]*")
CITED = re.compile(r"\b((?:docs|scripts)/[A-Za-z0-9_./-]*[A-Za-z0-9_])")


def _prose(page: Path) -> list[tuple[int, str]]:
    """The page's lines outside fenced code blocks, numbered."""
    lines, fenced = [], False
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def test_every_link_in_the_docs_resolves() -> None:
    broken = []
    for page in PAGES:
        for number, line in _prose(page):
            for match in LINK.finditer(re.sub(r"`[^`]*`", "", line)):  # a link in a code span is its text
                target = match.group(1)
                if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                    continue
                if not (page.parent / target.split("#")[0]).exists():
                    broken.append(f"{page.relative_to(ROOT)}:{number}: {target}")
    assert not broken, "links to files that are not there:\n" + "\n".join(broken)


def test_every_results_path_the_docs_cite_exists() -> None:
    """`docs/results/...` written out in prose or code (placeholders such as `<run>` or `kernel-*` aside)."""
    missing = []
    for page in [*PAGES, *sorted((ROOT / "pdmctl").rglob("*.py")), *sorted((ROOT / "tests").glob("*.py"))]:
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for match in RESULTS_PATH.finditer(line):
                cited = match.group(0).rstrip(".,;:")
                if not any(c in cited for c in "<*{$") and not (ROOT / cited).exists():
                    missing.append(f"{page.relative_to(ROOT)}:{number}: {cited}")
    assert not missing, "docs/results paths that are not there:\n" + "\n".join(missing)


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _help_texts() -> list[str]:
    """Every help text of the command line: each command's and group's help and epilog, each parameter's."""
    import typer.main

    from pdmctl.cli import app

    texts: list[str] = []

    def walk(command) -> None:  # type: ignore[no-untyped-def]
        texts.extend(t for t in (command.help, command.epilog, command.short_help) if isinstance(t, str))
        texts.extend(p.help for p in command.params if isinstance(getattr(p, "help", None), str))
        for sub in getattr(command, "commands", {}).values():
            walk(sub)

    walk(typer.main.get_command(app))
    return texts


@functools.cache
def cited_paths() -> dict[str, list[str]]:
    """Each docs/… or scripts/… path that a help text or a string in pdmctl's code (its messages; docstrings
    of modules and functions that are not commands aside) names, with where."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "pdmctl").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                for match in CITED.finditer(node.value):
                    found.setdefault(match.group(1), []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    for text in _help_texts():
        for match in CITED.finditer(text):
            found.setdefault(match.group(1), []).append("pdmctl --help")
    return found


def test_the_collector_finds_the_files_help_and_messages_name() -> None:
    cited = cited_paths()
    assert {"docs/CLUSTER.md", "docs/MATH.md", "scripts/engine-env.sh", "scripts/engine-cuda.lock"} <= set(cited)
    assert "pdmctl --help" in cited["docs/CLUSTER.md"]  # the top-level help's pointer to `pdmctl docs`


def test_every_file_help_and_messages_name_is_shipped_and_pdmctl_docs_finds_it() -> None:
    missing = {name: where for name, where in cited_paths().items() if shipped.locate(name) is None}
    assert not missing, "named in help or a message, and not shipped (pdmctl.shipped.SHIPPED):\n" + "\n".join(
        f"{name} ({', '.join(where)})" for name, where in sorted(missing.items()))
    for name in ("docs/CLUSTER.md", "scripts/engine-env.sh"):
        result = pdmctl("docs", name)
        assert result.returncode == 0 and Path(result.stdout.strip()) == shipped.locate(name), result


def test_pdmctl_docs_prints_the_folder_a_file_or_one_line() -> None:
    folder = pdmctl("docs")
    assert folder.returncode == 0 and Path(folder.stdout.strip()) == shipped.root() / "docs"
    assert (Path(folder.stdout.strip()) / "CLUSTER.md").is_file()
    by_name = pdmctl("docs", "results/stress.md")
    assert Path(by_name.stdout.strip()) == shipped.root() / "docs" / "results" / "stress.md"
    for unknown in ("scripts/gpu-check.sh", "docs/NOPE.md", "../setup.py"):
        result = pdmctl("docs", unknown)
        lines = result.stderr.strip().splitlines()
        assert (result.returncode, result.stdout, len(lines)) == (2, "", 1), result
        assert lines[0].startswith(f"error: docs: {unknown}: not a file pdmctl ships"), result


def test_an_installed_package_finds_its_own_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a wheel's layout (pdmctl/_data/docs beside the package) the package's copy is read, not a checkout's."""
    package = tmp_path / "site-packages" / "pdmctl"
    for name in ("docs/CLUSTER.md", "docs/results/stress.md", "scripts/engine-env.sh"):
        (package / "_data" / name).parent.mkdir(parents=True, exist_ok=True)
        (package / "_data" / name).write_text("x")
    monkeypatch.setattr(shipped, "_PACKAGE", package)
    assert shipped.root() == package / "_data"
    assert shipped.files() == ["docs/CLUSTER.md", "docs/results/stress.md", "scripts/engine-env.sh"]
    assert shipped.locate("CLUSTER.md") == package / "_data" / "docs" / "CLUSTER.md"
    assert shipped.locate("engine-env.sh") == package / "_data" / "scripts" / "engine-env.sh"
    assert shipped.locate("docs/MATH.md") is None
