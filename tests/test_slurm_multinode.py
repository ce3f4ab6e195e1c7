"""The SLURM path on a real 2-node cluster (.ci/slurm_multi_up.sh: nodes n1, n2, each a slurmd in its own
network, UTS, mount and PID namespace) through the `slurm-multi` profile, toy backend; and the VeRL job
body on both nodes with stand-ins for Ray and the trainer (the address Ray binds, what an attempt leaves).

Run apart (marked `multinode`, left out of the default run): scripts/ci-multinode.sh starts the
cluster, runs this file and tears it down. Every test is bounded in time; the node-loss test kills
n2's slurmd (PID 1 of its node) and starts it again with the same script.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shlex
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest

REPO = Path(__file__).resolve().parents[1]
SLURM_CONF = "/etc/slurm-pdm-multi/slurm.conf"
SHARED = Path("/srv/pdm-multi")  # visible on both nodes (their /tmp is private)
RUN = Path("/run/pdm-multi")
PROFILE = str(REPO / "clusters" / "slurm-multi.yaml")
UP = REPO / ".ci" / "slurm_multi_up.sh"
# a short toy run: eval every 2 steps, a checkpoint every 2 steps, tiny batches (as tests/test_slurm.py)
TOY = ["backend.eval_every=2", "backend.checkpoint_every=2", "backend.prompts_per_step=8",
       "backend.eval_samples=2", "backend.group_size=4"]  # fmt: skip


def _cluster_answers() -> bool:
    if shutil.which("sinfo") is None or not Path(SLURM_CONF).exists():
        return False
    try:
        proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, timeout=20,
                              env={**os.environ, "SLURM_CONF": SLURM_CONF})  # fmt: skip
    except subprocess.TimeoutExpired:
        return False
    return proc.returncode == 0 and {"n1", "n2"} <= set(proc.stdout.split())


pytestmark = [
    pytest.mark.multinode,
    pytest.mark.skipif(
        not _cluster_answers(), reason="no 2-node SLURM here (start it with .ci/slurm_multi_up.sh)"
    ),
]


@pytest.fixture(autouse=True)
def _multi_cluster(monkeypatch) -> None:
    """Every SLURM client in these tests (ours, submitit's, pdmctl's) talks to the 2-node cluster."""
    monkeypatch.setenv("SLURM_CONF", SLURM_CONF)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


@pytest.fixture(scope="module")
def _module_dir() -> Path:
    """One directory (and so one SQLite ledger: a new one takes minutes on a loaded 2-core machine) on the
    shared storage for this module's tests; pytest's tmp_path is under each node's private /tmp."""
    path = SHARED / "tests" / uuid.uuid4().hex[:10]
    path.mkdir(parents=True)
    return path


@pytest.fixture
def shared_dir(_module_dir: Path) -> Iterator[Path]:
    yield _module_dir


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def slurm(*args: str, timeout: float = 60) -> str:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, check=True).stdout


def node_slurmd_pid(node: str) -> int:
    """The node's slurmd as the root PID namespace sees it: the child of the `unshare` the script started."""
    outer = (RUN / f"node-{node}.pid").read_text().strip()
    children = Path(f"/proc/{outer}/task/{outer}/children").read_text().split()
    assert children, f"node {node}: no slurmd under {outer}"
    return int(children[0])


def node_processes(node: str) -> list[str]:
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


def node_state(node: str) -> str:
    return slurm("sinfo", "-h", "-N", "-n", node, "-o", "%t").strip()


def job_field(job_id: str, name: str) -> str:
    out = slurm("scontrol", "show", "job", job_id)
    for word in out.split():
        key, _, value = word.partition("=")
        if key == name:
            return value
    return ""


def wait_for(check: Callable[[], object], timeout: float, what: str, detail: Callable[[], str] = str):
    deadline = time.time() + timeout
    while not (value := check()):
        if time.time() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}: {detail()}")
        time.sleep(0.5)
    return value


ENDED_BY_A_LOST_NODE = ("NODE_FAIL", "FAILED", "CANCELLED")  # else SLURM requeued it (Restarts >= 1)


def wait_for_the_job_to_lose(job_id: str, node: str, timeout: float) -> str:
    """The job's state once it has lost `node`: requeued (Restarts >= 1, whatever its state then) or
    ended (one of ENDED_BY_A_LOST_NODE: `pdmctl resume` brings such a run back)."""

    def lost() -> str:
        state = job_field(job_id, "JobState")
        restarts = int(job_field(job_id, "Restarts") or 0)
        return state if (restarts >= 1 or state in ENDED_BY_A_LOST_NODE) else ""

    return wait_for(lost, timeout, f"the job to lose {node}",
                    lambda: f"{job_field(job_id, 'JobState')} {node}={node_state(node)}")  # fmt: skip


