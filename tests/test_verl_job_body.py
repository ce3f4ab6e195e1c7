"""The VeRL job body's control flow on two stand-in nodes: `srun`, `scontrol`, `hostname`, Ray and the
job's Python are small scripts that log what they are asked, so a failed start, a dead trainer and a
cancel can be timed without a cluster. The same body on a real
SLURM: tests/test_verl_slurm.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pdmctl.backends.base import NodeLost
from pdmctl.backends.verl import jobbody

FAKE_SRUN = r"""#!/bin/bash
node=all
while [ $# -gt 0 ]; do
  case "$1" in -w) node="$2"; shift 2;; -*) shift;; *) break;; esac
done
echo "srun[$node] $*" >> "$FAKE_LOG"
if [ "$node" = all ]; then  # a step on every node: one task per node, in turn
  rc=0
  for each in nodeA nodeB; do FAKE_NODE="$each" SLURMD_NODENAME="$each" "$@" || rc=$?; done
  exit $rc
fi
FAKE_NODE="$node" SLURMD_NODENAME="$node" exec "$@"
"""
FAKE_RAY = r"""#!/bin/bash
case "$1" in
  start)
    echo "ray start on $FAKE_NODE" >> "$FAKE_LOG"
    if [ "$FAKE_NODE" = "${FAKE_FAIL_NODE:-}" ]; then echo "ray start failed on $FAKE_NODE"; exit 1; fi
    echo $$ >> "$FAKE_PIDS"
    echo "ray pid $$ on $FAKE_NODE" >> "$FAKE_LOG"
    trap 'echo "ray ended on $FAKE_NODE" >> "$FAKE_LOG"; kill $!; exit 0' TERM
    sleep 1001 &
    wait ;;
  stop) echo "ray stop on $FAKE_NODE" >> "$FAKE_LOG" ;;
esac
"""
FAKE_PYTHON = r"""#!/bin/bash
case "$*" in
  *"import secrets"*) echo token ;;
  *"import pdmctl"*) exit 0 ;;
  *node-address*)  # each node's address on the interface: 10.8.0.1 (nodeA), 10.8.0.2 (nodeB)
    if [ "$FAKE_NODE" = "${FAKE_NO_PACKAGE:-}" ]; then
      echo "Traceback (most recent call last):"; echo "ModuleNotFoundError: No module named 'pdmctl'"; exit 1
    fi
    if [ "$FAKE_NODE" = "${FAKE_NO_INTERFACE:-}" ]; then
      echo "RuntimeError: node $FAKE_NODE has no network interface '${*: -1}' (its interfaces: eth0, lo)"; exit 1
    fi
    case "$FAKE_NODE" in nodeA) echo "nodeA 10.8.0.1" ;; nodeB) echo "nodeB 10.8.0.2" ;; esac ;;
  *wait-ray*) eval "${FAKE_WAIT:-echo 'pdmctl: 2 Ray node(s) up'}" ;;
  *" train"*) echo $$ >> "$FAKE_PIDS"; eval "${FAKE_TRAIN:-echo trained}" ;;
esac
"""
FAKE_HOSTNAME = r"""#!/bin/bash
case "$1" in --ip-address) echo "127.0.1.1 fe80::1 10.1.2.3" ;; -I) echo "10.1.2.3 172.17.0.1" ;; *) echo nodeA ;; esac
"""


@pytest.fixture
def nodes(tmp_path: Path) -> dict[str, str]:
    """Two nodes (nodeA, nodeB) of stand-ins; returns the job's environment."""
    bin_dir, env_dir = tmp_path / "bin", tmp_path / "env" / "bin"
    bin_dir.mkdir()
    env_dir.mkdir(parents=True)
    for path, text in ((bin_dir / "srun", FAKE_SRUN), (env_dir / "ray", FAKE_RAY),
                       (env_dir / "python", FAKE_PYTHON), (bin_dir / "hostname", FAKE_HOSTNAME),
                       (bin_dir / "scontrol", "#!/bin/bash\necho nodeA\necho nodeB\n")):  # fmt: skip
        path.write_text(text)
        path.chmod(0o755)
    (tmp_path / "log").touch()
    (tmp_path / "pids").touch()
    return {
        "PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path), "FAKE_LOG": str(tmp_path / "log"),
        "FAKE_PIDS": str(tmp_path / "pids"), "PDMCTL_PYTHON": str(env_dir / "python"),
        "SLURM_JOB_NODELIST": "node[A-B]", "SLURM_JOB_ID": "1234", "PDMCTL_RAY_HEAD_WAIT": "0",
        "PDMCTL_RAY_HEAD_IP": "10.0.0.1", "PDMCTL_RAY_STOP_S": "10",
    }  # fmt: skip


