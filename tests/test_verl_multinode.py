"""VeRL across the two SLURM nodes of .ci/slurm_multi_up.sh (n1, n2), for real on CPU, through the preflight.

`pdmctl preflight backend=verl model=qwen3-tiny backend.nnodes=2 --steps 2 --cluster clusters/slurm-multi.yaml`:
the preflight's one job (one setting, one mask method) starts Ray's head on n1 and a worker on n2 (srun),
VeRL 0.9.1 trains the tiny Qwen3 with `trainer.nnodes=2`, one actor rank and one vLLM rollout server per
node (gloo between the ranks), a checkpoint after every step, and the run's metrics reach the MLflow ledger
on the shared directory.

The preflight's kill here is the harshest a run meets: n2 is lost once step 1 is checkpointed. The first
attempt is held still there (`PDMCTL_VERL_HOLD_AT_STEP=1`, before the preflight's own USR2 requeue, which
the one-node engine test proves: whatever this machine's speed, the loss finds it training), n2's slurmd,
PID 1 of its node's PID namespace, is SIGKILLed, and every process of the node goes with it, as in a crash.
SLURM sees the node down after SlurmdTimeout and requeues the job (or it fails, and `pdmctl resume` of the
preflight's sweep brings it back). Where VeRL placed its driver (TaskRunner) on n2, the trainer fails at
once and the job writes FAILED into its run before SLURM requeues it: the run is queued while SLURM holds
its job, and the same preflight command waits for it (`orchestrate.run_state`); n2 is started again, and the
next attempt starts Ray on both nodes again and resumes from VeRL's checkpoint (through the checkpoint
guard) into the same MLflow run, every step logged once. An attempt that loses a node SLURM never saw fail
requeues itself (`pdmctl.job.requeue_after_node_loss`): seen here when SLURM's delayed kill of the lost
attempt's Ray step on n2 reached the next attempt's step of the same id once n2 was back; the run then
finishes at a later attempt. The preflight's verdict names the setting ok with its measurements, and the
sweep's dry run then costs the setting from them. One scenario (two engine starts, ~10 min here) serves
every test of the module.

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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.test_slurm_multinode import (
    ENDED_BY_A_LOST_NODE,
    PROFILE,
    SHARED,
    SLURM_CONF,
    UP,
    _cluster_answers,
    node_processes,
    node_slurmd_pid,
    node_state,
    slurm,
    wait_for,
    wait_for_the_job_to_lose,
)

ENGINE_ENV = importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("verl") is not None
STEPS = 2  # the preflight's steps: enough for a weight sync after an update and a second rollout on both nodes
SWEEP_TIMEOUT_S = 900

pytestmark = [
    pytest.mark.multinode_engine,
    pytest.mark.skipif(not ENGINE_ENV, reason="needs the engine environment: bash scripts/engine-env.sh DIR"),
    pytest.mark.skipif(
        not _cluster_answers(), reason="no 2-node SLURM here (start it with .ci/slurm_multi_up.sh)"
    ),
]

_ANNOUNCE = re.compile(r"pdmctl: (actor rank (\d+) of (\d+) (initialised|trained a batch)|rollout server (\S+) generates)"
                       r" on (n\d+) \(pid \d+\)")  # fmt: skip  (patches.announce)


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


@dataclass
class TwoNodeRun:
    root: Path
    uri: str
    view: object  # orchestrate.RunView at the end
    job_id: str
    outcome: str  # what SLURM made of the lost node: a requeue (PENDING/REQUEUED...) or NODE_FAIL/FAILED
    logs: dict[str, str]  # attempt-N.log -> text
    first_sweep: subprocess.CompletedProcess  # the preflight's submission
    wait_sweep: subprocess.CompletedProcess  # the same command with --wait: its verdict
    dry_run: subprocess.CompletedProcess  # the sweep's dry run once the preflight has ended
    left: dict[str, list[str]]  # the nodes' processes once the job ended


def _wait_for_log(path: Path, text: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        content = path.read_text(errors="replace") if path.exists() else ""
        if text in content or time.monotonic() > deadline:
            return content
        time.sleep(1)


@pytest.fixture(scope="module")
def two_node_run() -> Iterator[TwoNodeRun]:
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
                "PDMCTL_RAY_WAIT_S": "300",
                # the first attempt stays at step 1 (checkpointed) until n2 is lost; the next never holds
                "PDMCTL_VERL_HOLD_AT_STEP": "1", "PDMCTL_VERL_HOLD_S": "600"})  # fmt: skip
    os.environ["SLURM_CONF"] = SLURM_CONF  # this process's SLURM clients (sacct, orchestrate.status)
    setting = ["backend=verl", "model=qwen3-tiny", "mask=pdm_agg", "k=5", "backend.nnodes=2", "--name", name,
               "--cluster", PROFILE, "--tracking-uri", uri]  # fmt: skip
    pdmctl = [sys.executable, "-m", "pdmctl.cli"]
    sweep = [*pdmctl, "preflight", *setting, "--steps", str(STEPS)]
    ctx = orchestrate.make_context(PROFILE, uri)
    preflight_name = f"{name}.preflight"
    with _machine_engine_lock():
        memory = _PeakMemory()
        memory.start()
        started = time.monotonic()
        first = subprocess.run(sweep, capture_output=True, text=True, timeout=300, cwd=root, env=env)
        assert first.returncode == 0, first.stdout + first.stderr
        (view,) = orchestrate.status(ctx, preflight_name)
        job_id, run_dir = view.record.job_id, Path(view.record.run_dir)
        attempt_1 = run_dir / "logs" / "attempt-1.log"
        log = _wait_for_log(attempt_1, "pdmctl: held at step 1", SWEEP_TIMEOUT_S)
        assert "pdmctl: held at step 1" in log, log[-6000:]
        held_after = time.monotonic() - started
        killed_at = time.monotonic()
        try:
            os.kill(node_slurmd_pid("n2"), 9)  # n2 crashes: its slurmd is its PID namespace's init
            outcome = wait_for_the_job_to_lose(job_id, "n2", 180)
            lost_after = time.monotonic() - killed_at
            # the job's attempt ends on n1 too (SLURM kills its steps: Ray's head, the trainer, vLLM)
            wait_for(lambda: not node_processes("n1"), 180, "the job's processes on n1 to end",
                     lambda: str(node_processes("n1")))  # fmt: skip
            ended_after = time.monotonic() - killed_at
        finally:
            subprocess.run([str(UP)], check=True, timeout=180, capture_output=True)  # n2 back, whatever happened
        print(f"\n2-node VeRL: held at step 1 after {held_after:.0f} s; n2 killed: job {job_id} {outcome} "
              f"{lost_after:.0f} s later, its processes on n1 gone after {ended_after:.0f} s")  # fmt: skip
        if outcome in ENDED_BY_A_LOST_NODE:
            resumed = subprocess.run([*pdmctl, "resume", preflight_name, "--cluster", PROFILE, "--tracking-uri", uri],
                                     capture_output=True, text=True, timeout=300, cwd=root, env=env)  # fmt: skip
            assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        restarted = time.monotonic()
        # the same command again: it submits nothing (the run is queued or running) and waits for its end
        waited = subprocess.run([*sweep, "--wait"], capture_output=True, text=True, timeout=SWEEP_TIMEOUT_S,
                                cwd=root, env=env)  # fmt: skip
        memory.done.set()
    (view,) = orchestrate.status(ctx, preflight_name)
    dry_run = subprocess.run([*pdmctl, "sweep", *setting, "--dry-run"], capture_output=True, text=True, timeout=300,
                             cwd=root, env=env)  # fmt: skip
    logs = {p.name: p.read_text(errors="replace") for p in (run_dir / "logs").glob("attempt-*.log")}
    print(f"2-node VeRL: the next attempt finished {time.monotonic() - restarted:.0f} s after n2 came back "
          f"({time.monotonic() - started:.0f} s in all), {view.state}; machine memory in use "
          f"{memory.before:.1f} GB before, {memory.peak:.1f} GB at the peak")  # fmt: skip
    for attempt, text in sorted(logs.items()):
        print(f"-- {attempt}")
        print("\n".join(line for line in text.splitlines()
                        if "Ray node(s) up" in line or _ANNOUNCE.search(line) or "global_step_" in line))  # fmt: skip
    deadline = time.monotonic() + 60
    while (left := {n: node_processes(n) for n in ("n1", "n2")}) != {"n1": [], "n2": []}:
        if time.monotonic() > deadline:
            break
        time.sleep(2)
    yield TwoNodeRun(root, uri, view, job_id, outcome, logs, first, waited, dry_run, left)


def _what_happened(run: TwoNodeRun) -> str:
    """The second sweep's output, the run's state and reason, and every attempt's last lines, in order."""
    tails = "".join(f"\n-- {name} (its last lines)\n{run.logs[name][-4000:]}" for name in sorted(run.logs))
    record = run.view.record
    return (f"{run.wait_sweep.stdout}{run.wait_sweep.stderr}\nrun {record.run_id}: {run.view.state}, attempt "
            f"{record.attempt}, reason {record.reason!r}; SLURM made of the lost node: {run.outcome}{tails}")