def _job_logs(ctx) -> str:
    logs = (
        sorted(ctx.run_root.glob("*/*/logs/*.log"))[-4:]
        + sorted((ctx.run_root / ".slurm").glob("*.out"))[-2:]
    )
    return "\n".join(f"--- {p}\n{p.read_text()[-1500:]}" for p in logs)


def wait_for_runs(ctx, sweep: str, done, timeout: float, what: str):
    from pdmctl import orchestrate

    deadline = time.time() + timeout
    while True:
        views = orchestrate.status(ctx, sweep)
        if views and done(views):
            return views
        if time.time() > deadline:
            table = "; ".join(f"{v.key} {v.state} job={v.record.job_id if v.record else None} "
                              f"step={v.record.step if v.record else None}" for v in views)  # fmt: skip
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}: {table}\n{_job_logs(ctx)}")
        time.sleep(1.0)


def two_finished_toy_runs(shared_dir: Path, *overrides: str):
    """`pdmctl sweep` of seeds 0 and 1 of a short toy run through the profile, waited for until both have
    ended; both must have FINISHED. Returns (tracking URI, context, the runs' views)."""
    from pdmctl import orchestrate

    uri = f"sqlite:///{shared_dir / 'mlflow.db'}"
    name = f"m{uuid.uuid4().hex[:8]}"
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "pdmctl"), "sweep", *TOY, *overrides, "seed=0,1",
         "--name", name, "--cluster", PROFILE, "--tracking-uri", uri],
        capture_output=True, text=True, timeout=420, cwd=shared_dir,  # a new SQLite store: ~2 min on a loaded machine
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ctx = orchestrate.make_context(PROFILE, uri)
    views = wait_for_runs(ctx, name, lambda vs: all(v.state not in orchestrate.ACTIVE for v in vs), 300,
                          "2 finished runs")  # fmt: skip
    assert [v.state for v in views] == [orchestrate.RunState.FINISHED] * 2, [(v.key, v.state) for v in views]
    return uri, ctx, views


def assert_complete_history(uri: str, run_id: str, steps: int, eval_every: int = 2) -> None:
    """Every step of every metric once: train/* at 1..steps, eval/* at 0, eval_every, ..., steps."""
    from pdmctl.ledger import open_ledger

    hist = open_ledger(uri).metric_histories([run_id])[run_id]
    train = [k for k in hist if k.startswith("train/")]
    evals = [k for k in hist if k.startswith("eval/")]
    assert "train/reward" in train and {"eval/toy24", "eval/toy25"} <= set(evals), sorted(hist)
    for key in train:
        assert [s for s, _ in hist[key]] == list(range(1, steps + 1)), key
    for key in evals:
        assert [s for s, _ in hist[key]] == sorted({*range(0, steps + 1, eval_every), steps}), key


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_two_node_job_runs_its_steps_on_both_nodes(shared_dir: Path) -> None:
    # one task per node; each says which node, address, PID namespace, PID 1 and /tmp it sees
    out = shared_dir / "probe.out"  # the only test writing here
    probe = ('echo "$SLURM_NODEID $(hostname) $(hostname --ip-address) $(readlink /proc/self/ns/pid) '
             '$(cat /proc/1/comm) $(readlink /proc/self/ns/net)"; touch /tmp/probe-$SLURM_JOB_ID-$(hostname); '
             'ls /tmp | grep -c "^probe-$SLURM_JOB_ID-"')  # fmt: skip
    script = shared_dir / "probe.sh"
    script.write_text(f"#!/bin/bash\nsrun -N2 --ntasks-per-node=1 bash -c '{probe}'\n")
    slurm("sbatch", "--wait", "--nodes=2", "--ntasks-per-node=1", "--time=2", "-J", "pdmctl-probe",
          "-o", str(out), "-D", str(shared_dir), str(script), timeout=90)  # fmt: skip
    lines = [ln.split() for ln in out.read_text().splitlines() if ln.strip()]
    rows = [ln for ln in lines if len(ln) == 6]
    counts = [ln[0] for ln in lines if len(ln) == 1]
    assert len(rows) == 2, out.read_text()
    by_node = {r[1]: r for r in rows}
    assert set(by_node) == {"n1", "n2"}, rows  # distinct hostnames
    assert {by_node["n1"][2], by_node["n2"][2]} == {"10.77.0.11", "10.77.0.12"}, rows  # distinct addresses
    assert by_node["n1"][3] != by_node["n2"][3], rows  # distinct PID namespaces
    assert by_node["n1"][5] != by_node["n2"][5], rows  # distinct network namespaces
    assert {r[4] for r in rows} == {"slurmd"}, rows  # slurmd is PID 1 of each node
    assert counts == ["1", "1"], out.read_text()  # each node's /tmp holds only its own file


