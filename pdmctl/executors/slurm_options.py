"""The SLURM part of a cluster profile, read and checked: `SlurmOptions`.

Profile options (clusters/<name>.yaml, beside `executor: slurm`; all optional):

    partition, account, qos      where the jobs go (checked against `sinfo` where it can be)
    time                         limit per attempt: minutes, or SLURM's "D-HH:MM:SS" / "HH:MM:SS"
    nodes, gpus_per_node         per job; GPUs go in as --gres=gpu[:gpu_type]:N
    gpu_type                     e.g. h20 (only where the cluster names GPU types in its gres)
    cpus_per_task, mem_gb        per job (one task per job: the job itself srun's onto its nodes)
    sbatch                       extra lines: ["--constraint=h20", "--exclusive", ...]
    setup                        shell lines run before the job (module load, env activation)
    python                       the interpreter on the compute nodes (default: this one)
    signal_delay_s               USR2 this long before the time limit: checkpoint and requeue
    save_grace_s                 seconds the trainer may take after that USR2 (or a preemption's) to finish its step
                                 and checkpoint it before the job requeues (0: requeue at once, the steps since
                                 the last checkpoint redone; shorter than signal_delay_s)
    max_timeouts                 how many times a job may be requeued after hitting its time limit
    max_node_losses              how many lost nodes a run's jobs requeue themselves after (a node's Ray
                                 step ended, or Ray declared the node dead, mid-run; default 3; SLURM
                                 requeues on its own for a node it has seen fail)
    job_name                     the jobs' name in squeue (default: pdmctl)
    offline                      jobs never reach a model hub: HF_HUB_OFFLINE=1 (and TRANSFORMERS_ /
                                 HF_DATASETS_OFFLINE), weights and data checked on shared storage at
                                 submit (default: true)
    models_dir, data_dir         shared directories: one subdirectory per model (named as the hub id's
                                 last part, e.g. Qwen3-4B-Base) and VeRL's parquet files
    env                          a mapping exported in every job, so every node's steps and Ray
                                 workers see it (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME, NCCL_IB_HCA, ...)
    network                      the fabric's settings for NCCL and gloo, exported on every node before Ray
                                 and the trainer start and shown by --dry-run: a mapping of names from
                                 NETWORK_VARIABLES (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME, NCCL_IB_HCA,
                                 NCCL_DEBUG, ...) to plain values
    nccl_timeout                 seconds for VeRL's process-group operations (default: 1800 when a job
                                 has more than one node, VeRL's 600 otherwise)
    network_interface            the interface Ray binds on every node (e.g. ib0): each node's IPv4
                                 address on it goes to its `ray start --node-ip-address`, and the head's
                                 is the address the workers join (default: the head's first address)
    engine_stall_s               seconds a VeRL trainer may make no progress (tokens generated, micro-batches
                                 trained, steps, checkpoint bytes) before its job ends it as hung (default:
                                 the model preset's stall_s; exported as PDMCTL_ENGINE_STALL_S)
    throughput                   tokens per second per GPU, per model: {MODEL: {rollout: R, train: T}}, for
                                 the cost --dry-run prints (docs/CLUSTER.md, "Cost")
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from pdmctl.executors.base import ClusterProfile, ExecutorError


@dataclass(frozen=True)
class SlurmOptions:
    """The executor-specific part of a cluster profile, validated."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: int = 60  # minutes per attempt
    nodes: int = 1
    gpus_per_node: int = 0
    gpu_type: str | None = None
    cpus_per_task: int = 1
    mem_gb: float | None = None
    sbatch: tuple[str, ...] = ()
    setup: tuple[str, ...] = ()
    python: str | None = None
    signal_delay_s: int = 90
    save_grace_s: int = 0
    max_timeouts: int = 3
    max_node_losses: int = 3
    job_name: str = "pdmctl"
    offline: bool = True
    models_dir: str | None = None
    data_dir: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    network: tuple[tuple[str, str], ...] = ()
    nccl_timeout: int | None = None
    network_interface: str | None = None
    engine_stall_s: int | None = None
    throughput: tuple[tuple[str, float, float], ...] = ()  # (model, rollout, train) tokens/s per GPU

    @classmethod
    def from_profile(cls, profile: ClusterProfile) -> SlurmOptions:
        where = f"cluster {profile.name}"
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(profile.options) - known)
        if unknown:
            raise ExecutorError(f"{where}: unknown option {unknown[0]!r} for the slurm executor "
                                f"(known: {', '.join(sorted(known))})")  # fmt: skip
        values: dict[str, Any] = {}
        for name, value in profile.options.items():
            if value is None:
                continue
            if name == "time":
                values[name] = parse_time(value, where)
            elif name in ("nodes", "gpus_per_node", "cpus_per_task", "signal_delay_s", "max_timeouts", "nccl_timeout",
                          "engine_stall_s", "max_node_losses", "save_grace_s"):  # fmt: skip
                low = 1 if name in ("nodes", "cpus_per_task", "nccl_timeout", "engine_stall_s") else 0
                if not isinstance(value, int) or isinstance(value, bool) or value < low:
                    raise ExecutorError(f"{where}: {name}: must be an integer >= {low}, got {value!r}")
                values[name] = value
            elif name == "mem_gb":
                if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value < math.inf:
                    raise ExecutorError(f"{where}: mem_gb: must be a positive number, got {value!r}")
                values[name] = float(value)
            elif name == "offline":
                if not isinstance(value, bool):
                    raise ExecutorError(f"{where}: offline: must be true or false, got {value!r}")
                values[name] = value
            elif name in ("models_dir", "data_dir"):
                if not isinstance(value, str) or not value.strip() or not Path(value).is_absolute():
                    raise ExecutorError(f"{where}: {name}: must be an absolute path on the shared filesystem, "
                                        f"got {value!r}")  # fmt: skip
                values[name] = value
            elif name == "env":
                values[name] = _env_block(value, where)
            elif name == "network":
                values[name] = _network_block(value, where)
            elif name == "throughput":
                values[name] = _throughput_block(value, where)
            elif name == "network_interface":
                values[name] = _interface_name(value, where)
            elif name in ("sbatch", "setup"):
                if (
                    isinstance(value, str)
                    or not isinstance(value, list)
                    or not all(isinstance(v, str) for v in value)
                ):
                    raise ExecutorError(f"{where}: {name}: must be a list of strings, got {value!r}")
                values[name] = tuple(value)
            else:
                if not isinstance(value, str | int) or isinstance(value, bool) or not str(value).strip():
                    raise ExecutorError(f"{where}: {name}: must be a non-empty string, got {value!r}")
                values[name] = str(value)
        both = sorted({key for key, _ in values.get("env", ())} & {key for key, _ in values.get("network", ())})
        if both:
            raise ExecutorError(f"{where}: {both[0]}: set in both env: and network: (keep it in network:)")
        options = cls(**values)
        options.extra_sbatch(where)  # refuse malformed lines now, not at submission
        return options

    def extra_sbatch(self, where: str = "cluster") -> dict[str, str | bool]:
        """The `sbatch` lines as flags: "--constraint=h20" -> {"constraint": "h20"}, "--exclusive" -> True."""
        out: dict[str, str | bool] = {}
        for line in self.sbatch:
            text = line.strip().removeprefix("#SBATCH").strip()
            match = re.fullmatch(r"--([A-Za-z][\w-]*)(?:[= ]\s*(.+))?", text)
            if match is None:
                raise ExecutorError(f"{where}: sbatch: {line!r} is not a long option like '--constraint=h20'")
            out[match[1]] = True if match[2] is None else match[2].strip()
        return out

    @property
    def gres(self) -> str | None:
        if not self.gpus_per_node:
            return None
        return f"gpu:{self.gpu_type}:{self.gpus_per_node}" if self.gpu_type else f"gpu:{self.gpus_per_node}"