def _placement(log: str) -> tuple[set, set, set]:
    found = [m.groups() for m in _ANNOUNCE.finditer(log)]
    initialised = {(rank, world, node) for _, rank, world, what, _, node in found if what == "initialised"}
    trained = {(rank, world, node) for _, rank, world, what, _, node in found if what == "trained a batch"}
    rollout = {node for _, rank, _, _, server, node in found if server is not None}
    return initialised, trained, rollout


def _assert_on_both_nodes(log: str) -> None:
    assert "pdmctl: 2 Ray node(s) up" in log, log[-6000:]
    assert "trainer.nnodes=2" in log or "'nnodes': 2" in log, log[-6000:]
    # VeRL placed an actor rank on each node, both trained, and each node's vLLM server generated
    initialised, trained, rollout = _placement(log)
    assert {w for _, w, _ in initialised} == {"2"}, initialised  # a world of 2 actor ranks
    assert sorted(n for _, _, n in initialised) == ["n1", "n2"], initialised  # one per node
    assert sorted(r for r, _, _ in initialised) == ["0", "1"], initialised
    assert trained == initialised, (trained, initialised)
    assert rollout == {"n1", "n2"}, rollout


@pytest.mark.timeout(2 * SWEEP_TIMEOUT_S + 300 + 900)  # two attempts, the lock's wait, the node's loss
def test_verl_trains_across_two_nodes(two_node_run: TwoNodeRun) -> None:
    log = two_node_run.logs.get("attempt-1.log", "")
    # the job held both nodes and started Ray on both
    assert slurm("sacct", "-n", "-P", "-X", "-o", "NodeList", "-j", two_node_run.job_id).split() == ["n[1-2]"]
    _assert_on_both_nodes(log)
    assert "pdmctl: held at step 1" in log, log[-6000:]