@pytest.mark.timeout(180)
def test_a_clone_under_tmp_and_its_environment_are_seen_by_every_node(shared_dir: Path) -> None:
    """A clone under /tmp once called <clone>/.venv/bin/python3 in its job scripts and every run was LOST,
    each node's private /tmp hiding it. A clone under /tmp with its own virtualenv, the cluster script run from
    that clone: a 2-node job runs the clone's Python on both nodes, reads the clone's files, and each node's
    /tmp is still its own. The cluster is put back as it was (this checkout's script) afterwards."""
    import tempfile

    clone = Path(tempfile.mkdtemp(prefix="pdmctl-clone-", dir="/tmp"))
    try:
        subprocess.run(["git", "clone", "-q", "--shared", str(REPO), str(clone)], check=True, timeout=60)
        shutil.copy2(UP, clone / ".ci" / "slurm_multi_up.sh")  # this checkout's script, committed or not
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(clone / ".venv")], check=True, timeout=60)
        marker = uuid.uuid4().hex
        (clone / "marker").write_text(marker)
        alone = {k: v for k, v in os.environ.items() if k != "PDM_MULTI_KEEP"}  # the clone's paths only
        up = subprocess.run(["bash", str(clone / ".ci" / "slurm_multi_up.sh")], capture_output=True, text=True,
                            timeout=120, env=alone)  # fmt: skip
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"kept on the nodes: {clone}" in up.stdout, up.stdout
        inner = shared_dir / "clone-probe-task.sh"
        inner.write_text(
            "#!/bin/bash\n"
            f"seen=$({clone}/.venv/bin/python3 -c 'import sys; print(open(sys.argv[1]).read())' {clone}/marker)\n"
            f"others=$(ls -A /tmp | grep -vcx '{clone.name}')\n"
            'echo "$(hostname) $seen $others"\n'
        )
        script = shared_dir / "clone-probe.sh"
        script.write_text(f"#!/bin/bash\nsrun -N2 --ntasks-per-node=1 bash {inner}\n")
        out = shared_dir / "clone-probe.out"
        slurm("sbatch", "--wait", "--nodes=2", "--ntasks-per-node=1", "--time=2", "-J", "pdmctl-clone-probe",
              "-o", str(out), "-D", str(shared_dir), str(script), timeout=90)  # fmt: skip
        rows = sorted(ln.split() for ln in out.read_text().splitlines() if ln.strip())
        # both nodes ran the clone's Python on the clone's file; nothing else of the host's /tmp is there
        assert rows == [["n1", marker, "0"], ["n2", marker, "0"]], out.read_text()
    finally:
        back = subprocess.run(["bash", str(UP)], capture_output=True, text=True, timeout=120)
        shutil.rmtree(clone, ignore_errors=True)
        assert back.returncode == 0, back.stdout + back.stderr


@pytest.mark.timeout(900)
def test_a_toy_sweep_through_the_profile_finishes_with_its_metrics_in_the_ledger(shared_dir: Path) -> None:
    from pdmctl.executors import JobState, make_executor

    uri, ctx, views = two_finished_toy_runs(shared_dir, "backend.steps=4")
    for v in views:
        assert v.record.attempt == 1
        assert_complete_history(uri, v.record.run_id, steps=4)
        # the job held both nodes; its body ran on the first
        assert slurm("sacct", "-n", "-P", "-X", "-o", "NodeList", "-j", v.record.job_id).split() == ["n[1-2]"]
        log = (Path(v.record.run_dir) / "logs" / "attempt-1.log").read_text()
        assert " on n1, restart 0" in log and "pdmctl job: finished" in log, log[-2000:]
    executor = make_executor(ctx.profile)
    wait_for(lambda: set(executor.states([v.record.job_id for v in views]).values()) == {JobState.COMPLETED},
             60, "COMPLETED in sacct")  # fmt: skip


def test_runs_of_one_node_run_two_at_a_time_on_the_two_node_profile(shared_dir: Path) -> None:
    """A setting of one node on a profile of 2-node jobs (as a 4B run on one 8-GPU node of a 4-node profile):
    backend.nnodes=1 sends its runs as an array of 1-node jobs whose %-limit packs two into each 2-node share.
    Both run at the same time, each job holds one node, and both finish with every step once."""
    from datetime import datetime


    uri, _, views = two_finished_toy_runs(shared_dir, "backend.steps=6", "backend.nnodes=1")
    spans = []
    for v in views:
        assert v.record.attempt == 1
        assert_complete_history(uri, v.record.run_id, steps=6)

        def accounted(job_id: str = v.record.job_id) -> list[str] | None:  # slurmdbd records the end a moment later
            fields = slurm("sacct", "-n", "-P", "-X", "-o", "NodeList,AllocNodes,Start,End,State", "-j", job_id).split("|")
            return fields[:4] if len(fields) == 5 and fields[4].strip() == "COMPLETED" else None

        nodelist, alloc, start, end = wait_for(accounted, 60, f"job {v.record.job_id} COMPLETED in sacct")
        assert nodelist in ("n1", "n2") and alloc == "1", (nodelist, alloc)
        spans.append((datetime.fromisoformat(start), datetime.fromisoformat(end)))
    (a_start, a_end), (b_start, b_end) = spans
    assert a_start < b_end and b_start < a_end, f"the two jobs did not run at the same time: {spans}"


