"""The login node's install (`pip install pdmctl`, no extras): what works without scipy, matplotlib and torch,
and how what needs them refuses.

Each command runs in a subprocess whose import system raises for scipy, matplotlib and torch as it does where
they are not installed; scripts/ci-wheel.sh runs the same commands in a virtualenv of the wheel without them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("scipy", "matplotlib", "torch")

# the CLI (or, with -c, a snippet) with scipy, matplotlib and torch not importable
WITHOUT_EXTRAS = """
import runpy, sys
BLOCKED = {blocked!r}
class Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Missing())
if sys.argv[1:2] == ["-c"]:
    exec(sys.argv[2])
else:
    sys.argv = ["pdmctl", *sys.argv[1:]]
    runpy.run_module("pdmctl.cli", run_name="__main__")
"""


def login_node(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    return subprocess.run([sys.executable, "-c", WITHOUT_EXTRAS.format(blocked=BLOCKED), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300, env={**env, "COLUMNS": "200"})  # fmt: skip


def test_the_login_node_plans_and_reads_status_without_scipy_matplotlib_or_torch(tmp_path: Path) -> None:
    """A dry run (with a design for a deadline, its detectable difference left to the [report] extra) and the
    status of an empty ledger work; the modules of submitting, following, resuming and cancelling import."""
    plan = login_node("sweep", "delta=0.05", "seeds=3", "--dry-run", "--days", "3", cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    assert "it fits as it is" in plan.stdout
    assert "compared pairwise on 3 seeds, the difference it detects: pip install 'pdmctl[report]'" in plan.stdout
    status = login_node("status", cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    modules = ("pdmctl.orchestrate", "pdmctl.added_seeds", "pdmctl.shell.status", "pdmctl.shell.waiting",
               "pdmctl.budget.design", "pdmctl.budget.spent", "pdmctl.tune.study", "pdmctl.api")  # fmt: skip
    code = f"import importlib\nfor m in {modules!r}: importlib.import_module(m)\nprint('imported')"
    done = login_node("-c", code, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "imported", done.stderr


@pytest.mark.parametrize(
    ("args", "needs", "extra"),
    [
        (("report",), "scipy and matplotlib", "report"),
        (("report", "--tune", "study"), "matplotlib", "report"),
        (("seeds",), "scipy", "report"),
        (("analyze",), "torch and scipy", "testbed"),
        (("analyze", "--figures", "figs"), "torch and scipy and matplotlib", "testbed"),
    ],
)
def test_a_command_whose_extra_is_missing_refuses_in_one_line_naming_it(tmp_path: Path, args, needs, extra) -> None:
    """Exit 2, one line on stderr naming the missing packages and the extra's pip command, no traceback, nothing
    written (no ledger, no report folder)."""
    done = login_node(*args, cwd=tmp_path)
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"error: pdmctl {args[0]} needs {needs}, not installed in ")
    assert lines[0].endswith(f": pip install 'pdmctl[{extra}]'")
    assert done.stdout == "" and list(tmp_path.iterdir()) == []


def test_the_python_api_report_without_the_extra_raises_bad_input_naming_it(tmp_path: Path) -> None:
    code = ("from pdmctl import api\n"
            "try:\n    api.report(['default'])\n"
            "except api.BadInput as exc:\n    print(exc)\n")  # fmt: skip
    done = login_node("-c", code, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith("api.report needs scipy and matplotlib, not installed in ")
    assert done.stdout.strip().endswith(": pip install 'pdmctl[report]'")


def test_the_core_install_has_no_report_package_and_the_extras_that_report_bring_them() -> None:
    """[report] is scipy and matplotlib; [testbed] (the quickstart's sweep and report) and [dev] bring the same
    requirements; `pip install pdmctl` alone brings neither (scripts/ci-wheel.sh measures its size)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]

    def names(requirements):
        return {r.split(">")[0].split("=")[0].split("<")[0].split("[")[0].split(";")[0].strip() for r in requirements}

    assert names(extras["report"]) == {"scipy", "matplotlib"}
    assert not names(project["dependencies"]) & set(BLOCKED)
    for extra in ("testbed", "dev"):
        assert set(extras["report"]) <= set(extras[extra]), extra