def test_losing_a_node_mid_training_requeues_and_the_next_attempt_resumes_from_the_checkpoint(
    two_node_run: TwoNodeRun,
) -> None:
    from pdmctl import orchestrate

    run, logs = two_node_run, two_node_run.logs
    assert run.wait_sweep.returncode == 0, _what_happened(run)
    assert run.view.state == orchestrate.RunState.FINISHED, _what_happened(run)
    attempts = run.view.record.attempt
    assert attempts >= 2 and set(logs) == {f"attempt-{n}.log" for n in range(1, attempts + 1)}, _what_happened(run)
    for n in range(2, attempts):  # an attempt between: it lost a node SLURM never saw fail, and requeued itself
        assert "pdmctl job: node lost: " in logs[f"attempt-{n}.log"], _what_happened(run)
        assert "pdmctl job: requeued job " in logs[f"attempt-{n}.log"], _what_happened(run)
    last = logs[f"attempt-{attempts}.log"]
    _assert_on_both_nodes(last)  # Ray on both nodes again, an actor rank and a rollout server on each
    assert re.search(r"global_step_\d", last), last[-6000:]  # VeRL resumed from a checkpoint
    # through the checkpoint guard: VeRL's files read as weights only, nothing refused
    assert "pdmctl: checkpoint files load as weights only (first: " in last and ": refused: " not in last, last[-6000:]
    assert all("held at step" not in logs[f"attempt-{n}.log"] for n in range(2, attempts + 1)), _what_happened(run)
    assert node_state("n2") in ("idle", "mix", "alloc", "comp"), node_state("n2")


def test_the_run_is_in_the_ledger_with_every_step_once(two_node_run: TwoNodeRun) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(two_node_run.uri)
    run = client.get_run(two_node_run.view.record.run_id)
    assert run.info.status == "FINISHED", _what_happened(two_node_run)
    for metric in run.data.metrics:
        steps = [m.step for m in client.get_metric_history(run.info.run_id, metric)]
        assert len(steps) == len(set(steps)), f"{metric}: steps {sorted(steps)}"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/mask_frac")) == [1, 2]
    # the preflight evaluates at its end only; each attempt's start-up to its first step is measured
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/aime24")] == [STEPS]
    first_steps = [m.step for m in client.get_metric_history(run.info.run_id, "pdmctl/first_step_s")]
    assert first_steps[0] == 1 and len(first_steps) >= 2, first_steps


def test_the_preflights_verdict_is_ok_and_the_sweeps_dry_run_costs_the_setting_from_its_measurements(
    two_node_run: TwoNodeRun,
) -> None:
    """The preflight's line for the 2-node setting: ok, both steps, resumed from step 1's checkpoint, with the
    measured start-up and step time; the sweep's dry run of the same setting then rests on that preflight
    (the profile states no throughput for the tiny model: without it there would be no cost at all)."""
    out = two_node_run.wait_sweep.stdout
    (verdict,) = [line for line in out.splitlines() if line.startswith("  ")] or [out]
    assert verdict.startswith("  ok    qwen3-tiny "), _what_happened(two_node_run)
    for said in (f"steps 1-{STEPS} in ", "requeued after step 1 and resumed from its checkpoint", "first step after ",
                 "the resumed attempt's after ", "a step ", "a checkpoint "):  # fmt: skip
        assert said in verdict, verdict
    dry = two_node_run.dry_run
    assert dry.returncode == 0, dry.stdout + dry.stderr
    text = " ".join(dry.stdout.split())
    assert "rests on preflight " in text and ".preflight's 1 run(s) of this setting" in text, dry.stdout[-3000:]
    assert "measured a step of " in text, dry.stdout[-3000:]


def test_nothing_of_the_job_is_left_on_either_node(two_node_run: TwoNodeRun) -> None:
    assert two_node_run.left == {"n1": [], "n2": []}, f"processes left after the job: {two_node_run.left}"