def _body() -> list[str]:
    return ["bash", "-c", jobbody.JOB_BODY, "pdmctl-verl", "trainer.total_epochs=1"]


def _log(env: dict[str, str]) -> str:
    return Path(env["FAKE_LOG"]).read_text()


def _all_ended(env: dict[str, str]) -> bool:
    """Every `ray start --block` and trainer the stand-ins started is gone."""
    pids = [int(p) for p in Path(env["FAKE_PIDS"]).read_text().split()]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        alive = [p for p in pids if Path(f"/proc/{p}").exists() and "Z" not in _state(p)]
        if not alive:
            return True
        time.sleep(0.2)
    return False


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_a_finished_trainer_stops_ray_on_every_node_and_releases_the_pipe(nodes: dict[str, str]) -> None:
    """The trainer's output pipe ends when the trainer does: the background `ray start` steps (which
    live until `ray stop`) write to the job log's fd, not to the pipe."""
    started = time.monotonic()
    jobbody._run_trainer(_body(), {**os.environ, **nodes}, stall_s=60)
    assert time.monotonic() - started < 30
    log = _log(nodes)
    assert "ray start on nodeA" in log and "ray start on nodeB" in log
    assert "ray ended on nodeA" in log and "ray ended on nodeB" in log  # each node's own step, TERM'd
    assert "ray stop" not in log  # which would end every Ray on the node, another job's too
    assert "verl.cpu cleanup" not in log  # not an engine job (no PDMCTL_ENGINE_TAG)
    assert _all_ended(nodes)


def test_an_engine_job_ends_its_leftovers_on_the_other_nodes_after_ray(nodes: dict[str, str]) -> None:
    """A CPU engine job (PDMCTL_ENGINE_TAG set): once each node's Ray is ended, one step on every node but
    the first ends what carries the tag there (vLLM's engine cores outlive Ray); the first node's are
    pdmctl's own (cpu.cleanup). The step itself does not carry the tag."""
    jobbody._run_trainer(_body(), {**os.environ, **nodes, "PDMCTL_ENGINE_TAG": "tag-1"}, stall_s=60)
    log = _log(nodes)
    (step,) = [line for line in log.splitlines() if "verl.cpu cleanup" in line]
    assert step.startswith("srun[nodeB] env -u PDMCTL_ENGINE_TAG -u VERL_PLATFORM ") and " cleanup tag-1 " in step, log
    assert log.index("ray ended on nodeB") < log.index(step), log
    assert _all_ended(nodes)


@pytest.mark.parametrize("setsid", ["prompt", "slow"])
def test_a_failed_ray_start_ends_the_job_at_once_with_its_reason(nodes: dict[str, str], setsid: str,
                                                                 tmp_path: Path) -> None:  # fmt: skip
    """A worker's `ray start` fails: the job ends in seconds (not at the 120 s wait), Ray is stopped on
    every node, the head's step ended, the trainer never started, and the run's reason says why. Also where
    the job ends before `wait-ray` has made its own process group (`slow`: its setsid comes 3 s late):
    the cleanup ends the process itself, which would otherwise hold the job's output until the stall
    watchdog."""
    env = {**os.environ, **nodes, "FAKE_FAIL_NODE": "nodeB", "FAKE_WAIT": "sleep 300"}
    if setsid == "slow":
        import shutil

        real = shutil.which("setsid")
        assert real, "util-linux's setsid"
        (tmp_path / "bin" / "setsid").write_text(f'#!/bin/bash\nsleep 3\nexec {real} "$@"\n')
        (tmp_path / "bin" / "setsid").chmod(0o755)
    started = time.monotonic()
    with pytest.raises(jobbody.EngineJobError, match="a Ray node step ended while the cluster was starting"):
        jobbody._run_trainer(_body(), env, stall_s=60)
    assert time.monotonic() - started < 30
    assert "ray ended on nodeA" in _log(nodes) and " train" not in _log(nodes)
    assert _all_ended(nodes)


