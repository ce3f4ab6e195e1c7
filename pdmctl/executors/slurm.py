"""The SLURM executor: one job array per submission through submitit, state from one `sacct` call.

Profile options: `pdmctl.executors.slurm_options` (`SlurmOptions`).

How a job ends and what the ledger learns:
* Finished, failed: the job writes it into its MLflow run itself (`pdmctl.job`), and its exit code
  gives SLURM the same word.
* Time limit: SLURM sends USR2 `signal_delay_s` before it; submitit's handler asks the callable
  for a checkpoint (the same job again: the run resumes from run_dir/checkpoints by itself),
  requeues the job and exits; the next start is the next attempt (SLURM_RESTART_COUNT).
* Preemption, `scontrol requeue`, `scancel`: SLURM sends SIGTERM, then SIGKILL after KillWait.
  The job cannot tell these apart, so it blocks SIGTERM and leaves its run RUNNING; the scheduler
  knows, and `states` reports it (CANCELLED becomes KILLED in the ledger at the next `status`, a
  requeued job is PENDING and starts its next attempt from the checkpoint).

Where this goes around submitit, and why:
* State: submitit's watcher calls `sacct` for registered Job objects and turns its failures into
  UNKNOWN ("Bypassing sacct error"); `pdmctl status` runs in a new process with no Job objects,
  needs one call for a whole sweep and a `squeue` fallback where accounting is off. `states` runs
  one `sacct -X -j ARRAY,...` itself and parses pending ranges (`123_[4-999%8]`).
* Batch step, not srun: submitit would start the job through `srun` on every task of the
  allocation; a multi-node job (VeRL: Ray head + workers) must run once and srun itself. So
  `use_srun=False`, the interpreter is `exec`'d to become the batch shell, and the USR2 goes to
  the batch shell (`--signal=B:USR2@...`).
* Array size: submitit submits whatever it is given as one array; arrays are cut at the cluster's
  MaxArraySize here, the `%` limit shared out between the pieces.
"""

from __future__ import annotations

import contextlib
import getpass
import io
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import submitit

from pdmctl.executors.base import ClusterProfile, Executor, ExecutorError, JobRequest, JobState
from pdmctl.executors.slurm_options import SlurmOptions, parse_time

COMMANDS = ("sbatch", "squeue", "scancel", "sinfo", "scontrol")
DEFAULT_MAX_ARRAY_SIZE = 1001  # SLURM's default MaxArraySize
_TIMEOUT_S = 60  # for any one scheduler command

# sacct / squeue state -> ours. The first word only: sacct writes "CANCELLED by 0".
SLURM_STATES: dict[str, JobState] = {
    "PENDING": JobState.PENDING, "REQUEUED": JobState.REQUEUED, "REQUEUE_HOLD": JobState.REQUEUED,
    "REQUEUE_FED": JobState.REQUEUED, "RESV_DEL_HOLD": JobState.PENDING, "CONFIGURING": JobState.RUNNING,
    "RUNNING": JobState.RUNNING, "COMPLETING": JobState.RUNNING, "SUSPENDED": JobState.RUNNING,
    "STOPPED": JobState.RUNNING, "SIGNALING": JobState.RUNNING, "STAGE_OUT": JobState.RUNNING,
    "RESIZING": JobState.RUNNING, "COMPLETED": JobState.COMPLETED, "FAILED": JobState.FAILED,
    "SPECIAL_EXIT": JobState.FAILED, "CANCELLED": JobState.CANCELLED, "REVOKED": JobState.CANCELLED,
    "TIMEOUT": JobState.TIMEOUT, "DEADLINE": JobState.TIMEOUT, "PREEMPTED": JobState.PREEMPTED,
    "NODE_FAIL": JobState.NODE_FAIL, "BOOT_FAIL": JobState.NODE_FAIL, "OUT_OF_MEMORY": JobState.OUT_OF_MEMORY,
}  # fmt: skip
_ALIVE = frozenset({JobState.PENDING, JobState.REQUEUED, JobState.RUNNING})


