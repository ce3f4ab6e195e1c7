"""The multi-node job body on a real (1-node) SLURM: Ray starts inside the allocation, a probe task reaches it."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("verl")

from pdmctl.backends.verl import jobbody, launch

pytestmark = [pytest.mark.verl, pytest.mark.slurm]


@pytest.mark.skipif(shutil.which("sinfo") is None, reason="no SLURM here (sinfo absent)")
@pytest.mark.parametrize("stray_token", [False, True], ids=["no-ray-token", "stray-ray-token"])
def test_job_body_starts_ray_and_the_probe_reaches_it(tmp_path: Path, stray_token: bool) -> None:
    """With and without a ~/.ray/auth_token of the user's (Ray >= 2.52 turns token auth on when one
    exists): the job's own HOME makes the test independent of what this machine's ~/.ray holds."""
    home = tmp_path / "home"
    if stray_token:
        (home / ".ray").mkdir(parents=True)
        (home / ".ray" / "auth_token").write_text("a-token-of-another-cluster\n")
    else:
        home.mkdir()
    run = {"model": "qwen3-4b-base", "checkpoint_dir": str(tmp_path / "ckpt"), "data_dir": str(tmp_path)}
    cmd = jobbody.build_job_command(run, python=sys.executable)
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    cmd[1:1] = [f"HOME={home}", f"{launch.PROBE_ENV}=1", "PDMCTL_GPUS_PER_NODE=0", f"PDMCTL_RAY_TMP={ray_tmp}",
                "PDMCTL_RAY_HEAD_IP=127.0.0.1", "PDMCTL_RAY_WAIT_S=120"]  # fmt: skip
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n" + shlex.join(cmd) + "\n")
    log = tmp_path / "job.log"
    subprocess.run(
        ["sbatch", "--wait", "--nodes=1", "--ntasks=1", "--cpus-per-task=2", f"--output={log}", str(script)],
        check=False,
        timeout=600,
    )
    # the job's Ray ended with its `ray start` step (no `ray stop`, which would end every Ray here)
    leftover = subprocess.run(["pgrep", "-f", ray_tmp], capture_output=True, text=True).stdout.split()
    shutil.rmtree(ray_tmp, ignore_errors=True)
    text = log.read_text() if log.exists() else ""
    assert "PDMCTL_PROBE_OK" in text and "nodes=1" in text, text[-4000:]
    assert not leftover, (leftover, text[-4000:])


@pytest.mark.skipif(shutil.which("sinfo") is None, reason="no SLURM here (sinfo absent)")
def test_a_failed_ray_start_ends_the_job_fast_and_stops_ray(tmp_path: Path) -> None:
    """The head's `ray start` fails (an invalid port): the job ends in well under 2 minutes
    (not at the wait's timeout, not at the stall watchdog's 30 minutes), with the reason
    in its output and no Ray process of the job left."""
    import time

    run = {"model": "qwen3-tiny", "checkpoint_dir": str(tmp_path / "ckpt"), "data_dir": str(tmp_path)}
    cmd = jobbody.build_job_command(run, python=sys.executable)
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    cmd[1:1] = [f"HOME={tmp_path}", f"{launch.PROBE_ENV}=1", "PDMCTL_GPUS_PER_NODE=0", f"PDMCTL_RAY_TMP={ray_tmp}",
                "PDMCTL_RAY_HEAD_IP=127.0.0.1", "PDMCTL_RAY_PORT=99999", "PDMCTL_RAY_WAIT_S=300"]  # fmt: skip
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n" + shlex.join(cmd) + "\n")
    log = tmp_path / "job.log"
    started = time.monotonic()
    proc = subprocess.run(
        ["sbatch", "--wait", "--nodes=1", "--ntasks=1", "--cpus-per-task=2", f"--output={log}", str(script)],
        check=False, timeout=600,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    text = log.read_text() if log.exists() else ""
    assert proc.returncode != 0, text[-4000:]
    assert "a Ray node step ended while the cluster was starting" in text, text[-4000:]
    assert elapsed < 120, (elapsed, text[-4000:])
    leftover = subprocess.run(["pgrep", "-f", ray_tmp], capture_output=True, text=True).stdout.split()
    shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not leftover, leftover