def test_a_failed_wait_for_ray_stops_ray_and_fails_the_run(nodes: dict[str, str]) -> None:
    """Under `set -e` a failed `wait-ray` used to exit before `ray stop`."""
    env = {**os.environ, **nodes, "FAKE_WAIT": "echo 'TimeoutError: only 1 of 2 Ray nodes came up within 120s'; exit 1"}
    with pytest.raises(jobbody.EngineJobError, match="only 1 of 2 Ray nodes"):
        jobbody._run_trainer(_body(), env, stall_s=60)
    assert "ray ended on nodeA" in _log(nodes) and "ray ended on nodeB" in _log(nodes)
    assert _all_ended(nodes)


def test_a_dead_trainer_fails_the_run_with_its_error_and_stops_ray(nodes: dict[str, str]) -> None:
    env = {**os.environ, **nodes, "FAKE_TRAIN": "echo 'ValueError: the actor died'; exit 1"}
    with pytest.raises(jobbody.EngineJobError, match="ValueError: the actor died") as failed:
        jobbody._run_trainer(_body(), env, stall_s=60)
    assert not isinstance(failed.value, NodeLost)  # a failure of its own: no requeue asked for
    assert "ray ended on nodeA" in _log(nodes) and "ray ended on nodeB" in _log(nodes)
    assert _all_ended(nodes)


def test_a_ray_node_lost_while_the_trainer_runs_ends_the_attempt_as_a_lost_node(nodes: dict[str, str]) -> None:
    """nodeB's `ray start` step ends mid-training (its machine, slurmd or raylet gone; here its step is ended):
    the job body names the node, gives the trainer PDMCTL_NODE_LOSS_GRACE_S to fail by itself, then ends it
    and the head's Ray, and the attempt ends as a lost node (NodeLost: the job asks for its requeue), not as
    a hung trainer found by the stall watchdog much later."""
    lose_b = "sleep 1; kill -TERM $(awk '/^ray pid .* on nodeB$/ {print $3}' \"$FAKE_LOG\"); sleep 300"
    env = {**os.environ, **nodes, "FAKE_TRAIN": lose_b, "PDMCTL_NODE_LOSS_GRACE_S": "2"}
    started = time.monotonic()
    with pytest.raises(NodeLost, match=r"^nodeB: its Ray step ended while the trainer ran$"):
        jobbody._run_trainer(_body(), env, stall_s=120)
    assert time.monotonic() - started < 30
    assert "ray ended on nodeB" in _log(nodes) and "ray ended on nodeA" in _log(nodes)
    assert _all_ended(nodes)  # the trainer too


def test_a_trainer_that_ray_says_lost_its_node_ends_the_attempt_as_a_lost_node(nodes: dict[str, str]) -> None:
    """The trainer fails before the node's step is seen to end (SLURM and srun notice a dead machine only
    after their timeouts): Ray's own words for an actor lost with its node make it a lost node too."""
    died = ("echo 'ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.'; "
            "echo 'The actor died because its node has died. Node Id: 701d50b7'; exit 1")  # fmt: skip
    with pytest.raises(NodeLost, match="because its node has died"):
        jobbody._run_trainer(_body(), {**os.environ, **nodes, "FAKE_TRAIN": died}, stall_s=60)
    assert _all_ended(nodes)


def test_the_head_address_is_its_ipv4_and_the_port_is_the_jobs(nodes: dict[str, str]) -> None:
    """`hostname --ip-address` lists 127.0.1.1 and an IPv6 address first; the port block comes from the
    job id (20000 + 1234 % 1276 * 10); the job's OMP_NUM_THREADS (its CPU count) does not reach Ray."""
    env = {**os.environ, **nodes, "OMP_NUM_THREADS": "96", "PDMCTL_NUM_THREADS": "96",
           "FAKE_TRAIN": 'echo "addr=$RAY_ADDRESS omp=${OMP_NUM_THREADS-unset}"'}  # fmt: skip
    del env["PDMCTL_RAY_HEAD_IP"]
    lines: list[str] = []
    jobbody._run_trainer(_body(), env, on_line=lines.append, stall_s=60)
    assert "addr=10.1.2.3:32340 omp=unset\n" in lines, lines
    log = _log(nodes)
    assert "--port=32340" in log and "--node-manager-port=32341" in log and "--include-dashboard=false" in log
    kept = {**env, "OMP_NUM_THREADS": "4"}  # set by the profile's env block: kept
    lines.clear()
    jobbody._run_trainer(_body(), kept, on_line=lines.append, stall_s=60)
    assert "addr=10.1.2.3:32340 omp=4\n" in lines, lines