def _interface_name(value: Any, where: str) -> str:
    """A Linux network interface's name (at most 15 characters, no '/', ':' or blank: `ip link` names)."""
    if not isinstance(value, str) or re.fullmatch(r"[A-Za-z0-9_.-]{1,15}", value) is None or value in (".", ".."):
        raise ExecutorError(f"{where}: network_interface: must be the name of a network interface on the nodes "
                            f"(as `ip -br addr` lists it, e.g. ib0), got {value!r}")  # fmt: skip
    return value


# What `network:` may set: the interfaces and fabric of NCCL and gloo (torch.distributed's CPU backend), and
# NCCL's log level (NCCL's environment variables, docs.nvidia.com/deeplearning/nccl, "Environment Variables")
NETWORK_VARIABLES = frozenset({
    "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_IB_GID_INDEX", "NCCL_IB_TC", "NCCL_IB_SL",
    "NCCL_IB_DISABLE", "NCCL_IB_TIMEOUT", "NCCL_IB_RETRY_CNT", "NCCL_NET_GDR_LEVEL", "NCCL_CROSS_NIC",
    "NCCL_SOCKET_FAMILY", "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS",
})  # fmt: skip


def _network_block(value: Any, where: str) -> tuple[tuple[str, str], ...]:
    """`network:`: names from NETWORK_VARIABLES, each a plain value (printable, no blank at either end)."""
    if not isinstance(value, dict) or not value:
        raise ExecutorError(f"{where}: network: must be a mapping of NCCL/gloo variables to values "
                            f"(e.g. NCCL_SOCKET_IFNAME: ib0), got {value!r}")  # fmt: skip
    out = []
    for key, item in value.items():
        if key not in NETWORK_VARIABLES:
            raise ExecutorError(f"{where}: network: {key!r} is not one of {', '.join(sorted(NETWORK_VARIABLES))} "
                                "(anything else goes in env:)")  # fmt: skip
        if isinstance(item, bool) or not isinstance(item, str | int):
            raise ExecutorError(f"{where}: network: {key}: must be a string or a whole number, got {item!r}")
        text = str(item)
        if not text or not text.isprintable() or text != text.strip():
            raise ExecutorError(f"{where}: network: {key}: must be a plain value (printable, no control characters, "
                                f"no blank at either end), got {text!r}")  # fmt: skip
        out.append((key, text))
    return tuple(out)


