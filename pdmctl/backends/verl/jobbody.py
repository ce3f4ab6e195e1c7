"""A VeRL job on its nodes: the SLURM job body (Ray on every node of the allocation, then the trainer,
its stall watchdog, cleanup however it ends), the trainer on this machine outside SLURM, and the job
body's steps (`python -m pdmctl.backends.verl.jobbody {node-address,wait-ray,probe,train}`)."""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pdmctl.backends.base import NodeLost
from pdmctl.backends.verl.launch import (
    MODEL_PRESETS,
    TOPK_ENV,
    LaunchConfigError,
    _resolved,
    allocated_nodes,
    compose,
    job_env,
    ray_env_overrides,
    resolve_local_model,
    verl_overrides,
)

# ---------------------------------------------------------------------------
# The job body: Ray on the SLURM allocation, then the trainer
# ---------------------------------------------------------------------------

JOB_BODY = r"""
set -euo pipefail
# One node name per element; quoting "$(...)" here would make one element of all names.
mapfile -t NODES < <(scontrol show hostnames "${SLURM_JOB_NODELIST:?not inside a SLURM allocation}")
N="${#NODES[@]}"
HEAD="${NODES[0]}"
JOB_STARTED="$(date +%s)"
# the `ray` beside the job's Python (a virtualenv need not be on the nodes' PATH)
RAY="$(dirname "$PDMCTL_PYTHON")/ray"
[ -x "$RAY" ] || RAY=ray
# Background steps write to the job's log (fd PDMCTL_LOG_FD, kept open by pdmctl) or nowhere, never to
# the trainer's output pipe: a step that outlived the trainer would hold that pipe open.
if [ -n "${PDMCTL_LOG_FD:-}" ]; then exec 3>&"$PDMCTL_LOG_FD"; else exec 3>/dev/null; fi
BACKGROUND=()
MAIN=""  # wait-ray, then the trainer: each the leader of a process group of its own (setsid), so
# that what it started ends with it and no stray child keeps the trainer's output pipe open
SETSID="$(command -v setsid || true)"
STATUS=0
# However the job ends (a failed start, the trainer's exit, a signal): end the trainer, end Ray on
# every node (this job's `ray start` steps, bounded), keep the job's status.
cleanup() {
  STATUS=$?
  trap - EXIT INT TERM
  set +e
  # still running but not yet the leader of its own group (its setsid to come, just after its start): itself
  if [ -n "$MAIN" ] && ! kill -0 -- "-$MAIN" 2>/dev/null && jobs -pr | grep -qx "$MAIN"; then kill -TERM "$MAIN" 2>/dev/null; fi
  if [ -n "$MAIN" ] && kill -0 -- "-$MAIN" 2>/dev/null; then  # its whole process group
    kill -TERM -- "-$MAIN" 2>/dev/null
    for _ in $(seq 30); do kill -0 -- "-$MAIN" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$MAIN" 2>/dev/null
  fi
  # Each node's Ray is its `ray start --block` step: srun passes the TERM to it, and Ray's reaper ends
  # that node's raylet and workers. Not `ray stop`, which ends every Ray on the node, another job's too.
  for pid in "${BACKGROUND[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  for _ in $(seq "${PDMCTL_RAY_STOP_S:-60}"); do
    alive=0
    for pid in "${BACKGROUND[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 1
  done
  for pid in "${BACKGROUND[@]}"; do kill -KILL "$pid" 2>/dev/null; done
  # Whatever the engine, the processes the job started that Ray's teardown leaves behind (vLLM's engine
  # cores, in process sessions of their own and reparented to the node's init, holding a GPU's memory) and its
  # /dev/shm segments, on the other nodes: pdmctl ends the first node's itself (cpu.cleanup). They
  # carry the job's engine tag, which srun passed to the node's `ray start`.
  if [ -n "${PDMCTL_ENGINE_TAG:-}" ] && [ "$N" -gt 1 ]; then
    timeout "${PDMCTL_NODE_CLEANUP_S:-60}" srun --nodes=$((N - 1)) --ntasks=$((N - 1)) --ntasks-per-node=1 \
      -w "$(IFS=,; echo "${NODES[*]:1}")" --overlap env -u PDMCTL_ENGINE_TAG -u VERL_PLATFORM \
      "$PDMCTL_PYTHON" -m pdmctl.backends.verl.cpu cleanup "$PDMCTL_ENGINE_TAG" "$JOB_STARTED" >&3 2>&1
  fi
  exit "$STATUS"
}
trap cleanup EXIT
trap 'exit 143' TERM
trap 'exit 130' INT
# The profile's network_interface (PDMCTL_RAY_INTERFACE): each node reports its own IPv4 address on it
# (one step on every node, which also shows the package imports there), and Ray binds that address on
# every node: `--node-ip-address` for the head and each worker, the head's the one the workers join.
# A node without it (no such interface, no IPv4 address on it, down) fails the job here, in one line.
declare -A NODE_IP=()
IFACE="${PDMCTL_RAY_INTERFACE:-}"
if [ -n "$IFACE" ]; then
  ADDRS="$(srun --nodes="$N" --ntasks="$N" --ntasks-per-node=1 --overlap \
    "$PDMCTL_PYTHON" -m pdmctl.backends.verl.jobbody node-address --interface "$IFACE" 2>&1)" || {
    # the node's own line; else the first exception line (the package not importing there), else the last
    REASON="$(printf '%s\n' "$ADDRS" | grep -m 1 -E '^RuntimeError: ' || true)"
    if [ -z "$REASON" ]; then
      DETAIL="$(printf '%s\n' "$ADDRS" | grep -m 1 -E '^([A-Za-z_][A-Za-z0-9_]*\.)*[A-Za-z_]*(Error|Exception): ' \
        || printf '%s\n' "$ADDRS" | tail -n 1)"
      REASON="RuntimeError: reading each node's address on network interface $IFACE failed: $DETAIL"
    fi
    echo "$REASON"
    exit 1
  }
  while read -r node addr; do NODE_IP["$node"]="$addr"; done < <(printf '%s\n' "$ADDRS" | grep -E '^[^ ]+ [0-9.]+$' || true)
  for node in "${NODES[@]}"; do
    [ -n "${NODE_IP[$node]:-}" ] || { echo "RuntimeError: node $node did not report an IPv4 address on network interface $IFACE"; exit 1; }
  done
  echo "pdmctl: Ray binds network interface $IFACE: $(for node in "${NODES[@]}"; do printf '%s %s, ' "$node" "${NODE_IP[$node]}"; done | sed 's/, $//')"
fi
# The head's IPv4 address: its address on the network interface; else not the first word of
# `hostname --ip-address`, which may be 127.0.1.1 or an IPv6 address (PDMCTL_RAY_HEAD_IP overrides
# both; a one-node test cluster uses 127.0.0.1).
if [ -n "${PDMCTL_RAY_HEAD_IP:-}" ]; then
  HEAD_IP="$PDMCTL_RAY_HEAD_IP"
elif [ -n "$IFACE" ]; then
  HEAD_IP="${NODE_IP[$HEAD]}"
else
  HEAD_IP="$(srun --nodes=1 --ntasks=1 -w "$HEAD" --overlap sh -c 'hostname --ip-address; hostname -I 2>/dev/null || true' \
    | tr ' ' '\n' | grep -E '^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$' | grep -v '^127\.' | head -n 1 || true)"
  [ -n "$HEAD_IP" ] || { echo "RuntimeError: no IPv4 address other than 127.x for the Ray head $HEAD (set PDMCTL_RAY_HEAD_IP)"; exit 1; }
fi
# Ports of this job's own: a block of 10 from the job id in 20000-32759 (below Linux's ephemeral
# ports, above Ray's worker ports), so two jobs sharing a node do not meet on Ray's fixed defaults.
BASE="${PDMCTL_RAY_PORT:-$((20000 + (${SLURM_JOB_ID:-0} % 1276) * 10))}"
PORTS=(--node-manager-port=$((BASE + 1)) --object-manager-port=$((BASE + 2))
  --ray-client-server-port=$((BASE + 3)) --dashboard-agent-listen-port=$((BASE + 4))
  --dashboard-agent-grpc-port=$((BASE + 5)) --metrics-export-port=$((BASE + 6))
  --runtime-env-agent-port=$((BASE + 7)))
GPUS="${PDMCTL_GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-0}}"
# PDMCTL_RAY_CPUS: logical CPUs for Ray (a CPU engine job runs more workers than it has cores)
CPUS="${PDMCTL_RAY_CPUS:-${SLURM_CPUS_ON_NODE:-1}}"
RAY_TMP="${PDMCTL_RAY_TMP:-/tmp/ray-$SLURM_JOB_ID}"
export RAY_ADDRESS="$HEAD_IP:$BASE"
# The job's OMP_NUM_THREADS is its CPU count (for the job's own process): Ray gives each worker its
# own only where the variable is unset. One the profile's env sets on purpose is kept.
if [ "${OMP_NUM_THREADS:-}" = "${PDMCTL_NUM_THREADS:-}" ]; then unset OMP_NUM_THREADS; fi
# Token authentication with a token of this job's own, so the cluster neither depends on what the
# user's ~/.ray/auth_token holds (Ray >= 2.52 turns auth on when that file exists and
# RAY_AUTH_MODE is unset, and a driver without it is then refused) nor is open to others on the
# network. The environment carries it to every srun step, Ray node and the driver.
export RAY_AUTH_MODE=token
RAY_AUTH_TOKEN="$("$PDMCTL_PYTHON" -c "import secrets; print(secrets.token_hex(32))")"
export RAY_AUTH_TOKEN
# The package must import on every node before any Ray worker starts (the interface's step did that).
[ -n "$IFACE" ] || srun --nodes="$N" --ntasks="$N" --ntasks-per-node=1 --overlap \
  "$PDMCTL_PYTHON" -c "import pdmctl.backends.verl.jobbody"
# Since Slurm 22.05 a step does not inherit --cpus-per-task: each Ray node step asks for the job's CPUs.
STEP_CPUS=(${SLURM_CPUS_PER_TASK:+--cpus-per-task="$SLURM_CPUS_PER_TASK"})
srun --nodes=1 --ntasks=1 -w "$HEAD" --overlap "${STEP_CPUS[@]}" \
  "$RAY" start --head --node-ip-address="$HEAD_IP" --port="$BASE" "${PORTS[@]}" --include-dashboard=false \
  --num-cpus="$CPUS" --num-gpus="$GPUS" --temp-dir="$RAY_TMP" --disable-usage-stats --block >&3 2>&1 &
BACKGROUND+=($!)
BG_NODES=("$HEAD")
sleep "${PDMCTL_RAY_HEAD_WAIT:-5}"
for node in "${NODES[@]:1}"; do
  srun --nodes=1 --ntasks=1 -w "$node" --overlap "${STEP_CPUS[@]}" \
    "$RAY" start --address="$RAY_ADDRESS" ${NODE_IP[$node]:+--node-ip-address="${NODE_IP[$node]}"} \
    "${PORTS[@]}" --num-cpus="$CPUS" --num-gpus="$GPUS" \
    --disable-usage-stats --block >&3 2>&1 &
  BACKGROUND+=($!)
  BG_NODES+=("$node")
done
# Wait for every node; a `ray start` step that ends meanwhile fails the start at once, not at the timeout.
$SETSID "$PDMCTL_PYTHON" -m pdmctl.backends.verl.jobbody wait-ray --nodes "$N" --timeout "${PDMCTL_RAY_WAIT_S:-120}" &
MAIN=$!
while kill -0 "$MAIN" 2>/dev/null; do
  for pid in "${BACKGROUND[@]}"; do
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "RuntimeError: a Ray node step ended while the cluster was starting (its output is in the job log)"
      exit 1
    fi
  done
  sleep 1
done
wait "$MAIN"
MAIN=""
# The trainer in the background, waited for: a TERM to this shell is then handled at once (the
# trap ends the trainer and Ray), not after the trainer exits.
if [ "${PDMCTL_VERL_PROBE:-0}" = "1" ]; then
  $SETSID "$PDMCTL_PYTHON" -m pdmctl.backends.verl.jobbody probe &
else
  $SETSID "$PDMCTL_PYTHON" -m pdmctl.backends.verl.jobbody train "$@" &
fi
MAIN=$!
# A Ray node's step that ends while the trainer runs is a lost node (its machine, its slurmd or its raylet
# gone, or its step ended): the trainer gets PDMCTL_NODE_LOSS_GRACE_S to fail by itself, then the job
# exits 75, which pdmctl reads as a lost node (the cleanup ends what is left).
while kill -0 "$MAIN" 2>/dev/null; do
  for i in "${!BACKGROUND[@]}"; do
    kill -0 "${BACKGROUND[$i]}" 2>/dev/null && continue
    echo "pdmctl: lost node ${BG_NODES[$i]}: its Ray step ended while the trainer ran"
    for _ in $(seq "${PDMCTL_NODE_LOSS_GRACE_S:-30}"); do kill -0 "$MAIN" 2>/dev/null || break; sleep 1; done
    exit 75
  done
  sleep 1
done
wait "$MAIN"
"""
NODE_LOST_STATUS = 75  # the job body's exit status for a Ray node lost while the trainer ran