def test_a_head_without_an_ipv4_address_is_one_line(nodes: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "bin" / "hostname").write_text("#!/bin/bash\necho 127.0.1.1 ::1\n")
    env = {**os.environ, **nodes}
    del env["PDMCTL_RAY_HEAD_IP"]
    with pytest.raises(jobbody.EngineJobError, match=r"no IPv4 address other than 127\.x for the Ray head nodeA"):
        jobbody._run_trainer(_body(), env, stall_s=60)


def test_the_profiles_network_interface_is_what_ray_binds_on_every_node(nodes: dict[str, str]) -> None:
    """With a network interface named (PDMCTL_RAY_INTERFACE, the profile's
    network_interface), each node's address on it goes to its own `ray start --node-ip-address`, the
    head's is the address the workers join and the trainer's RAY_ADDRESS, whatever `hostname` lists
    first (here 127.0.1.1, then 10.1.2.3)."""
    env = {**os.environ, **nodes, "PDMCTL_RAY_INTERFACE": "ib0", "FAKE_TRAIN": 'echo "addr=$RAY_ADDRESS"'}
    del env["PDMCTL_RAY_HEAD_IP"]
    lines: list[str] = []
    jobbody._run_trainer(_body(), env, on_line=lines.append, stall_s=60)
    assert "pdmctl: Ray binds network interface ib0: nodeA 10.8.0.1, nodeB 10.8.0.2\n" in lines, lines
    assert "addr=10.8.0.1:32340\n" in lines, lines
    starts = [line for line in _log(nodes).splitlines() if line.startswith("srun[") and " start " in line]
    head = next(line for line in starts if line.startswith("srun[nodeA]"))
    worker = next(line for line in starts if line.startswith("srun[nodeB]"))
    assert " --head --node-ip-address=10.8.0.1 --port=32340 " in head, head
    assert " --address=10.8.0.1:32340 --node-ip-address=10.8.0.2 " in worker, worker
    # the address step also showed that the package imports on every node: no separate import step
    assert "import pdmctl" not in _log(nodes)
    assert _all_ended(nodes)


def test_a_node_without_the_network_interface_fails_the_job_at_once_in_one_line(nodes: dict[str, str]) -> None:
    """The interface missing on one node: the job ends before any `ray start`, in seconds, and the run's
    reason is the node's one line naming the node and the interface."""
    env = {**os.environ, **nodes, "PDMCTL_RAY_INTERFACE": "ib0", "FAKE_NO_INTERFACE": "nodeB"}
    started = time.monotonic()
    with pytest.raises(jobbody.EngineJobError) as info:
        jobbody._run_trainer(_body(), env, stall_s=60)
    assert time.monotonic() - started < 10
    assert str(info.value) == "RuntimeError: node nodeB has no network interface 'ib0' (its interfaces: eth0, lo)"
    assert "ray start" not in _log(nodes) and " train" not in _log(nodes)
    # a node where the step itself fails (the package does not import there): that error, in one line
    env = {**os.environ, **nodes, "PDMCTL_RAY_INTERFACE": "ib0", "FAKE_NO_PACKAGE": "nodeB"}
    with pytest.raises(jobbody.EngineJobError) as info:
        jobbody._run_trainer(_body(), env, stall_s=60)
    assert str(info.value) == ("RuntimeError: reading each node's address on network interface ib0 failed: "
                               "ModuleNotFoundError: No module named 'pdmctl'")  # fmt: skip


