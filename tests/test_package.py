"""pdmctl as a package: the wheel carries the config tree, sweep files, cluster profiles and report
definitions; they are found along a search path (the working directory, the user's folder, the package's);
`pdmctl init` copies the defaults out for editing and never overwrites."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from pdmctl import resources, shipped
from tests.conftest import pdmctl
from tests.test_docs import cited_paths

ROOT = Path(__file__).resolve().parents[1]
DATA_FOLDERS = ("configs", "sweeps", "clusters", "reports")


def _tracked(*paths: str) -> list[str]:
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--", *paths], capture_output=True,
                         check=True).stdout.decode()  # fmt: skip
    return [p for p in out.split("\0") if p and (ROOT / p).is_file()]


@pytest.fixture(scope="module")
def wheel_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tracked files alone, committed in a git repository of their own (as a clean clone holds them)."""
    if not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout (the tracked files are what a clone holds)")
    source = tmp_path_factory.mktemp("clone")
    for rel in _tracked():
        (source / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, source / rel)
    env = {**os.environ, "GIT_AUTHOR_NAME": "ci", "GIT_AUTHOR_EMAIL": "ci@localhost", "GIT_COMMITTER_NAME": "ci",
           "GIT_COMMITTER_EMAIL": "ci@localhost"}  # fmt: skip
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "--no-verify", "-m", "the tracked files"]):
        subprocess.run(["git", "-C", str(source), *args], check=True, capture_output=True, env=env, timeout=120)
    return source


@pytest.fixture(scope="module")
def wheel(wheel_source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built from `wheel_source` (as from a clean clone), with this environment's setuptools."""
    source = wheel_source
    out = tmp_path_factory.mktemp("dist")
    try:  # this environment's setuptools when it is new enough for pyproject.toml, else pip's isolated build
        local = int(metadata.version("setuptools").split(".")[0]) >= 77
    except metadata.PackageNotFoundError:
        local = False
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *(["--no-build-isolation"] if local else []),
                    "-q", "-w", str(out), str(source)], check=True, capture_output=True, timeout=600)  # fmt: skip
    (built,) = out.glob("pdmctl-*.whl")
    return built