@pytest.mark.timeout(900)
def test_losing_a_node_mid_run_requeues_and_resumes_from_the_checkpoint(shared_dir: Path) -> None:
    """n2's slurmd is SIGKILLed mid-training (its node's processes go with it, as in a crash). SLURM sees
    the node down after SlurmdTimeout (20 s), requeues the job (JobRequeue=1, --requeue) and kills its
    batch step on n1; the job waits for 2 nodes. n2 is started again: the job's next attempt resumes
    from the checkpoint into the same MLflow run, every step logged once. A job that ended NODE_FAIL
    instead of being requeued is brought back by `pdmctl resume`.

    The ~35 s until SLURM acts would let a fast machine train to the end; to make the test independent
    of this machine's speed (and of its load), the run is held still once it has a checkpoint: the test
    takes the SQLite store's write lock, so the job waits at its next metric (a busy store is waited
    out, not lost) until SLURM kills it. The lock is let go once the job's processes are gone."""
    from mlflow import MlflowClient

    from pdmctl import grid, orchestrate

    steps = 400
    db = shared_dir / "mlflow.db"
    uri = f"sqlite:///{db}"
    name = f"m{uuid.uuid4().hex[:8]}"
    ctx = orchestrate.make_context(PROFILE, uri)
    _, (job_id,) = orchestrate.sweep(grid.expand([*TOY, f"backend.steps={steps}"], None, name), ctx)
    (view,) = wait_for_runs(ctx, name, lambda vs: (vs[0].record.step or 0) >= 4, 300, "step 4")
    assert job_field(job_id, "NodeList") == "n[1-2]"
    run_id, run_dir = view.record.run_id, Path(view.record.run_dir)
    wait_for(lambda: any((run_dir / "checkpoints").glob("step_*.pt")), 60, "a checkpoint")
    step0 = Path(urlparse(MlflowClient(uri).get_run(run_id).info.artifact_uri).path)
    step0 = step0 / "per_problem" / "toy24" / "step_0000000.json"
    step0_mtime = step0.stat().st_mtime

    def job_processes() -> list[str]:  # the job's processes on n1 (the root PID namespace sees them all)
        found = []
        for proc in Path("/proc").glob("[0-9]*"):
            with contextlib.suppress(OSError):
                if str(run_dir) in (proc / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(proc.name)
        return found

    store = sqlite3.connect(db, isolation_level=None, timeout=30)
    store.execute("BEGIN IMMEDIATE")
    locked = True
    killed_at = time.time()
    try:
        os.kill(node_slurmd_pid("n2"), signal.SIGKILL)

        # the node is declared down after SlurmdTimeout; the job is requeued (or fails with NODE_FAIL)
        outcome = wait_for_the_job_to_lose(job_id, "n2", 120)
        lost_after = time.time() - killed_at
        wait_for(
            lambda: not job_processes(), 60, "the job's processes on n1 to end", lambda: str(job_processes())
        )
        store.execute("ROLLBACK")
        locked = False
        print(f"\nnode loss: job {job_id} {outcome} {lost_after:.0f} s after the kill, its processes gone "
              f"after {time.time() - killed_at:.0f} s; n2 {node_state('n2')}")  # fmt: skip
        (view,) = orchestrate.status(ctx, name)
        assert (view.record.step or 0) < steps, view.record  # it was still training
    finally:
        if locked:
            store.execute("ROLLBACK")
        store.close()
        # n2 back, whatever happened (the next tests and the next CI run need it)
        subprocess.run([str(UP)], check=True, timeout=120, capture_output=True)
    restarted_at = time.time()
    if outcome in ENDED_BY_A_LOST_NODE:
        chosen, new_ids = orchestrate.resume(ctx, name)
        assert [v.key for v in chosen] == [view.key] and len(new_ids) == 1, (chosen, new_ids)

    (view,) = wait_for_runs(ctx, name, lambda vs: vs[0].state not in orchestrate.ACTIVE, 600, "the run's end")
    assert view.state == orchestrate.RunState.FINISHED, (view.state, view.record.reason, _job_logs(ctx))
    assert view.record.attempt == 2, view.record
    assert_complete_history(uri, run_id, steps=steps)  # complete, every step once
    assert step0.stat().st_mtime == step0_mtime  # attempt 2 started at its checkpoint, not at step 0
    attempt_2 = (run_dir / "logs" / "attempt-2.log").read_text()
    assert " on n1, restart " in attempt_2, attempt_2[-2000:]
    records = slurm("sacct", "-n", "-P", "-X", "-D", "-o", "JobID,State,NodeList", "-j", job_id).split()
    print(
        f"node loss: n2 back and the run finished {time.time() - restarted_at:.0f} s later; sacct: {records}"
    )
    assert node_state("n2") in ("idle", "mix", "alloc", "comp"), node_state("n2")


# ---------------------------------------------------------------------------
# The VeRL job body on both nodes, with stand-ins for Ray and the trainer (the engine is not run): which
# address each node's Ray binds, and what an attempt leaves on its nodes.
# The job body, its srun steps, the address resolver and the cleanup are the real ones.
# ---------------------------------------------------------------------------

# The job's `ray`: records its node and arguments, and (LEAVE_ENGINE_CORE=1) leaves behind what a vLLM
# engine core is to a job once Ray's worker, its parent, has exited: a process in a session of its own
# (no process-group signal reaches it), reparented to the node's init (so not in the step's process
# tree: the step's end does not reach it), named VLLM::EngineCore_DP0, ignoring SIGTERM. It carries the job's
# environment (and so its engine tag), as vLLM's processes do.
STAND_IN_RAY = r"""#!/bin/bash
echo "$(hostname) $*" >> "$(dirname "$0")/../../ray-starts"
if [ "${LEAVE_ENGINE_CORE:-0}" = 1 ]; then  # ( ... & ): its parent exits at once, as a Ray worker does
  ( setsid bash -c 'exec -a VLLM::EngineCore_DP0 "$0" -c "$1" "$2"' "$REAL_PYTHON" "$ENGINE_CORE" "$CORE_MARKER" \
    </dev/null >/dev/null 2>&1 & )
fi
sleep 1000 &
trap 'kill $!; exit 0' TERM
wait
"""
# The job's Python: the real one, but for waiting on Ray and the trainer (which says what it sees)
STAND_IN_PYTHON = r"""#!/bin/bash
case "$*" in
  *wait-ray*) echo "pdmctl: 2 Ray node(s) up" ;;
  *" train "*) echo "trainer on $(hostname): RAY_ADDRESS=$RAY_ADDRESS" ;;
  *) exec "$REAL_PYTHON" "$@" ;;
esac
"""
ENGINE_CORE = ("import ctypes, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
               "ctypes.CDLL(None).prctl(15, b'VLLM::EngineCor', 0, 0, 0); time.sleep(600)")  # fmt: skip
# the job: what `pdmctl.job` does for a VeRL run of a GPU model (jobbody.run), the stand-ins as its Python
RUN_JOB = """import sys
from pdmctl.backends.verl import jobbody
try:
    jobbody.run({"model": "qwen3-4b-base", "checkpoint_dir": sys.argv[2], "data_dir": sys.argv[2]}, python=sys.argv[1])
except jobbody.EngineJobError as exc:
    print(f"job failed: {exc}", flush=True)
    sys.exit(1)
print("job finished", flush=True)
"""


def run_job_body(shared_dir: Path, name: str, exports: list[str]) -> tuple[int, str, str, float]:
    """The VeRL job body on both nodes as a 2-node batch job with the stand-ins: (sbatch's exit status,
    the job's output, the stand-in Ray's starts as `node args`, seconds)."""
    work = shared_dir / name
    (work / "env" / "bin").mkdir(parents=True)
    for file, text in (("ray", STAND_IN_RAY), ("python", STAND_IN_PYTHON)):
        (work / "env" / "bin" / file).write_text(text)
        (work / "env" / "bin" / file).chmod(0o755)
    (work / "run_job.py").write_text(RUN_JOB)
    (work / "ray-starts").touch()
    env = {"REAL_PYTHON": sys.executable, "ENGINE_CORE": ENGINE_CORE, "PDMCTL_RAY_HEAD_WAIT": "0",
           "PDMCTL_RAY_STOP_S": "10", "PDMCTL_CLEANUP_GRACE_S": "2"}  # fmt: skip
    script = work / "job.sh"
    script.write_text("#!/bin/bash\n" + "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())
                      + "".join(f"{line}\n" for line in exports)
                      + "srun -N2 --ntasks-per-node=1 sh -c 'echo \"addresses on $(hostname): $(hostname --ip-address) /"
                        " $(hostname -I)\"'\n"
                      + f"exec {sys.executable} {work / 'run_job.py'} {work / 'env' / 'bin' / 'python'} {work}\n")  # fmt: skip
    out = work / "job.out"
    started = time.monotonic()
    proc = subprocess.run(["sbatch", "--wait", "--nodes=2", "--ntasks-per-node=1", "--time=2", "-J", f"pdmctl-{name}",
                           "-o", str(out), "-D", str(work), str(script)], capture_output=True, text=True, timeout=120)  # fmt: skip
    took = time.monotonic() - started
    return proc.returncode, out.read_text() if out.exists() else proc.stderr, (work / "ray-starts").read_text(), took


@contextlib.contextmanager
def second_network(nodes: list[str]) -> Iterator[Callable[[str], None]]:
    """A second network between the nodes, as a cluster's InfiniBand beside its management Ethernet: a
    bridge pdmib0 (10.78.0.1/24) and, on each node asked for, an interface `ib0` (10.78.0.1I) on it.
    Each node's eth0 (10.77.0.1I, what its hostname resolves to) stays its first address. Yields a
    function that adds ib0 to one more node; everything is removed afterwards."""

    def add(node: str, joined: bool = True) -> None:
        """ib0 on `node`; not `joined`: up, with its address, but on no network (its peer on no bridge)."""
        i = node.removeprefix("n")
        for command in (["ip", "link", "add", f"pdmib-{node}", "type", "veth", "peer", "name", "ib0", "netns", node],
                        ["ip", "link", "set", f"pdmib-{node}", *(["master", "pdmib0"] if joined else []), "up"],
                        ["ip", "-n", node, "addr", "add", f"10.78.0.1{i}/24", "dev", "ib0"],
                        ["ip", "-n", node, "link", "set", "ib0", "up"]):  # fmt: skip
            subprocess.run(command, check=True, capture_output=True, timeout=20)

    def remove() -> None:  # a veth's end in the node goes with its peer
        for link in ("pdmib-n1", "pdmib-n2", "pdmib0"):
            subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=20)

    remove()  # what a killed run of this test left
    try:
        subprocess.run(["ip", "link", "add", "pdmib0", "type", "bridge"], check=True, capture_output=True, timeout=20)
        subprocess.run(["ip", "addr", "add", "10.78.0.1/24", "dev", "pdmib0"], check=True, timeout=20)
        subprocess.run(["ip", "link", "set", "pdmib0", "up"], check=True, timeout=20)
        for node in nodes:
            add(node)
        yield add
    finally:
        remove()


