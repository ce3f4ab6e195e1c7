"""Whose commit pdmctl records as its own: git is asked only about pdmctl's own clone. An installed package
(a wheel in a virtualenv, which may well sit inside the user's own git project) reports the commit its wheel
was built from, else "unknown", and never the commit or dirtiness of the project around it; provenance,
`pdmctl --version`, the report's header and the ledger's source commit all agree."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdmctl.provenance import SOURCE_DIR, git_state

ROOT = Path(__file__).resolve().parents[1]
BUILT = "0123456789abcdef0123456789abcdef01234567"
IGNORED = shutil.ignore_patterns("__pycache__", "_commit.json")  # a checkout's build files, never copied


def _git(directory: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "u", "GIT_AUTHOR_EMAIL": "u@example.org",
           "GIT_COMMITTER_NAME": "u", "GIT_COMMITTER_EMAIL": "u@example.org"}  # fmt: skip
    return subprocess.run(["git", "-C", str(directory), *args], capture_output=True, text=True, check=True,
                          env=env, timeout=60).stdout.strip()  # fmt: skip


def _users_project(tmp_path: Path, *, wheel_commit: str | None = None) -> tuple[Path, str]:
    """A user's git project with a commit and a modified tracked file, pdmctl's package copied into its
    virtualenv's site-packages (with a wheel's `_commit.json` when `wheel_commit`): the site-packages folder
    and the project's commit."""
    project = tmp_path / "myproj"
    python = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = project / ".venv" / "lib" / python / "site-packages"
    shutil.copytree(ROOT / "pdmctl", site / "pdmctl", ignore=IGNORED)
    if wheel_commit is not None:
        (site / "pdmctl" / "_commit.json").write_text(json.dumps({"commit": wheel_commit, "dirty": "no"}))
    (project / "pyproject.toml").write_text('[project]\nname = "myproj"\n')
    (project / "train.py").write_text("print('mine')\n")
    _git(project, "init", "-q")
    _git(project, "add", "pyproject.toml", "train.py")
    _git(project, "commit", "-q", "-m", "the user's own work")
    (project / "train.py").write_text("print('mine, modified')\n")  # the user's tree is dirty
    return site, _git(project, "rev-parse", "HEAD")


@pytest.mark.parametrize("wheel_commit", [None, BUILT], ids=["no-build-commit", "wheel-built-commit"])
def test_an_installed_package_inside_a_users_git_project_never_reports_that_projects_commit(
    tmp_path: Path, wheel_commit: str | None
) -> None:
    """git_state of site-packages inside a user's git project: the wheel's build commit, else "unknown"."""
    site, theirs = _users_project(tmp_path, wheel_commit=wheel_commit)
    state = git_state(site)
    assert state["commit"] != theirs
    if wheel_commit is None:
        assert state == {"commit": "unknown", "dirty": "unknown"}
    else:
        assert state == {"commit": BUILT, "dirty": "no"}


def test_every_place_that_names_the_commit_agrees_for_a_package_inside_a_users_project(
    tmp_path: Path,
) -> None:
    """Run from the copy (as an installed wheel runs): provenance, --version, the report's header and the
    ledger's source commit name the wheel's commit, or none, never the user's project's."""
    for wheel_commit in (None, BUILT):
        site, theirs = _users_project(tmp_path / str(wheel_commit), wheel_commit=wheel_commit)
        script = ("import json; from pdmctl import provenance; from pdmctl.usage import version_line; "
                  "from pdmctl.report.page import code_commit; "
                  "from pdmctl.ledger.records import submitting_commit; "
                  "print(json.dumps([str(provenance.SOURCE_DIR), provenance.collect({})['commit'], "
                  "provenance.collect({})['dirty'], version_line(), code_commit(), "
                  "submitting_commit()]))")  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(site)}
        done = subprocess.run([sys.executable, "-c", script], cwd=site.parents[3], capture_output=True,
                              text=True, env=env, timeout=300, check=False)  # fmt: skip
        assert done.returncode == 0, done.stderr
        source, commit, dirty, version, header, ledger = json.loads(done.stdout)
        assert Path(source) == site  # the copy ran, not this checkout
        assert theirs not in done.stdout and theirs[:12] not in done.stdout
        if wheel_commit is None:
            assert (commit, dirty, header, ledger) == ("unknown", "unknown", "unknown", None)
            assert "commit" not in version
        else:
            assert (commit, dirty, header, ledger) == (BUILT, "no", BUILT[:12], BUILT)
            assert f"(commit {BUILT[:12]})" in version


def test_pdmctls_own_clone_reports_its_head() -> None:
    """A checkout of pdmctl (this one) still reports its HEAD, from git."""
    if not (SOURCE_DIR / ".git").exists():
        pytest.skip("needs the git checkout")
    state = git_state()
    assert state["commit"] == _git(SOURCE_DIR, "rev-parse", "HEAD")
    assert state["dirty"] in ("yes", "no")


def test_a_clone_of_another_project_at_the_packages_parent_is_not_asked(tmp_path: Path) -> None:
    """The top of a git work tree whose pyproject.toml names another project is not pdmctl's clone."""
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "myproj"\n')
    shutil.copytree(ROOT / "pdmctl", tmp_path / "pdmctl", ignore=IGNORED)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "pyproject.toml")
    _git(tmp_path, "commit", "-q", "-m", "x")
    assert git_state(tmp_path) == {"commit": "unknown", "dirty": "unknown"}
