"""VeRL across the two SLURM nodes of .ci/slurm_multi_up.sh (n1, n2), for real on CPU.

`pdmctl sweep backend=verl model=qwen3-tiny backend.nnodes=2 --cluster clusters/slurm-multi.yaml`: the
job body starts Ray's head on n1 and a worker on n2 (srun), VeRL 0.9.1 trains the tiny Qwen3 with
`trainer.nnodes=2`, one actor rank and one vLLM rollout server per node (gloo between the ranks), and
the run's metrics reach the MLflow ledger on the shared directory.

Run with the engine environment's Python, on the running 2-node cluster (marked `multinode_engine`,
left out of every other run): `bash scripts/ci-multinode.sh --engine ENV_DIR`.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.test_slurm_multinode import PROFILE, SHARED, SLURM_CONF, _cluster_answers, node_slurmd_pid, slurm

ENGINE_ENV = importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("verl") is not None
STEPS = 2  # training steps: enough for a weight sync after an update and a second rollout on both nodes
SWEEP_TIMEOUT_S = 900

pytestmark = [
    pytest.mark.multinode_engine,
    pytest.mark.skipif(not ENGINE_ENV, reason="needs the engine environment: bash scripts/engine-env.sh DIR"),
    pytest.mark.skipif(
        not _cluster_answers(), reason="no 2-node SLURM here (start it with .ci/slurm_multi_up.sh)"
    ),
]

_ANNOUNCE = re.compile(r"pdmctl: (actor rank (\d+) of (\d+) (initialised|trained a batch)|rollout server (\S+) generates)"
                       r" on (n\d+) \(pid \d+\)")  # fmt: skip  (topk.announce)


def _node_processes(node: str) -> list[str]:
    """`pid command` of every live process in the node's PID namespace but its slurmd (PID 1 there).
    Zombies do not count: slurmd, the node's init, does not reap the orphans it inherits."""
    slurmd = node_slurmd_pid(node)
    ns = os.readlink(f"/proc/{slurmd}/ns/pid")
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == slurmd:
            continue
        try:
            zombie = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
            if os.readlink(entry / "ns" / "pid") == ns and not zombie:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{entry.name} {command[:120]}")
        except OSError:
            continue
    return found


@contextlib.contextmanager
def _machine_engine_lock(wait_s: float = 300):
    """This machine's one-engine-job-at-a-time lock (cpu.machine_lock), taken here: the job takes the
    lock of its node's private /tmp, which other engine jobs on this machine do not see."""
    from pdmctl.backends.verl import cpu

    with cpu.LOCK_PATH.open("a") as handle:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail(f"another engine job held {cpu.LOCK_PATH} for {wait_s:.0f} s")
                time.sleep(2)
        yield


def _used_gb() -> float:
    """Machine memory in use (MemTotal - MemAvailable), GB: both nodes share this machine's."""
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return (int(fields["MemTotal"].split()[0]) - int(fields["MemAvailable"].split()[0])) / 1e6


class _PeakMemory(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.before = self.peak = _used_gb()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(1.0):
            self.peak = max(self.peak, _used_gb())


@pytest.mark.timeout(SWEEP_TIMEOUT_S + 300 + 120)  # the sweep, the lock's wait, the checks
def test_verl_trains_across_two_nodes_with_its_metrics_in_the_ledger() -> None:
    from mlflow.tracking import MlflowClient

    from pdmctl import orchestrate

    root = SHARED / "tests" / f"verl-{uuid.uuid4().hex[:10]}"
    root.mkdir(parents=True)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    name = f"v{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env.update({"SLURM_CONF": SLURM_CONF, "COLUMNS": "200",
                # the tiny model on storage both nodes see (CI builds it once; a bare run builds its own)
                "PDMCTL_TINY_DIR": os.environ.get("PDMCTL_TINY_DIR") or str(root / "tiny"),
                # two Ray nodes starting on 2 shared cores: more than the default 120 s to come up
                "PDMCTL_RAY_WAIT_S": "300"})  # fmt: skip
    with _machine_engine_lock():
        memory = _PeakMemory()
        memory.start()
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "pdmctl.cli", "sweep", "backend=verl", "model=qwen3-tiny", "mask=pdm_agg",
             "k=5", "backend.nnodes=2", f"backend.total_training_steps={STEPS}", "--name", name, "--cluster",
             PROFILE, "--tracking-uri", uri, "--wait"],
            capture_output=True, text=True, timeout=SWEEP_TIMEOUT_S, cwd=root, env=env,
        )  # fmt: skip
        elapsed = time.monotonic() - started
        memory.done.set()
    os.environ["SLURM_CONF"] = SLURM_CONF  # this process's SLURM clients (sacct, orchestrate.status)
    ctx = orchestrate.make_context(PROFILE, uri)
    (view,) = orchestrate.status(ctx, name)
    log_path = Path(view.record.run_dir) / "logs" / "attempt-1.log"
    log = log_path.read_text(errors="replace") if log_path.exists() else ""
    print(f"\n2-node VeRL sweep: {elapsed:.0f} s, job {view.record.job_id}, {view.state}; machine memory in use "
          f"{memory.before:.1f} GB before, {memory.peak:.1f} GB at the peak")
    print("\n".join(line for line in log.splitlines() if "Ray node(s) up" in line or _ANNOUNCE.search(line)))
    assert proc.returncode == 0, proc.stdout + proc.stderr + log[-6000:]
    assert view.state == orchestrate.RunState.FINISHED, (view.state, view.record.reason, log[-6000:])

    # the job held both nodes and started Ray on both
    assert slurm("sacct", "-n", "-P", "-X", "-o", "NodeList", "-j", view.record.job_id).split() == ["n[1-2]"]
    assert "pdmctl: 2 Ray node(s) up" in log, log[-6000:]
    assert "trainer.nnodes=2" in log or "'nnodes': 2" in log, log[-6000:]
    # VeRL placed an actor rank on each node, both trained, and each node's vLLM server generated
    found = [m.groups() for m in _ANNOUNCE.finditer(log)]
    initialised = {(rank, world, node) for _, rank, world, what, _, node in found if what == "initialised"}
    trained = {(rank, world, node) for _, rank, world, what, _, node in found if what == "trained a batch"}
    rollout = {node for _, rank, _, _, server, node in found if server is not None}
    assert {w for _, w, _ in initialised} == {"2"}, found  # a world of 2 actor ranks
    assert sorted(n for _, _, n in initialised) == ["n1", "n2"], found  # one per node
    assert sorted(r for r, _, _ in initialised) == ["0", "1"], found
    assert trained == initialised, found
    assert rollout == {"n1", "n2"}, found

    # the metrics in the ledger, every step once
    client = MlflowClient(uri)
    run = client.get_run(view.record.run_id)
    assert run.info.status == "FINISHED"
    for metric in run.data.metrics:
        steps = [m.step for m in client.get_metric_history(run.info.run_id, metric)]
        assert len(steps) == len(set(steps)), f"{metric}: steps {sorted(steps)}"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/mask_frac")) == [1, 2]

    # nothing of the job is left on either node once it has ended
    deadline = time.monotonic() + 60
    while (left := {n: _node_processes(n) for n in ("n1", "n2")}) != {"n1": [], "n2": []}:
        assert time.monotonic() < deadline, f"processes left after the job: {left}"
        time.sleep(2)