def test_an_interface_address_is_read_from_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The resolver itself (run by the job body on every node): loopback's address, and one line naming
    the node and the interface where the interface does not exist."""
    monkeypatch.setenv("SLURMD_NODENAME", "n7")
    assert jobbody.interface_address("lo") == "127.0.0.1"
    with pytest.raises(jobbody.InterfaceError, match=r"^node n7 has no network interface 'pdmnosuch0' \(the "
                                                     r"profile's network_interface; its interfaces: .*\blo\b"):  # fmt: skip
        jobbody.interface_address("pdmnosuch0")
    proc = subprocess.run([sys.executable, "-m", "pdmctl.backends.verl.jobbody", "node-address", "--interface", "lo"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "SLURMD_NODENAME": "n7"})  # fmt: skip
    assert (proc.returncode, proc.stdout) == (0, "n7 127.0.0.1\n"), proc.stderr


# What a vLLM engine core does to a job: started by a Ray worker in a process session of its own (so no process
# group signal reaches it), named VLLM::EngineCore_DP0, outliving its parent and ignoring SIGTERM.
ENGINE_CORE = ('import ctypes, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); '
               'ctypes.CDLL(None).prctl(15, b"VLLM::EngineCor", 0, 0, 0); time.sleep(300)')  # fmt: skip


def _engine_cores(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "cmdline").read_bytes().decode(errors="replace") \
                    and _state(int(entry.name)) != "Z":  # fmt: skip
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_a_gpu_engine_attempt_leaves_no_process_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU model's attempt (here outside SLURM, VeRL's own Ray) whose trainer leaves an
    engine core behind in its own process session, ignoring SIGTERM: once `run` returns, it is gone (KILL after
    the grace). Before, the per-node cleanup ran for the CPU engine only and it stayed."""
    marker = f"pdmctl-test-{os.getpid()}-{time.monotonic_ns()}"
    python = tmp_path / "python"
    python.write_text(f"""#!/bin/bash
case "$*" in *" train "*)
  setsid bash -c 'exec -a "VLLM::EngineCore_DP0" {sys.executable} -c "$0" {marker}' '{ENGINE_CORE}' </dev/null >/dev/null 2>&1 &
  for _ in $(seq 100); do grep -qs VLLM /proc/$!/comm && break; sleep 0.05; done
  echo "trainer done, engine core $! left" ;;
esac
""")
    python.chmod(0o755)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("PDMCTL_CLEANUP_GRACE_S", "1")
    lines: list[str] = []
    started = time.monotonic()
    try:
        jobbody.run({"model": "qwen3-4b-base", "checkpoint_dir": str(tmp_path), "data_dir": str(tmp_path)},
                    python=str(python), on_line=lines.append)  # fmt: skip
        assert any("engine core" in line for line in lines), lines
        assert _engine_cores(marker) == []
        assert time.monotonic() - started < 15
    finally:
        for pid in _engine_cores(marker):
            os.kill(pid, signal.SIGKILL)


CANCEL = textwrap.dedent(
    """
    import os, signal, sys, time
    from pdmctl.backends.verl import jobbody
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # as executors.slurm.PdmctlJob does

    def on_line(line):
        if "training" in line:
            raise KeyboardInterrupt  # what a cancel or a pruned trial does: end the trainer

    started = time.monotonic()
    try:
        jobbody._run_trainer(sys.argv[1:], dict(os.environ), on_line=on_line, stall_s=60)
    except KeyboardInterrupt:
        print(f"ended in {time.monotonic() - started:.1f}")
    """
)