@pytest.mark.timeout(120)
def test_ray_binds_the_profiles_network_interface_on_every_node(shared_dir: Path) -> None:
    """The profile names ib0, a second network beside eth0 (whose address each node's
    hostname resolves to and lists first: what the job body took before). With ib0 on n1 only, the job
    fails at its start, before any Ray, in one line naming n2 and ib0. With ib0 on both, each node's
    `ray start` binds its ib0 address and the worker joins the head's."""
    from pdmctl.executors import make_executor
    from pdmctl.executors.base import load_profile

    profile = load_profile(PROFILE)
    profile = dataclasses.replace(profile, options={**profile.options, "network_interface": "ib0"})
    exports = make_executor(profile).job_exports()
    assert "export PDMCTL_RAY_INTERFACE=ib0" in exports
    with second_network(["n1"]) as add:
        rc, out, starts, took = run_job_body(shared_dir, "iface-missing", exports)
        print(f"\nib0 on n1 only: the job ended in {took:.1f} s (sbatch --wait), exit {rc}")
        assert rc != 0 and starts == "", out
        assert ("job failed: RuntimeError: node n2 has no network interface 'ib0' (the profile's "
                "network_interface; its interfaces: eth0, lo)\n") in out, out  # fmt: skip
        assert took < 30, out
        add("n2")
        rc, out, starts, took = run_job_body(shared_dir, "iface", exports)
        print(f"ib0 on both: the job took {took:.1f} s; {out!r}; ray starts {starts!r}")
    assert rc == 0 and "job finished" in out, out
    # hostname's address (the old choice) is eth0's on each node, and the first one listed
    assert "addresses on n1: 10.77.0.11 / 10.77.0.11 10.78.0.11" in out, out
    assert "pdmctl: Ray binds network interface ib0: n1 10.78.0.11, n2 10.78.0.12\n" in out, out
    by_node = {line.split()[0]: line for line in starts.splitlines()}
    assert set(by_node) == {"n1", "n2"}, starts
    port = by_node["n1"].split("--port=")[1].split()[0]
    assert by_node["n1"].startswith("n1 start --head --node-ip-address=10.78.0.11 "), starts
    assert by_node["n2"].startswith(f"n2 start --address=10.78.0.11:{port} --node-ip-address=10.78.0.12 "), starts
    assert f"trainer on n1: RAY_ADDRESS=10.78.0.11:{port}\n" in out, out