def build_job_command(run_config: Mapping[str, Any], python: str | None = None) -> list[str]:
    """`[env, K=V..., bash, -c, JOB_BODY, pdmctl-verl, override...]`: what the SLURM executor runs.

    The overrides travel as positional arguments (`"$@"`), so no value is ever
    re-parsed by a shell; the environment goes through `env` for the same reason.
    """
    env = {**job_env(run_config), "PDMCTL_PYTHON": python or "python3"}
    # the trainer spans the nodes the job has (VeRL's recipe: trainer.nnodes="${SLURM_NNODES}");
    # submission checked that the profile gives the run's count
    overrides = verl_overrides(run_config, nnodes=allocated_nodes()) + ray_env_overrides(job_env(run_config))
    return [
        "env",
        *(f"{k}={v}" for k, v in sorted(env.items())),
        "bash",
        "-c",
        JOB_BODY,
        "pdmctl-verl",
        *overrides,
    ]


def build_local_command(run_config: Mapping[str, Any], python: str | None = None) -> list[str]:
    """The trainer on this machine, outside SLURM: VeRL starts (and stops) its own Ray."""
    cfg = _resolved(run_config)
    env = job_env(cfg)
    overrides = verl_overrides(cfg) + ray_env_overrides(env)
    if MODEL_PRESETS[cfg["model"]].device == "cpu":
        from pdmctl.backends.verl import cpu

        overrides += cpu.local_ray_overrides()
    module = "pdmctl.backends.verl.jobbody"
    return ["env", *(f"{k}={v}" for k, v in sorted(env.items())), python or "python3", "-m", module, "train",
            *overrides]  # fmt: skip