def test_the_wheel_carries_every_tracked_yaml_file_as_package_data(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    want = {f"pdmctl/_data/{p}" for p in _tracked(*DATA_FOLDERS) if p.endswith(".yaml")}
    assert {"pdmctl/_data/configs/run.yaml", "pdmctl/_data/clusters/local.yaml",
            "pdmctl/_data/sweeps/paper-main.yaml", "pdmctl/_data/reports/default.yaml"} <= want  # fmt: skip
    assert want <= names, sorted(want - names)
    docs = {f"pdmctl/_data/{p}" for p in _tracked("docs", "scripts")
            if p.endswith(".md") or p.removeprefix("scripts/") in shipped.SHIPPED["scripts"]}  # fmt: skip
    # nothing else (no rendered reports, no results data): the YAML, the Markdown of docs/ and the engine's script
    assert {n for n in names if n.startswith("pdmctl/_data/")} == want | docs
    assert "pdmctl/resources.py" in names


def test_the_wheel_carries_every_file_help_and_messages_name(wheel: Path) -> None:
    """A wheel's user reads what help texts and messages name (`pdmctl docs PATH` prints where): each docs/… and
    scripts/… path they cite is in the wheel as pdmctl/_data/<path>, engine-env.sh with the locks it reads."""
    names = set(zipfile.ZipFile(wheel).namelist())
    cited = set(cited_paths())
    assert {"docs/CLUSTER.md", "scripts/engine-env.sh"} <= cited
    missing = sorted(p for p in cited if f"pdmctl/_data/{p}" not in names)
    assert not missing, missing
    assert {"pdmctl/_data/scripts/engine-cuda.lock", "pdmctl/_data/scripts/engine-cuda12.lock",
            "pdmctl/_data/docs/results/stress.md", "pdmctl/shipped.py"} <= names  # fmt: skip


def test_the_wheel_carries_the_commit_it_was_built_from(wheel: Path, wheel_source: Path) -> None:
    """pdmctl/_commit.json names the clone's HEAD (clean): what an installed pdmctl reports as its commit."""
    head = subprocess.run(["git", "-C", str(wheel_source), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip
    recorded = json.loads(zipfile.ZipFile(wheel).read("pdmctl/_commit.json"))
    assert recorded == {"commit": head, "dirty": "no"}


def _shipped_file(kind: str, name: str) -> Path:
    path = resources.package_dir(kind) / name
    assert path.is_file(), path
    return path


def test_the_working_directory_wins_then_the_user_folder_then_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work, user = tmp_path / "work", tmp_path / "xdg"
    monkeypatch.chdir(work.mkdir() or work)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(user))
    for env in resources.ENV.values():
        monkeypatch.delenv(env, raising=False)
    assert resources.find("clusters", "local") == _shipped_file("clusters", "local.yaml")
    (user / "pdmctl" / "clusters").mkdir(parents=True)
    (user / "pdmctl" / "clusters" / "local.yaml").write_text("name: local\nexecutor: local\n")
    (user / "pdmctl" / "clusters" / "mine.yaml").write_text("name: mine\nexecutor: local\n")
    assert resources.find("clusters", "local") == user / "pdmctl" / "clusters" / "local.yaml"
    (work / "clusters").mkdir()
    (work / "clusters" / "local.yaml").write_text("name: local\nexecutor: local\n")
    assert resources.find("clusters", "local") == work / "clusters" / "local.yaml"
    assert resources.find("clusters", "mine") == user / "pdmctl" / "clusters" / "mine.yaml"
    assert {"local", "mine", "h20"} <= set(resources.known("clusters"))
    assert resources.find("clusters", "nosuch") is None
    # the config tree is taken whole: a folder without run.yaml is not one
    (work / "configs").mkdir()
    assert resources.config_dir() == resources.package_dir("configs")
    (work / "configs" / "run.yaml").write_text("seed: 0\n")
    assert resources.config_dir() == work / "configs"


def test_the_environment_names_one_folder_that_replaces_the_search(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDMCTL_SWEEP_DIR", str(tmp_path))
    assert resources.search_path("sweeps") == [tmp_path]
    assert resources.find("sweeps", "paper-main") is None


def test_init_copies_the_defaults_and_a_sweep_reads_the_copies(workdir: Path) -> None:
    res = pdmctl("init", "--help", cwd=workdir)
    assert res.returncode == 0
    res = pdmctl("init", cwd=workdir, env={"XDG_CONFIG_HOME": str(workdir / "xdg")})
    assert res.returncode == 0, res.stdout + res.stderr
    shipped = [(kind, rel) for kind, _, rel in resources.default_files()]
    assert shipped and all((workdir / kind / rel).is_file() for kind, rel in shipped)
    assert (workdir / "configs" / "run.yaml").read_text() == _shipped_file("configs", "run.yaml").read_text()
    assert f"copied {len(shipped)} file(s)" in res.stdout
    # the copies are what pdmctl reads now: a sweep file edited here is found by name
    (workdir / "sweeps" / "mine.yaml").write_text("name: mine\ngrid:\n  delta: [0.05, 0.1]\n  backend: synthetic\n"
                                                  "  model: synthetic\n")  # fmt: skip
    dry = pdmctl("sweep", "--file", "mine", "--dry-run", cwd=workdir, env={"COLUMNS": "300"})
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "sweep mine: 2 run(s)" in dry.stdout, dry.stdout


def test_init_refuses_to_overwrite_and_writes_nothing(workdir: Path) -> None:
    (workdir / "clusters").mkdir()
    (workdir / "clusters" / "local.yaml").write_text("mine\n")
    res = pdmctl("init", str(workdir), cwd=workdir)
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"init: {workdir / 'clusters' / 'local.yaml'} already exists" in res.stderr, res.stderr
    assert (workdir / "clusters" / "local.yaml").read_text() == "mine\n"
    assert sorted(p.name for p in workdir.iterdir()) == ["clusters"]  # no configs/, sweeps/, reports/
    assert [p.name for p in (workdir / "clusters").iterdir()] == ["local.yaml"]