@pytest.mark.timeout(120)
def test_an_attempt_leaves_no_process_on_either_node(shared_dir: Path) -> None:
    """A GPU model's attempt whose Ray left an engine core behind on each node (in its own
    process session, reparented to the node's init, ignoring SIGTERM, named VLLM::EngineCore_DP0): once the job
    has ended, nothing of it is left on n1 or n2 (the job body ends n2's, the job itself n1's: KILL after
    the grace)."""
    marker = f"pdmctl-core-{uuid.uuid4().hex[:8]}"
    before = {node: set(node_processes(node)) for node in ("n1", "n2")}  # other jobs' (none when idle)
    rc, out, starts, took = run_job_body(shared_dir, "cleanup", ["export LEAVE_ENGINE_CORE=1",
                                                                  f"export CORE_MARKER={marker}"])  # fmt: skip
    print(f"\nthe job took {took:.1f} s; {out!r}")
    assert rc == 0 and "job finished" in out, out
    assert len(starts.splitlines()) == 2, starts  # an engine core left on each node
    # each node's engine core (at least) ended: n2's by the job body's step there, n1's by the job itself
    assert re.search(r"^pdmctl: ended [1-9]\d* leftover engine process\(es\) on n2, ", out, re.M), out
    assert re.search(r"^pdmctl: ended [1-9]\d* leftover engine process\(es\), removed ", out, re.M), out

    def left() -> dict[str, list[str]]:
        return {node: sorted(set(node_processes(node)) - before[node]) for node in ("n1", "n2")}

    wait_for(lambda: left() == {"n1": [], "n2": []}, 10, "nothing of the job left on either node", lambda: str(left()))
    assert not any(marker in line for node in ("n1", "n2") for line in node_processes(node))