def run(run_config: Mapping[str, Any], python: str, on_line: Callable[[str], None] | None = None) -> None:
    """Run one VeRL job to its end: on SLURM through the job body, elsewhere VeRL's own local Ray.

    `on_line` sees every line the trainer prints (a tune trial reads its evaluations there); an
    exception it raises ends the trainer as a cancel does, and propagates.

    Whatever the engine, however the attempt ends, none of its processes is left on any of its nodes:
    each carries the attempt's tag (`cpu.ENGINE_TAG_ENV`, inherited by Ray's workers and the vLLM
    engine processes they start, which outlive Ray's teardown and would hold a GPU's memory for the
    next job), the job body ends what carries it on the other nodes, and this process on this one. A
    CPU engine job also takes this machine's lock (one at a time), ends what a job killed outright
    left, and removes its /dev/shm segments.

    The run's checkpoints are pruned to `max_ckpt_to_keep` before the trainer starts and while it runs
    (`checkpoints.Keeper`: VeRL's own rotation forgets what earlier attempts saved).
    """
    import time

    from pdmctl.backends.verl import cpu
    from pdmctl.backends.verl.checkpoints import Keeper, read_latest
    from pdmctl.ledger.client import without_quick_http

    cfg = resolve_local_model(run_config)
    resolved = _resolved(cfg)
    stall_s = stall_seconds(MODEL_PRESETS[resolved["model"]])
    keeper = Keeper(resolved["checkpoint_dir"], int(resolved["max_ckpt_to_keep"]),
                    say=lambda text: print(text, flush=True))  # fmt: skip
    keeper.prune(trainer_running=False)  # what earlier attempts left: at most N, no save cut short
    on_slurm = "SLURM_JOB_ID" in os.environ
    command = build_job_command(cfg, python) if on_slurm else build_local_command(cfg, python)
    resumed_at = read_latest(Path(resolved["checkpoint_dir"]))
    if resumed_at is not None and _validation_on_resume_is_redundant(resolved, resumed_at):
        command = without_validation_on_resume(command, resumed_at)
    tag = cpu.new_tag()
    # MLflow's retries for VeRL; off SLURM a Ray of its own, not a cluster a `ray start` named in /tmp/ray
    env = {**without_quick_http(dict(os.environ)), cpu.ENGINE_TAG_ENV: tag, **({} if on_slurm else {"RAY_ADDRESS": "local"})}
    on_cpu = MODEL_PRESETS[cfg["model"]].device == "cpu"
    with cpu.machine_lock() if on_cpu else contextlib.nullcontext():
        if on_cpu:
            ended, segments = cpu.cleanup_orphans()  # of a job killed outright (kill -9, OOM)
            if ended or segments:
                print(f"pdmctl: ended {ended} engine process(es) and removed {len(segments)} /dev/shm "
                      "segment(s) left by an engine job that was killed", flush=True)  # fmt: skip
        started = time.time()
        try:
            _run_trainer(command, env, on_line, stall_s=stall_s, keeper=keeper)
        finally:
            ended, segments = cpu.cleanup(tag, started, cpu.grace_seconds())
            if ended or segments:
                print(f"pdmctl: ended {ended} leftover engine process(es), removed {len(segments)} "
                      "/dev/shm segment(s)", flush=True)  # fmt: skip