def _env_block(value: Any, where: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict):
        raise ExecutorError(f"{where}: env: must be a mapping of variable names to values, got {value!r}")
    out = []
    for key, item in value.items():
        if not isinstance(key, str) or re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key) is None:
            raise ExecutorError(f"{where}: env: {key!r} is not a variable name")
        if isinstance(item, bool) or not isinstance(item, str | int | float):
            raise ExecutorError(f"{where}: env: {key}: must be a string or a number, got {item!r}")
        out.append((key, str(item)))
    return tuple(out)


def _throughput_block(value: Any, where: str) -> tuple[tuple[str, float, float], ...]:
    if not isinstance(value, dict):
        raise ExecutorError(f"{where}: throughput: must be a mapping of model: {{rollout: N, train: N}}, got {value!r}")
    out = []
    for model, rates in value.items():
        if not isinstance(rates, dict) or set(rates) != {"rollout", "train"} or not all(
            isinstance(r, int | float) and not isinstance(r, bool) and math.isfinite(r) and r > 0 for r in rates.values()
        ):  # fmt: skip
            raise ExecutorError(f"{where}: throughput: {model}: must be {{rollout: N, train: N}}, tokens per second "
                                f"per GPU (numbers > 0), got {rates!r}")  # fmt: skip
        out.append((str(model), float(rates["rollout"]), float(rates["train"])))
    return tuple(out)


def parse_time(value: Any, where: str = "cluster") -> int:
    """SLURM's time formats (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) -> whole minutes."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    text = str(value).strip()
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text)
    if match is None or isinstance(value, bool):
        raise ExecutorError(f"{where}: time: {value!r} is not minutes or D-HH:MM:SS")
    days, a, b, c = (int(g) if g else None for g in match.groups())
    if days is not None:  # D-HH[:MM[:SS]]
        seconds = days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    elif c is not None:  # HH:MM:SS
        seconds = a * 3600 + b * 60 + c
    elif b is not None:  # MM:SS
        seconds = a * 60 + b
    else:
        seconds = a * 60
    if seconds <= 0:
        raise ExecutorError(f"{where}: time: must be positive, got {value!r}")
    return -(-seconds // 60)