# ---------------------------------------------------------------------------
# `pdmctl doctor --job` on both nodes: each node's checks, then those across them
# ---------------------------------------------------------------------------

# what this CPU cluster has not: GPUs (nvidia-smi, and so the driver and the GPU count), vLLM, Megatron-Bridge,
# Transformer Engine (the engine environment has them; this is the main one)
NO_GPU = ["--skip=nvidia-smi", "--skip=vllm", "--skip=megatron-bridge", "--skip=transformer-engine"]
QUICK = [*NO_GPU, "--skip=attention", "--skip=verl", "--skip=megatron"]  # where another check is the point


def ray_left(node: str) -> list[str]:
    """The node's Ray processes (a raylet, a GCS, a worker, idle or not), but for zombies."""
    return [p for p in node_processes(node) if any(w in p for w in ("raylet", "gcs_server", "ray::", "ray start",
                                                                    "ray/dashboard", "ray/_private"))]  # fmt: skip


def doctor_job(shared_dir: Path, name: str, skips: list[str], uri: str | None = None, wait_s: int = 60,
               **changes: object) -> list[str]:  # fmt: skip
    """`pdmctl doctor --job` through the 2-node profile with `changes`, its run root on the shared storage unless
    changed, each node waiting PDMCTL_DOCTOR_WAIT_S for the other: the exit code, then every line printed."""
    import yaml

    fields = {**yaml.safe_load(Path(PROFILE).read_text()), "workdir": str(shared_dir / name / "runs"),
              "env": {"PDMCTL_DOCTOR_WAIT_S": str(wait_s)}, **changes}  # fmt: skip
    (shared_dir / name).mkdir(parents=True, exist_ok=True)
    profile = shared_dir / name / "profile.yaml"
    profile.write_text(yaml.safe_dump(fields))
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "pdmctl"), "doctor", "--cluster", str(profile), "--job",
         "--tracking-uri", uri or f"sqlite:///{shared_dir / 'mlflow.db'}", *skips],
        capture_output=True, text=True, timeout=540, cwd=shared_dir,
    )  # fmt: skip
    return [str(proc.returncode), *(proc.stdout + proc.stderr).splitlines()]