def test_a_job_that_blocks_sigterm_can_still_end_its_trainer(nodes: dict[str, str]) -> None:
    """The SLURM job blocks SIGTERM for itself; the trainer's process must not inherit that, or
    `terminate()` does nothing. Here the job body gets the TERM, and its trap ends the
    trainer and stops Ray."""
    env = {**os.environ, **nodes, "FAKE_TRAIN": "echo training; grep SigBlk /proc/self/status; exec sleep 1002"}
    proc = subprocess.run([sys.executable, "-c", CANCEL, *_body()], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert "ended in" in proc.stdout, proc.stdout + proc.stderr
    assert float(proc.stdout.split("ended in")[1]) < 25, proc.stdout  # not the 30 s terminate() waits
    assert "ray ended on nodeA" in _log(nodes) and "ray ended on nodeB" in _log(nodes)
    assert _all_ended(nodes)


def test_the_trainer_process_starts_with_sigterm_unblocked() -> None:
    code = "import signal, subprocess, sys; signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM}); " \
           "from pdmctl.backends.verl import jobbody; " \
           "jobbody._run_trainer(['grep', 'SigBlk', '/proc/self/status'], {}, stall_s=30)"  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    mask = int(out.split()[-1], 16)
    assert not mask & (1 << (signal.SIGTERM - 1)), out


def test_a_resumed_attempt_validates_again_only_where_that_evaluation_would_be_new(tmp_path: Path) -> None:
    """An attempt resuming from step N's checkpoint skips VeRL's validation before training where step N
    is off the run's evaluation schedule, or its evaluation is in the run already (read from the real
    MLflow store); it validates where step N's evaluation was lost, at the last step, and where the
    store cannot say. The trainer's command then says `val_before_train=false`, with one line why."""
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("e")).info.run_id
    for step in (0, 10):
        client.log_metric(run_id, "eval/aime24", 0.5, step=step)
        client.log_metric(run_id, "eval/aime25", 0.25, step=step)
    client.log_metric(run_id, "train/reward", 0.1, step=20)
    cfg = {"model": "qwen3-tiny", "test_freq": 10, "total_training_steps": 25, "mlflow_run_id": run_id,
           "tracking_uri": uri}  # fmt: skip
    redundant = jobbody._validation_on_resume_is_redundant
    assert redundant(cfg, 5) and redundant(cfg, 13)  # off the schedule: no query needed
    assert redundant(cfg, 10)  # step 10's evaluation is logged
    assert not redundant(cfg, 20)  # on the schedule, its evaluation lost with the attempt that saved it
    assert not redundant(cfg, 25)  # the last step always evaluates
    assert not redundant({**cfg, "tracking_uri": f"sqlite:///{tmp_path / 'no' / 'such' / 'mlflow.db'}"}, 10)
    assert not redundant({**cfg, "mlflow_run_id": None}, 10)
    command = ["python", "-m", "verl", "trainer.test_freq=10", jobbody.VALIDATE_FIRST, "trainer.nnodes=1"]
    assert jobbody.without_validation_on_resume(command, 10) == [
        "python", "-m", "verl", "trainer.test_freq=10", "trainer.val_before_train=false", "trainer.nnodes=1"]  # fmt: skip
    assert jobbody.without_validation_on_resume(command[:4], 10) == command[:4]  # the run asked for none


def test_a_local_engine_run_has_a_ray_of_its_own_whatever_a_ray_start_left(tmp_path: Path, monkeypatch) -> None:
    """Off SLURM, VeRL's `ray.init(num_cpus=...)` would join the cluster that some `ray start` once named in
    Ray's temp dir (ray_current_cluster), long gone or not, and refuse its own CPU count there: the trainer
    gets RAY_ADDRESS=local. A real ray.init with a CPU count then starts its own Ray beside such a file."""
    for var in ("SLURM_JOB_ID", "RAY_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    seen = tmp_path / "seen"
    python = tmp_path / "python"
    python.write_text(f"#!/bin/bash\necho \"RAY_ADDRESS=$RAY_ADDRESS\" > {seen}\n")
    python.chmod(0o755)
    jobbody.run({"model": "qwen3-4b-base", "checkpoint_dir": str(tmp_path / "ckpt"), "data_dir": str(tmp_path)},
                python=str(python))  # fmt: skip
    assert seen.read_text() == "RAY_ADDRESS=local\n"
    import tempfile

    ray_tmp = Path(tempfile.mkdtemp(prefix="r", dir="/tmp"))  # short: Ray's socket paths go under it
    (ray_tmp / "ray").mkdir()
    (ray_tmp / "ray" / "ray_current_cluster").write_text("192.0.2.1:6379")  # what a `ray start` long ended left
    code = "import ray; ray.init(num_cpus=1, log_to_driver=False); print(ray.cluster_resources()['CPU']); ray.shutdown()"
    for address, works in ((None, False), ("local", True)):
        env = {**os.environ, "RAY_TMPDIR": str(ray_tmp), **({"RAY_ADDRESS": address} if address else {})}
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=180)
        assert (proc.returncode == 0 and proc.stdout.strip() == "1.0") == works, (address, proc.stderr[-500:])
        assert works or "When connecting to an existing cluster, num_cpus and num_gpus must not be provided" in proc.stderr
    import shutil

    shutil.rmtree(ray_tmp, ignore_errors=True)
