"""The SLURM executor's `states` where sacct and slurmctld disagree: a job requeued after a node failure
(no SLURM needed: sacct's and squeue's answers are stood in)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdmctl.executors import JobState
from pdmctl.executors import slurm as slurm_mod
from pdmctl.executors.base import ClusterProfile
from pdmctl.executors.slurm import SlurmExecutor


def _executor(tmp_path: Path) -> SlurmExecutor:
    return SlurmExecutor(ClusterProfile(name="t", executor="slurm", workdir=str(tmp_path), options={}))


@pytest.mark.parametrize(
    ("sacct", "squeue", "expected"),
    [  # requeued after losing a node: sacct's NODE_FAIL until slurmctld has requeued it, squeue says so
        ("4|NODE_FAIL\n7|COMPLETED\n", "4|COMPLETING\n", JobState.RUNNING),
        ("4|NODE_FAIL\n7|COMPLETED\n", "4|REQUEUED\n", JobState.REQUEUED),
        ("4|NODE_FAIL\n7|COMPLETED\n", "4|PENDING\n", JobState.PENDING),
        ("4|PREEMPTED\n7|COMPLETED\n", "4|PENDING\n", JobState.PENDING),
        # not requeued (--no-requeue): both say NODE_FAIL, or slurmctld forgot it
        ("4|NODE_FAIL\n7|COMPLETED\n", "4|NODE_FAIL\n", JobState.NODE_FAIL),
        ("4|NODE_FAIL\n7|COMPLETED\n", "", JobState.NODE_FAIL),
    ],
)  # fmt: skip
def test_a_requeued_node_failure_is_not_an_ending(
    tmp_path: Path, monkeypatch, sacct, squeue, expected
) -> None:
    asked: list[list[str]] = []

    def fake_run(cmd: list[str], *, what: str, check: bool = True) -> str:
        asked.append(cmd)
        return sacct if cmd[0] == "sacct" else squeue

    monkeypatch.setattr(slurm_mod, "_run", fake_run)
    states = _executor(tmp_path).states(["4", "7"])
    assert states == {"4": expected, "7": JobState.COMPLETED}
    assert [c[0] for c in asked] == ["sacct", "squeue"] and "4" in asked[1]  # only the NODE_FAIL job asked


def test_no_squeue_call_when_sacct_knows_every_ending(tmp_path: Path, monkeypatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(slurm_mod, "_run", lambda cmd, **kw: calls.append(cmd[0]) or "7|COMPLETED\n")
    assert _executor(tmp_path).states(["7"]) == {"7": JobState.COMPLETED} and calls == ["sacct"]