VALIDATE_FIRST = "trainer.val_before_train=true"


def without_validation_on_resume(command: list[str], resumed_at: int) -> list[str]:
    """The trainer's command for an attempt that resumes from step `resumed_at`'s checkpoint, with no
    validation before its first step (`_validation_on_resume_is_redundant` says when)."""
    if VALIDATE_FIRST not in command:
        return command
    print(f"pdmctl: resuming from the checkpoint of step {resumed_at}: no validation before training "
          "(that step's evaluation is logged already, or it is not on the run's schedule)", flush=True)
    return [("trainer.val_before_train=false" if arg == VALIDATE_FIRST else arg) for arg in command]


def _validation_on_resume_is_redundant(cfg: Mapping[str, Any], step: int) -> bool:
    """Whether VeRL's validation before training, in an attempt resuming from step `step`, would add
    nothing. VeRL validates the checkpoint's weights again and logs them at that step: where the attempt
    that saved it logged that evaluation already, the tracker drops the second value (`resume.py`); where
    the step is not on the run's schedule (`test_freq`), it would put one run's curve off the grid its
    seeds share. Either way the whole evaluation (AIME24/25 avg@16 on a cluster: minutes of every GPU of
    the job) would be spent for nothing on each requeue. It runs where the step is on the schedule and
    its evaluation was lost (the attempt ended between the checkpoint and the log), or the tracking
    server cannot say."""
    test_freq = int(cfg.get("test_freq") or 0)
    last = cfg.get("total_training_steps") or MODEL_PRESETS[cfg["model"]].total_training_steps
    if step != last and (test_freq <= 0 or step % test_freq):
        return True
    run_id, uri = cfg.get("mlflow_run_id"), cfg.get("tracking_uri")
    if not (run_id and uri):
        return False
    try:
        from pdmctl.backends.verl.resume import logged_steps
        from pdmctl.ledger.store import _mlflow_client

        logged = logged_steps(_mlflow_client(str(uri)), str(run_id))
    except Exception:  # the store cannot say: validate, as VeRL would
        return False
    evals = [last for key, last in logged.items() if key.startswith("eval/")]
    return bool(evals) and min(evals) >= step


