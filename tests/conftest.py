"""Shared fixtures: a fresh working directory per test, pdmctl run as a user runs it."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

# short toy runs for orchestration tests: the training itself is tested in test_toy_*
FAST = ["backend.steps=6", "backend.eval_every=3", "backend.checkpoint_every=3", "backend.prompts_per_step=16"]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path


def pdmctl(*args: str, cwd: Path | None = None, timeout: float = 600, env: dict | None = None) -> Result:
    """Run the CLI in a subprocess, as a user would."""
    full_env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    full_env.update({"COLUMNS": "200", **(env or {})})
    proc = subprocess.run(
        [sys.executable, "-m", "pdmctl.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
        env=full_env,
    )  # fmt: skip
    return Result(proc.returncode, proc.stdout, proc.stderr)


def sqlite_uri(path: Path) -> str:
    return f"sqlite:///{path / 'mlflow.db'}"


def stage_model(directory: Path, preset: str, parameters: int | None = None) -> Path:
    """A model directory of a VeRL preset's shape, as a cluster stages it: a config naming the preset's
    architecture, a tokenizer, and one safetensors file whose header declares the preset's parameters
    (`parameters` to change that) in bf16, with the bytes it declares. The file is whole where the staged
    weights' check samples it (random bytes at each of `sampled_regions`) and sparse elsewhere, so that a
    30B model's copy takes no disk: what a sampling check can see of it is a downloaded copy."""
    import json
    import struct

    from pdmctl.backends.verl.offline import sampled_regions
    from pdmctl.backends.verl.presets import MODEL_PRESETS

    shape = MODEL_PRESETS[preset]
    count = shape.parameters if parameters is None else parameters
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"architectures": [shape.architecture]}))
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (directory / file).write_text("{}")
    header = json.dumps({"model.weight": {"dtype": "BF16", "shape": [count], "data_offsets": [0, 2 * count]}}).encode()
    weights = directory / "model.safetensors"
    with open(weights, "wb") as fh:
        fh.write(struct.pack("<Q", len(header)) + header)
        fh.truncate(8 + len(header) + 2 * count)
        for start, end in sampled_regions(8 + len(header), 8 + len(header) + 2 * count):
            os.pwrite(fh.fileno(), os.urandom(end - start), start)
    return directory



def cut_time_limit_to_the_minute_after_next(job_id: str) -> None:
    """A running SLURM job's limit set to the minute after next of its elapsed time: with a
    `signal_delay_s` of 120 s its USR2 is due at once (slurmctld sends it at its next check, within
    30 s), a minute or more before the limit itself, as a job nearing its limit on a cluster gets it."""
    def run(*args: str) -> str:
        return subprocess.run(list(args), capture_output=True, text=True, timeout=60, check=True).stdout

    used = run("squeue", "-h", "-j", job_id, "-o", "%M").strip().split(":")  # [[D-]H:]M:SS
    minutes = int(used[-2]) + 60 * int(used[-3].split("-")[-1] if len(used) > 2 else 0)
    run("scontrol", "update", f"jobid={job_id}", f"TimeLimit={minutes + 2}")

# CI installs and starts everything the tests need (verl, SLURM, PostgreSQL, Chromium), so there a
# skip can only mean a broken setup: with PDMCTL_NO_SKIPS=1 (set by .ci/run) every skip fails.
NO_SKIPS = os.environ.get("PDMCTL_NO_SKIPS") == "1"


def _fail_skip(report) -> None:
    if NO_SKIPS and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped, but PDMCTL_NO_SKIPS=1 (CI has everything installed): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_skip(outcome.get_result())



# --- two lanes (scripts/test.sh) ------------------------------------------------------------------
# The tests that use the one-node SLURM of .ci/slurm_up.sh share its queue and its slots: two of them at
# once can break an assertion about what runs when (8 jobs overlapping, a requeue's next attempt). They
# get the `cluster` mark and run one at a time in one process; everything else runs in a second process
# beside it. A test is `cluster` when it is marked `slurm` or its code, or a fixture it asks for, names
# SLURM's commands or a cluster profile. Misplacing a test the other way costs time, not correctness.
_CLUSTER_WORDS = re.compile(r"slurm|sbatch|squeue|sacct|scontrol|srun|sinfo|write_profile|--cluster|clusters/")


def _mentions_the_cluster(item: pytest.Item) -> bool:
    fn = getattr(item, "function", None)
    sources = [fn] if fn is not None else []
    fixtures = getattr(item, "_fixtureinfo", None)
    for name in fixtures.names_closure if fixtures is not None else ():
        for fixdef in fixtures.name2fixturedefs.get(name, ()):
            sources.append(fixdef.func)
    for obj in sources:
        try:
            if _CLUSTER_WORDS.search(inspect.getsource(obj).lower()):
                return True
        except (OSError, TypeError):
            continue
    return False


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("slurm") is not None or _mentions_the_cluster(item):
            item.add_marker(pytest.mark.cluster)