class SlurmExecutor(Executor):
    name = "slurm"

    @classmethod
    def check_options(cls, profile: ClusterProfile) -> None:
        SlurmOptions.from_profile(profile)  # raises ExecutorError for an unknown key or a wrong type

    def __init__(self, profile: ClusterProfile) -> None:
        super().__init__(profile)
        self.options = SlurmOptions.from_profile(profile)
        self.folder = profile.run_root / ".slurm"  # submitit's pickles, sbatch scripts, scheduler logs
        self._config: dict[str, str] | None = None

    # --- before submission ---------------------------------------------------------------

    def check(self) -> None:
        """Refuse what `sinfo` shows cannot run: no SLURM, unknown partition, more nodes, GPUs,
        CPUs, memory or time than the partition has, more runs at once than it holds. What only the
        scheduler knows (accounts, QOS, constraints) is refused by sbatch, and `submit` reports its reason."""
        where = f"cluster {self.profile.name}"
        missing = [c for c in COMMANDS if shutil.which(c) is None]
        if missing:
            raise ExecutorError(f"{where}: SLURM commands not found here ({', '.join(missing)}); "
                                "submit from a login node of the cluster")  # fmt: skip
        self.check_partitions(self._partitions())

    def check_partitions(self, partitions: dict[str, _Partition]) -> None:
        """`check` against partitions as `sinfo` describes them (`parse_partitions`)."""
        where = f"cluster {self.profile.name}"
        opts = self.options
        if not partitions:
            raise ExecutorError(f"{where}: sinfo shows no partitions")
        if opts.partition is None:
            name = next((p.name for p in partitions.values() if p.default), None)
            if name is None:
                raise ExecutorError(f"{where}: the cluster has no default partition; set `partition`")
        else:
            name = opts.partition
        part = partitions.get(name)
        if part is None:
            raise ExecutorError(f"{where}: partition {name!r} does not exist (partitions: "
                                f"{', '.join(sorted(partitions))})")  # fmt: skip
        label = f"{where}: partition {name}"
        if not part.up:
            raise ExecutorError(f"{label} is not up (sinfo: {part.availability})")
        if opts.nodes > part.nodes:
            raise ExecutorError(f"{label} has {part.nodes} node(s); the profile asks for nodes: {opts.nodes}")
        if opts.gpus_per_node > part.max_gpus(opts.gpu_type):
            kind = f"{opts.gpu_type} GPUs" if opts.gpu_type else "GPUs"
            raise ExecutorError(f"{label}: no node has {opts.gpus_per_node} {kind} (the most is "
                                f"{part.max_gpus(opts.gpu_type)}; gres: {', '.join(sorted(part.gres)) or 'none'}); "
                                f"the profile asks for gpus_per_node: {opts.gpus_per_node}")  # fmt: skip
        if opts.cpus_per_task > part.max_cpus:
            raise ExecutorError(f"{label}: no node has {opts.cpus_per_task} CPUs (the most is {part.max_cpus}); "
                                f"the profile asks for cpus_per_task: {opts.cpus_per_task}")  # fmt: skip
        if opts.mem_gb is not None and opts.mem_gb * 1024 > part.max_mem_mb:
            raise ExecutorError(f"{label}: no node has {opts.mem_gb:g} GB of memory (the most is "
                                f"{part.max_mem_mb / 1024:g} GB); the profile asks for mem_gb: {opts.mem_gb:g}")  # fmt: skip
        if part.time_limit_min is not None and opts.time > part.time_limit_min:
            raise ExecutorError(f"{label} allows {part.time_limit_min} min per job; the profile asks for "
                                f"time: {opts.time} min")  # fmt: skip
        if opts.save_grace_s and opts.save_grace_s >= opts.signal_delay_s:
            raise ExecutorError(f"{where}: save_grace_s ({opts.save_grace_s} s) must be shorter than signal_delay_s "
                                f"({opts.signal_delay_s} s): the save on the way out ends before the time limit")  # fmt: skip
        if opts.signal_delay_s >= opts.time * 60:
            raise ExecutorError(f"{where}: signal_delay_s ({opts.signal_delay_s} s) must be shorter than "
                                f"the time limit ({opts.time} min)")  # fmt: skip
        concurrent = self.profile.max_concurrent
        per_node, why = self.jobs_per_node(part)
        at_once = part.nodes * per_node // opts.nodes
        if concurrent is not None and concurrent > at_once:
            raise ExecutorError(f"{label} has {part.nodes} node(s) and a job takes {opts.nodes} node(s), {why}: "
                                f"max_concurrent {concurrent} x nodes {opts.nodes} cannot run at once; at most "
                                f"{at_once} can (set max_concurrent: {at_once})")  # fmt: skip

    def jobs_per_node(self, part: _Partition) -> tuple[int, str]:
        """How many of this profile's jobs one node of the partition holds at once, and why."""
        opts = self.options
        extra = opts.extra_sbatch()
        if "exclusive" in extra:
            return 1, "each whole (--exclusive)"
        if str(extra.get("mem", "")).strip() == "0":
            return 1, "all of each one's memory (--mem=0)"
        if self._select_type() == "select/linear":
            return 1, "each whole (SelectType=select/linear)"
        fits = {"CPUs": part.max_cpus // opts.cpus_per_task}
        if opts.gpus_per_node:
            fits["GPUs"] = part.max_gpus(opts.gpu_type) // opts.gpus_per_node
        if opts.mem_gb:
            fits["memory"] = int(part.max_mem_mb // (opts.mem_gb * 1024))
        limit = min(fits, key=lambda k: fits[k])
        count = max(1, fits[limit])
        return count, f"{count} job(s) to a node by its {limit}"

    def _select_type(self) -> str:
        try:
            return self._scheduler_config().get("SelectType", "")
        except ExecutorError:
            return ""

    def nodes_per_job(self) -> int:
        return self.options.nodes

    def _partitions(self) -> dict[str, _Partition]:
        return parse_partitions(_run(["sinfo", "-h", "-o", SINFO_FORMAT], what="sinfo"))

    def max_array_size(self) -> int:
        """Tasks per array: the cluster's MaxArraySize (indices 0 .. MaxArraySize-1)."""
        try:
            value = self._scheduler_config().get("MaxArraySize", "")
        except ExecutorError:
            return DEFAULT_MAX_ARRAY_SIZE
        return int(value) if value.isdigit() and int(value) > 0 else DEFAULT_MAX_ARRAY_SIZE

    def _scheduler_config(self) -> dict[str, str]:
        if self._config is None:
            out = _run(["scontrol", "show", "config"], what="scontrol show config")
            self._config = {
                k.strip(): v.strip() for k, _, v in (ln.partition("=") for ln in out.splitlines()) if v
            }
        return self._config

    # --- submission -----------------------------------------------------------------------

    def submit(self, requests: Sequence[JobRequest]) -> list[str]:
        if not requests:
            return []
        job_ids: list[str] = []
        groups = self._groups([r.nodes for r in requests])
        try:
            for nodes, part, parallelism in self._arrays([(n, len(members)) for n, members in groups]):
                chunk = [requests[i] for i in dict(groups)[nodes][part]]
                executor = self._submitit_executor(parallelism, _comment(chunk), nodes)
                # sbatch's own complaint goes into the ExecutorError, not onto the terminal twice
                with contextlib.redirect_stderr(io.StringIO()):
                    jobs = executor.map_array(PdmctlJob(), [str(r.job_file) for r in chunk],
                                              [str(r.log_file) for r in chunk])  # fmt: skip
                job_ids += [job.job_id for job in jobs]
        except Exception as exc:
            if job_ids:  # never leave half a grid running unrecorded
                self.cancel(job_ids)
            raise ExecutorError(
                f"cluster {self.profile.name}: sbatch refused the job array: {_reason(exc)}"
            ) from exc
        return job_ids

    def _groups(self, nodes: Sequence[int | None]) -> list[tuple[int, list[int]]]:
        """The jobs' positions by node count (None: the profile's), in the order the counts first come. The
        runs of one count are contiguous in a submission (orchestrate orders them so), as `find` needs."""
        groups: dict[int, list[int]] = {}
        for i, n in enumerate(nodes):
            groups.setdefault(n or self.options.nodes, []).append(i)
        return list(groups.items())

    def _arrays(self, groups: Sequence[tuple[int, int]]) -> list[tuple[int, slice, int]]:
        """One array per node count (`groups`: (nodes, jobs) each), cut at MaxArraySize: (nodes, its tasks,
        its %-limit). The profile's max_concurrent counts jobs of its `nodes`, and a job of fewer nodes packs
        side by side with others in one of those shares (nodes // its nodes to a share). Each node count's
        array may fill every share: a %-limit split between them would leave one count's shares idle once
        its runs are done, while the other's wait. Together they hold at most the partition (the `slurm`
        check holds max_concurrent x nodes against it), the earlier array's runs first."""
        size, cap, out = self.max_array_size(), self.profile.max_concurrent, []
        for nodes, n in groups:
            parts = [slice(i, min(i + size, n)) for i in range(0, n, size)]
            own = None if cap is None else cap * max(1, self.options.nodes // nodes)
            for i, part in enumerate(parts):
                count = part.stop - part.start
                share = count if own is None else max(1, own // len(parts) + (i < own % len(parts)))
                out.append((nodes, part, min(share, count)))
        return out

    def sbatch_parameters(self, parallelism: int, nodes: int | None = None) -> dict[str, Any]:
        """submitit's parameters for one array (its own names; see submitit.slurm.slurm._make_sbatch_string)."""
        opts = self.options
        extra: dict[str, str | bool] = {
            "requeue": True,  # sites may default to JobRequeue=0; preempted jobs must come back
            # the job runs as the batch shell (exec, no srun): the checkpoint signal must go to it
            "signal": f"B:{submitit.JobEnvironment.USR_SIG}@{opts.signal_delay_s}",
            **opts.extra_sbatch(),
        }
        setup = [
            f"export PDMCTL_EXECUTOR=slurm PDMCTL_NUM_THREADS=${{SLURM_CPUS_PER_TASK:-{opts.cpus_per_task}}} "
            f"PDMCTL_SAVE_GRACE_S={opts.save_grace_s}",
            "export OMP_NUM_THREADS=$PDMCTL_NUM_THREADS",
            *self.job_exports(),
            *_fatal(opts.setup),
            *(f"export {key}={shlex.quote(value)}" for key, value in opts.env),  # after setup: the profile wins
            *(f"export {key}={shlex.quote(value)}" for key, value in opts.network),  # every node's srun steps inherit it
        ]
        params: dict[str, Any] = {
            "job_name": opts.job_name, "time": opts.time, "nodes": nodes or opts.nodes, "ntasks_per_node": 1,
            "cpus_per_task": opts.cpus_per_task, "signal_delay_s": opts.signal_delay_s, "setup": setup,
            "array_parallelism": parallelism, "stderr_to_stdout": True, "use_srun": False,
            "additional_parameters": extra,
        }  # fmt: skip
        for key, value in (("partition", opts.partition), ("account", opts.account), ("qos", opts.qos),
                           ("gres", opts.gres), ("mem", _mem(opts.mem_gb))):  # fmt: skip
            if value is not None:
                params[key] = value
        return params

    def job_exports(self) -> list[str]:
        """The profile's settings as the job's environment (read by the backends inside the job)."""
        opts = self.options
        lines = ["export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1"] if opts.offline else []
        for var, value in (("PDMCTL_MODELS_DIR", opts.models_dir), ("PDMCTL_DATA_DIR", opts.data_dir),
                           ("PDMCTL_NCCL_TIMEOUT", opts.nccl_timeout),
                           ("PDMCTL_RAY_INTERFACE", opts.network_interface),
                           ("PDMCTL_ENGINE_STALL_S", opts.engine_stall_s),
                           ("PDMCTL_MAX_NODE_LOSSES", opts.max_node_losses)):  # fmt: skip
            if value is not None:
                lines.append(f"export {var}={shlex.quote(str(value))}")
        return lines

    def job_settings(self) -> dict[str, Any]:
        opts = self.options
        return {"offline": opts.offline, "models_dir": opts.models_dir, "data_dir": opts.data_dir,
                "nccl_timeout": opts.nccl_timeout, "network_interface": opts.network_interface,
                "env": dict(opts.env), "network": dict(opts.network), "time": opts.time,
                "max_timeouts": opts.max_timeouts, "max_node_losses": opts.max_node_losses,
                "save_grace_s": opts.save_grace_s,  # a save on the way out: the cost's requeues redo no step
                "throughput": {model: {"rollout": r, "train": t} for model, r, t in opts.throughput}}  # fmt: skip

    @property
    def python(self) -> str:
        # exec: the interpreter replaces the batch shell, so the batch step's signals reach it
        return f"exec {shlex.quote(self.options.python or sys.executable)}"

    def _submitit_executor(self, parallelism: int, comment: str | None = None,
                           nodes: int | None = None) -> submitit.SlurmExecutor:  # fmt: skip
        self.folder.mkdir(parents=True, exist_ok=True)
        executor = submitit.SlurmExecutor(folder=self.folder, max_num_timeout=self.options.max_timeouts,
                                          python=self.python)  # fmt: skip
        params = self.sbatch_parameters(parallelism, nodes)
        if comment is not None:
            params["additional_parameters"] = {**params["additional_parameters"], "comment": comment}
        executor.update_parameters(**params)
        return executor

    def find(self, submissions: Sequence[str]) -> dict[str, str]:
        """The scheduler's jobs for these submissions, by the array's comment (`_comment`). A job that
        started told the ledger its id itself, so the queue (squeue) is all there is to search."""
        wanted = {tuple(s.split(":")[:2]): s for s in submissions}
        if not wanted:
            return {}
        out = _run(["squeue", "-h", "-r", "-t", "all", "-u", getpass.getuser(), "-o", "%i|%k"], what="squeue")
        found = {}
        for line in out.splitlines():
            job_id, _, comment = line.strip().partition("|")
            match = re.fullmatch(r"pdmctl:(\w+):(\d+)", comment.strip())
            task = job_id.partition("_")[2] or "0"  # submitit sends a one-job submission as a plain job
            if match is None or not task.isdigit():
                continue
            submission = wanted.get((match[1], str(int(match[2]) + int(task))))
            if submission is not None:
                found[submission] = job_id
        return found

    def describe(self, requests: Sequence[JobRequest | None], nodes: Sequence[int | None] = ()) -> str:
        n = len(requests)
        if n == 0:
            return "nothing to submit"
        groups = self._groups([*nodes, *[None] * (n - len(nodes))][:n])
        arrays = self._arrays([(count, len(members)) for count, members in groups])
        lines = [f"{n} job(s) as {len(arrays)} SLURM job array(s) (MaxArraySize {self.max_array_size()}):"]
        for count, part, parallelism in arrays:
            share = self.options.nodes // count
            packed = f", {share} side by side in each of max_concurrent's shares" if share > 1 else ""
            lines.append(f"  sbatch --array=0-{part.stop - part.start - 1}%{parallelism} --nodes={count}  "
                         f"({part.stop - part.start} run(s) of {count} node(s){packed})")  # fmt: skip
        from submitit.slurm.slurm import _make_sbatch_string  # the exact text submitit writes

        params = self.sbatch_parameters(arrays[0][2], arrays[0][0])
        command = f"{self.python} -u -m submitit.core._submit {shlex.quote(str(self.folder))}"
        script = _make_sbatch_string(command=command, folder=self.folder,
                                     map_count=arrays[0][1].stop - arrays[0][1].start, **params)  # fmt: skip
        lines += ["sbatch script of the first array:", *("  " + ln for ln in script.splitlines())]
        return "\n".join(lines)

    # --- state and cancel -----------------------------------------------------------------

    def states(self, job_ids: Sequence[str]) -> dict[str, JobState]:
        """One `sacct` call for all the jobs' arrays; `squeue` for what sacct does not know (accounting
        off, or a job submitted a moment ago that slurmdbd has not recorded yet)."""
        wanted = list(dict.fromkeys(job_ids))
        if not wanted:
            return {}
        bases = sorted({_base(j) for j in wanted})
        found: dict[str, JobState] = {}
        try:
            out = _run(["sacct", "-n", "-P", "-X", "-o", "JobID,State", "-j", ",".join(bases)], what="sacct")
            found.update(parse_job_states(out))
        except ExecutorError:
            pass  # accounting is off (or slurmdbd is down): squeue knows the jobs slurmctld still holds
        missing = [j for j in wanted if j not in found]
        # a job that lost a node (or was preempted) and that SLURM requeues: sacct's last record says
        # NODE_FAIL until slurmctld has requeued it (seconds), while the job waits for its next attempt;
        # slurmctld's own word (squeue) wins where it still holds the job alive
        requeued = [j for j in wanted if found.get(j) in (JobState.NODE_FAIL, JobState.PREEMPTED)]
        if missing or requeued:
            live = self._squeue_states([*missing, *requeued])
            found.update({j: s for j, s in live.items() if j in missing or s in _ALIVE})
        return {j: found.get(j, JobState.UNKNOWN) for j in wanted}

    def _squeue_states(self, job_ids: Sequence[str]) -> dict[str, JobState]:
        bases = sorted({_base(j) for j in job_ids})
        try:
            out = _run(
                ["squeue", "-h", "-r", "-t", "all", "-j", ",".join(bases), "-o", "%i|%T"], what="squeue"
            )
        except ExecutorError:
            return {}  # "Invalid job id": slurmctld forgot them all (MinJobAge passed)
        return parse_job_states(out)

    def cancel(self, job_ids: Sequence[str]) -> None:
        ids = list(dict.fromkeys(job_ids))
        for i in range(0, len(ids), 500):
            _run(["scancel", *ids[i : i + 500]], what="scancel", check=False)


# ---------------------------------------------------------------------------
# What each array task runs
# ---------------------------------------------------------------------------


class PdmctlJob(submitit.helpers.Checkpointable):
    """The callable submitit pickles for every task: the job entry point, with its output in the run's
    log and SIGTERM left to the scheduler.

    Checkpointable's `checkpoint` resubmits this same call: the backend resumes from
    run_dir/checkpoints on its own, so the requeued attempt needs nothing else.
    """

    def __call__(self, job_file: str, log_file: str) -> int:
        # Under SLURM a SIGTERM means cancel, preemption or requeue alike, and SIGKILL follows;
        # blocked (children inherit the mask), the run stays RUNNING and `sacct` tells which it was.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        from pdmctl.job import JobFile, run

        restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
        log = Path(log_file)
        if restarts:  # a requeued start is the next attempt; `pdmctl logs` reads attempt-<n>.log
            log = log.with_name(f"attempt-{JobFile.read(Path(job_file)).attempt + restarts}.log")
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab", buffering=0) as fh:
            os.dup2(fh.fileno(), 1)
            os.dup2(fh.fileno(), 2)
        print(f"pdmctl slurm: job {os.environ.get('SLURM_JOB_ID')} on {os.uname().nodename}, "
              f"restart {restarts}", flush=True)  # fmt: skip
        from pdmctl import wayout

        wayout.install(Path(JobFile.read(Path(job_file)).run_dir))  # save on the way out (save_grace_s)
        code = run(Path(job_file))
        if code:
            raise SystemExit(code)  # SLURM's FAILED matches the run's own word
        return code


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


@dataclass
class _Partition:
    name: str
    default: bool
    availability: str
    time_limit_min: int | None
    nodes: int = 0
    max_cpus: int = 0
    max_mem_mb: int = 0
    gres: set[str] | None = None

    def __post_init__(self) -> None:
        self.gres = set() if self.gres is None else self.gres

    @property
    def up(self) -> bool:
        return self.availability.lower() == "up"

    def max_gpus(self, gpu_type: str | None) -> int:
        """The most GPUs (of that type, if given) on one node: gres like gpu:8, gpu:h20:8(S:0-1)."""
        best = 0
        for item in self.gres or ():
            parts = re.sub(r"\(.*?\)", "", item).split(":")
            if parts[0] != "gpu" or not parts[-1].isdigit():
                continue
            if gpu_type is not None and (len(parts) < 3 or parts[1] != gpu_type):
                continue
            best = max(best, int(parts[-1]))
        return best


SINFO_FORMAT = "%P|%a|%l|%D|%c|%m|%G"  # partition, availability, time limit, nodes, CPUs, memory (MB), gres


def parse_partitions(text: str) -> dict[str, _Partition]:
    """`sinfo -h -o SINFO_FORMAT` lines -> the partitions (one line per node group, summed by partition)."""
    partitions: dict[str, _Partition] = {}
    for line in text.splitlines():
        cols = line.strip().split("|")
        if len(cols) != 7:
            continue
        raw, avail, limit, nodes, cpus, mem, gres = cols
        name = raw.rstrip("*")
        part = partitions.setdefault(name, _Partition(name, raw.endswith("*"), avail, _limit_min(limit)))
        part.nodes += int(nodes or 0)
        part.max_cpus = max(part.max_cpus, _int_prefix(cpus))
        part.max_mem_mb = max(part.max_mem_mb, _int_prefix(mem))
        part.gres.update(g for g in gres.split(",") if g and g != "(null)")
    return partitions


def parse_job_states(text: str) -> dict[str, JobState]:
    """`ID|STATE` lines of sacct or squeue -> job id -> state; pending ranges `123_[0-9,12%4]` expanded."""
    out: dict[str, JobState] = {}
    for line in text.splitlines():
        job, _, raw = line.strip().partition("|")
        if not job or not raw:
            continue
        words = raw.split()
        state = SLURM_STATES.get(words[0].rstrip("+"), JobState.UNKNOWN) if words else JobState.UNKNOWN
        for job_id in expand_job_id(job):
            out[job_id] = state
    return out


def expand_job_id(job: str) -> list[str]:
    """'123_[0-3,7%2]' -> ['123_0', ..., '123_3', '123_7']; other ids as they are."""
    match = re.fullmatch(r"(\d+)_\[([^\]]+)\]", job)
    if match is None:
        return [job]
    base, spec = match[1], match[2].split("%")[0]
    out = []
    for item in spec.split(","):
        low, _, high = item.partition("-")
        out += [f"{base}_{i}" for i in range(int(low), int(high or low) + 1)]
    return out


def _fatal(setup: Sequence[str]) -> list[str]:
    """The profile's setup lines, each one's failure ending the job there, with the line named in the job's
    output: a module that does not load or an environment that does not activate fails now, not as an
    import error hours later on another node (no `|| true` around them)."""
    if not setup:
        return []
    return ["set -e", "trap 'echo \"RuntimeError: a setup line of the cluster profile failed (exit $?): "
            "$BASH_COMMAND\" >&2' ERR", *setup, "trap - ERR", "set +e"]


def _comment(requests: Sequence[JobRequest]) -> str | None:
    """`pdmctl:TOKEN:FIRST`: the submission token and the index of the array's task 0 in it."""
    if not requests or not requests[0].submission:
        return None
    token, first = requests[0].submission.split(":")[:2]
    return f"pdmctl:{token}:{first}"


def _base(job_id: str) -> str:
    return job_id.split("_")[0]


def _limit_min(text: str) -> int | None:
    text = text.strip()
    if not text or text.lower() in ("infinite", "unlimited", "n/a"):
        return None
    try:
        return parse_time(text)
    except ExecutorError:
        return None


def _int_prefix(text: str) -> int:
    match = re.match(r"\d+", text.strip())
    return int(match[0]) if match else 0


def _mem(mem_gb: float | None) -> str | None:
    if mem_gb is None:
        return None
    return f"{int(mem_gb)}G" if mem_gb == int(mem_gb) else f"{round(mem_gb * 1024)}M"


def _run(cmd: list[str], *, what: str, check: bool = True) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ExecutorError(f"{what}: {exc}") from exc
    if check and proc.returncode != 0:
        raise ExecutorError(f"{what}: {_first_error(proc.stderr) or f'exit code {proc.returncode}'}")
    return proc.stdout


def _first_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:  # sbatch: "sbatch: error: Batch job submission failed: Invalid qos specification"
        if "failed:" in ln:
            return ln.split("failed:", 1)[1].strip()
    for ln in lines:
        if "error:" in ln:
            return ln.split("error:", 1)[1].strip()
    return lines[0] if lines else ""


def _reason(exc: BaseException) -> str:
    text = str(exc).strip()
    return (_first_error(text) or text.splitlines()[0]) if text else type(exc).__name__