class EngineJobError(RuntimeError):
    """The VeRL trainer exited with an error; the message is its last exception line."""


# Ray's words for an actor or node lost with its machine (the trainer's error lines then name no cause of its own)
_NODE_DIED = re.compile(r"because its node has died|has been marked dead because the detector has missed")


_ERROR_LINE = re.compile(r"^(?:\w+\.)*\w*(?:Error|Exception|Interrupt)\b: .+")


STALL_ENV = "PDMCTL_ENGINE_STALL_S"  # seconds without progress before the trainer is ended as hung
DEFAULT_STALL_S = 1800.0  # where no preset says (a command run by hand)


def stall_seconds(preset: Any = None) -> float:
    """How long the trainer may make no progress (`progress.Watchdog`): PDMCTL_ENGINE_STALL_S (the cluster
    profile's `engine_stall_s`, or the user's), else the model preset's `stall_s`, else 30 min."""
    given = os.environ.get(STALL_ENV, "").strip()
    if not given:
        return float(getattr(preset, "stall_s", None) or DEFAULT_STALL_S)
    try:
        value = float(given)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise LaunchConfigError(f"{STALL_ENV}: must be a number of seconds > 0, got {given!r}")
    return value


class _Stalled(Exception):
    pass


LOG_FD_ENV = "PDMCTL_LOG_FD"  # the job body's fd of the job log (for its background steps' output)