@pytest.mark.timeout(600)
def test_doctor_job_checks_each_node_then_across_both(shared_dir: Path) -> None:
    """One job of both nodes, one task each: every node check passes on n1 and on n2, each line naming its
    node; then across them the run root written on n1 is read on n2, a gloo all-reduce of 4 MiB runs over eth0
    (the profile's network:), its sum right and its bus bandwidth shown, and Ray on eth0 (its network_interface)
    has both nodes joined, then ends on both."""
    rc, *out = doctor_job(shared_dir, "doctor-ok", NO_GPU, network={"GLOO_SOCKET_IFNAME": "eth0"})
    print("\n".join(out))
    assert rc == "0", "\n".join(out)
    for node in ("n1", "n2"):
        for check in ("shm", "memlock", "attention", "verl", "megatron", "paths", "tracking", "disk", "shared-files",
                      "all-reduce", "ray"):  # fmt: skip
            assert any(ln.startswith(f"{node}| ok    {check}: ") for ln in out), (node, check)
    assert any(ln.startswith(f"n2| ok    shared-files: run root {shared_dir / 'doctor-ok' / 'runs'}: n1's file read "
                             "on n2; the same environment as n1") for ln in out), out  # fmt: skip
    for node in ("n1", "n2"):  # the sum, then the bandwidth gloo reached over the namespaces' veth, both nodes timed
        assert any(re.fullmatch(rf"{node}\| ok    all-reduce: gloo across 2 node\(s\) over eth0: the sum came back 2; "
                                r"4 MiB in \d+\.\d ms: bus bandwidth \d+(\.\d)? [KMGT]?B/s, algorithm bandwidth "
                                r"\d+(\.\d)? [KMGT]?B/s \(2 rank\(s\), one a node; gloo over TCP\)", ln) for ln in out), out
    assert any(re.match(r"n1\| ok    ray: 2 node\(s\) joined the head at 10\.77\.0\.11:\d+ on network interface eth0 "
                        r"in \d+ s; n1 bound 10\.77\.0\.11$", ln) for ln in out), out  # fmt: skip
    assert not any(ln.startswith(("n1| FAIL", "n2| FAIL")) for ln in out)
    for node in ("n1", "n2"):  # Ray ended on each node, its idle workers too
        wait_for(lambda node=node: not ray_left(node), 30, f"Ray gone from {node}", lambda node=node: str(ray_left(node)))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("check", ["shared-files", "all-reduce", "ray", "tracking"])
def test_doctor_job_shows_a_failure_of_each_check_on_the_nodes(shared_dir: Path, check: str) -> None:
    """Each check across the nodes, and the tracking store from each node, made to fail as it fails on a real
    cluster, shown failing in one line on a node, and the doctor exits 2:
    shared-files: a run root on each node's own /tmp; all-reduce: gloo told to use the loopback (the
    rendezvous is then each node's own); ray: ib0 up with an address on both nodes but joining them to
    nothing (n2's on no network), the collectives on eth0; tracking: a SQLite store in the login machine's /tmp."""
    private = Path(f"/tmp/pdm-doctor-{uuid.uuid4().hex[:8]}")  # each node has its own /tmp
    changes: dict[str, object] = {}
    uri, expected = None, ""
    if check == "shared-files":
        changes["workdir"] = str(private / "runs")
        expected = (f"| FAIL  shared-files: run root {private / 'runs'}: ", "put the profile's workdir on storage every "
                    "node mounts")  # fmt: skip
    elif check == "all-reduce":
        changes["network"] = {"GLOO_SOCKET_IFNAME": "lo"}
        expected = ("| FAIL  all-reduce: gloo across 2 node(s) (rendezvous 127.0.0.1:", "over lo): ")
    elif check == "ray":
        changes.update(network_interface="ib0", network={"GLOO_SOCKET_IFNAME": "eth0"})
        expected = ("| FAIL  ray: 1 of 2 node(s) joined the Ray head at 10.78.0.11:", "on network interface ib0 within 20 s")
    else:
        private.mkdir()
        uri = f"sqlite:///{private / 'mlflow.db'}"
        expected = (f"| FAIL  tracking: tracking URI {uri}: directory {private} does not exist", "")
    with contextlib.ExitStack() as stack:
        if check == "ray":
            add = stack.enter_context(second_network(["n1"]))
            add("n2", joined=False)
        started = time.monotonic()
        rc, *out = doctor_job(shared_dir, f"doctor-{check}", QUICK, uri=uri, wait_s=20, **changes)
        took = time.monotonic() - started
    print(f"\n{check}: exit {rc} after {took:.0f} s\n" + "\n".join(out))
    shutil.rmtree(private, ignore_errors=True)
    assert rc == "2", "\n".join(out)
    failed = [ln for ln in out if re.match(r"n[12]\| FAIL  ", ln)]
    assert failed and all(ln.split("| FAIL  ")[1].startswith(check) for ln in failed), failed
    assert any(expected[0] in ln and expected[1] in ln for ln in failed), (expected, failed)
    assert any(re.fullmatch(r"FAIL  job: the nodes' checks ended with exit code \d+", ln) for ln in out), out[-3:]
    for node in ("n1", "n2"):  # whatever ended the check, no Ray of it is left on a node
        wait_for(lambda node=node: not ray_left(node), 40, f"Ray gone from {node}", lambda node=node: str(ray_left(node)))

