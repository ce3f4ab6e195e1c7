"""The build step that ships the top-level YAML folders inside the package.

configs/, sweeps/, clusters/ and reports/ stay at the repository's top level (where a checkout and an
editable install read them); a wheel carries them as `pdmctl/_data/<folder>` (pdmctl.resources finds them
there), and with them the files pdmctl's help and messages name: the Markdown of docs/ and the engine
environment's script with its locks, as `pdmctl/_data/docs/...` and `pdmctl/_data/scripts/...`
(pdmctl.shipped; `pdmctl docs PATH` prints where each is). A wheel also carries `pdmctl/_commit.json`, the commit it was built from and whether the tree was
dirty then (pdmctl.provenance reads it: an installed package asks git nothing, since the git project around
site-packages is the user's, not pdmctl's); an sdist carries the same file for the wheel built from it.
Everything else about the package is declared in pyproject.toml.
"""

import json
import os
import subprocess
import tomllib
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

ROOT = Path(__file__).resolve().parent
# the same folders and patterns as pdmctl.resources.PATTERNS (reports/ also holds rendered reports)
DATA = {"configs": "**/*.yaml", "sweeps": "*.yaml", "clusters": "*.yaml", "reports": "*.yaml"}
# the same folders and patterns as pdmctl.shipped.SHIPPED
SHIPPED = {"docs": ("**/*.md",), "scripts": ("engine-env.sh", "engine-cuda.lock", "engine-cuda12.lock")}
COMMIT_FILE = "_commit.json"  # pdmctl.provenance.COMMIT_FILE's name


def _git(*args):
    try:
        done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=60,
                              check=False, env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"})  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def build_commit():
    """The commit the package is built from: of pdmctl's own clone when ROOT is its top (never that of a git
    project around it), else the one an sdist carries; None when neither is known."""
    try:
        name = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"]
    except (OSError, ValueError, KeyError, TypeError):
        name = None
    own = name == "pdmctl" and (ROOT / ".git").exists()
    top = _git("rev-parse", "--show-toplevel") if own else None
    if top is not None and Path(top).resolve() == ROOT:
        commit = _git("rev-parse", "HEAD")
        status = _git("status", "--porcelain", "--untracked-files=no")
        if commit:
            return {"commit": commit, "dirty": "unknown" if status is None else ("yes" if status else "no")}
        return None
    try:  # an sdist's (written by SdistWithCommit below)
        return json.loads((ROOT / "pdmctl" / COMMIT_FILE).read_text())
    except (OSError, ValueError):
        return None


def write_commit(package_dir):
    commit = build_commit()
    if commit is not None:
        Path(package_dir).mkdir(parents=True, exist_ok=True)
        (Path(package_dir) / COMMIT_FILE).write_text(json.dumps(commit) + "\n")


class BuildWithData(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):  # an editable install reads the checkout's folders
            return
        patterns = list(DATA.items())
        patterns += [(folder, pattern) for folder, names in SHIPPED.items() for pattern in names]
        for folder, pattern in patterns:
            source = ROOT / folder
            for path in sorted(source.glob(pattern)):
                if path.is_file():
                    target = Path(self.build_lib, "pdmctl", "_data", folder, path.relative_to(source))
                    self.mkpath(str(target.parent))
                    self.copy_file(str(path), str(target))
        write_commit(Path(self.build_lib, "pdmctl"))


class SdistWithCommit(sdist):
    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        write_commit(Path(base_dir, "pdmctl"))


setup(cmdclass={"build_py": BuildWithData, "sdist": SdistWithCommit})