def _log_fd() -> int | None:
    """A duplicate of this process's stdout for the trainer's command (None where stdout has no fd)."""
    try:
        return os.dup(sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):
        return None


def _default_signals() -> None:
    """In the trainer's process before it runs: SIGTERM unblocked. A SLURM job blocks it for itself
    (`executors.slurm.PdmctlJob`) and a blocked mask is inherited, so `terminate()` (a cancel, a pruned
    trial, a hang) would otherwise not reach the trainer or the job body."""
    import signal

    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _run_trainer(
    command: list[str], env: dict[str, str], on_line: Callable[[str], None] | None = None,
    stall_s: float | None = None, keeper: Any = None,
) -> None:  # fmt: skip
    """Run the trainer, its output passed through to the job log; a failure raises with its reason.

    The reason is the last `SomethingError: message` line the trainer printed (Ray prints the
    worker's exception last), so the ledger says what failed, not only an exit status. A trainer
    that makes no progress for `stall_s` seconds (`progress.Watchdog`: tokens generated, micro-batches
    trained, steps logged, a checkpoint's files growing; not prints) is ended as hung (a worker that
    died inside a collective, such as the weight sync, leaves the others waiting for ever).
    `keeper` (a `checkpoints.Keeper`) prunes the run's checkpoints while the trainer runs.
    """
    import queue
    import subprocess
    import threading

    from pdmctl.backends.verl.progress import Watchdog

    stall_s = stall_seconds() if stall_s is None else stall_s
    watchdog = Watchdog(stall_s)
    last_error = lost = ""
    lines: queue.Queue[str | None] = queue.Queue()
    log_fd = _log_fd()
    if log_fd is not None:  # the job body's background steps write to the log itself, not to this pipe
        env = {**env, LOG_FD_ENV: str(log_fd)}
    try:
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", bufsize=1, pass_fds=() if log_fd is None else (log_fd,),
                                preexec_fn=_default_signals)  # fmt: skip
    finally:
        if log_fd is not None:
            os.close(log_fd)
    stream = proc.stdout
    assert stream is not None

    def pump() -> None:  # a thread, so that silence can be timed (a blocked read cannot)
        try:
            for line in stream:
                lines.put(line)
        except (OSError, ValueError):
            pass
        finally:
            lines.put(None)

    threading.Thread(target=pump, name="pdmctl-trainer-output", daemon=True).start()
    if keeper is not None:
        keeper.watch(on_progress=watchdog.poke)
    try:
        while True:
            try:
                line = lines.get(timeout=1.0)
            except queue.Empty:
                if watchdog.stalled():
                    raise _Stalled from None
                continue
            if line is None:
                break
            watchdog.line(line)
            sys.stdout.write(line)
            if _ERROR_LINE.match(line.strip()):
                last_error = line.strip()
            if line.startswith("pdmctl: lost node ") or (not lost and _NODE_DIED.search(line)):
                lost = line.strip().removeprefix("pdmctl: lost node ")
            if on_line is not None:
                on_line(line)
            if watchdog.stalled():  # it prints, and makes no progress
                raise _Stalled
    except BaseException as exc:  # a cancel (SIGTERM -> job.Cancelled), a pruned trial, a hang: end it
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if isinstance(exc, _Stalled):
            after = f"; its last error line: {last_error}" if last_error else ""
            raise EngineJobError(f"{watchdog.reason()}{after}") from None
        raise
    finally:
        if keeper is not None:
            keeper.stop()
    proc.wait()
    stream.close()  # the pump has seen the end of it
    sys.stdout.flush()
    if proc.returncode != 0 and (lost or proc.returncode == NODE_LOST_STATUS):
        raise NodeLost(lost or f"the job body lost a node (exit {proc.returncode})")
    if proc.returncode != 0:
        raise EngineJobError(last_error or f"the VeRL trainer exited with status {proc.returncode}")



class InterfaceError(RuntimeError):
    """This node has no usable IPv4 address on the profile's network interface; the message is one line."""


def interface_address(interface: str) -> str:
    """The IPv4 address of `interface` on this node (its primary one, as the kernel reports it).

    Raises InterfaceError naming the node and the interface where there is no such interface, no IPv4
    address on it, or the interface is down: Ray would bind another network, or none that reaches the
    others, and the job would fail (or hang) much later.
    """
    import errno
    import fcntl
    import socket
    import struct

    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    request = struct.pack("256s", interface.encode()[:15])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            flags = struct.unpack_from("H", fcntl.ioctl(sock.fileno(), 0x8913, request), 16)[0]  # SIOCGIFFLAGS
        except OSError as exc:
            if exc.errno != errno.ENODEV:
                raise InterfaceError(f"node {node}: network interface {interface!r}: {exc.strerror}") from None
            names = ", ".join(sorted(name for _, name in socket.if_nameindex()))
            raise InterfaceError(f"node {node} has no network interface {interface!r} (the profile's "
                                 f"network_interface; its interfaces: {names})") from None  # fmt: skip
        if not flags & 0x1:  # IFF_UP
            raise InterfaceError(f"node {node}: network interface {interface!r} is down")
        try:
            packed = fcntl.ioctl(sock.fileno(), 0x8915, request)  # SIOCGIFADDR
        except OSError as exc:
            if exc.errno != errno.EADDRNOTAVAIL:
                raise InterfaceError(f"node {node}: network interface {interface!r}: {exc.strerror}") from None
            raise InterfaceError(f"node {node}: network interface {interface!r} has no IPv4 address") from None
    return socket.inet_ntoa(packed[20:24])


def print_node_address(interface: str) -> None:
    """`NODE ADDRESS` for the job body (one line per node), or `RuntimeError: ...` and exit status 1."""
    import socket

    try:
        address = interface_address(interface)
    except InterfaceError as exc:
        print(f"RuntimeError: {exc}", flush=True)
        sys.exit(1)
    print(f"{os.environ.get('SLURMD_NODENAME') or socket.gethostname()} {address}", flush=True)


def wait_for_ray(nodes: int, timeout_s: float) -> None:
    """Block until `nodes` Ray nodes are alive (the workers start asynchronously)."""
    import time

    import ray

    deadline = time.monotonic() + timeout_s
    address = os.environ.get("RAY_ADDRESS", "auto")
    if address != "auto":  # ray.init waits on an absent head without end: bound the wait ourselves
        _wait_for_port(address, deadline)
    ray.init(address=address, log_to_driver=False)
    try:
        while True:
            alive = sum(1 for node in ray.nodes() if node.get("Alive"))
            if alive >= nodes:
                print(f"pdmctl: {alive} Ray node(s) up", flush=True)
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {alive} of {nodes} Ray nodes came up within {timeout_s:.0f}s")
            time.sleep(1.0)
    finally:
        ray.shutdown()


def _wait_for_port(address: str, deadline: float) -> None:
    import socket
    import time

    host, _, port = address.rpartition(":")
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no Ray head answered at {address}: did `ray start --head` fail?"
                ) from None
            time.sleep(1.0)


def probe() -> None:
    """A task on the cluster in place of the trainer: the cluster starts, schedules, and sees the plugin env."""
    import socket

    import ray

    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=False)

    @ray.remote(num_cpus=1)
    def where() -> dict[str, str]:
        import pdmctl.backends.verl.jobbody  # noqa: F401  (the package imports on the worker)

        return {"host": socket.gethostname(), TOPK_ENV: os.environ.get(TOPK_ENV, "")}

    try:
        result = ray.get(where.remote(), timeout=120)
        nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
        print(f"PDMCTL_PROBE_OK host={result['host']} nodes={nodes}", flush=True)
    finally:
        ray.shutdown()


def train(overrides: list[str]) -> None:
    """VeRL's `main_ppo`, with pdmctl's fail-fast check before Ray starts the first rollout."""
    from verl.trainer.main_ppo import (
        TaskRunnerV1,
        auto_set_device,
        need_critic,
        need_reference_policy,
        run_ppo,
        validate_config,
    )

    from pdmctl.backends.verl.plugin import check_run_config

    config = compose(overrides)
    check_run_config(config)
    auto_set_device(config)
    validate_config(
        config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config)
    )
    if config.trainer.use_v1:  # as VeRL's own main_ppo chooses
        print("pdmctl: VeRL's V1 trainer (TransferQueue)", flush=True)
        run_ppo(config, task_runner_class=TaskRunnerV1)
    else:
        from verl.trainer.main_ppo_v0 import TaskRunner

        run_ppo(config, task_runner_class=TaskRunner)


def main(argv: list[str] | None = None) -> None:
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m pdmctl.backends.verl.jobbody")
    sub = parser.add_subparsers(dest="step", required=True)
    wait = sub.add_parser("wait-ray")
    wait.add_argument("--nodes", type=int, required=True)
    wait.add_argument("--timeout", type=float, default=300.0)
    sub.add_parser("probe")
    address = sub.add_parser("node-address")
    address.add_argument("--interface", required=True)
    train_parser = sub.add_parser("train")
    train_parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.step == "wait-ray":
        wait_for_ray(args.nodes, args.timeout)
    elif args.step == "probe":
        probe()
    elif args.step == "node-address":
        print_node_address(args.interface)
    else:
        train(args.overrides)


if __name__ == "__main__":
    main()
