"""`pdmctl doctor --cluster NAME`: is this cluster ready for a sweep, checked before the queue wait.

On the login node it checks what the login node can see (the profile filled in, the partition as profiled,
the tracking server, the shared paths, the disk for the checkpoints); with `--job` it then runs the node's
checks on every node of a job of the profile's size (`srun`, one task a node, the profile's setup lines and
environment first), then those across the nodes (pdmctl.doctor.nodes: shared files, an all-reduce measuring
bandwidth, Ray with every node joined), and `--on-node` is that half, run inside the job: the driver against
the CUDA build of torch, the GPU count and model against the profile's gres and gpu_type (the memory
reported), /dev/shm and the locked-memory limit against the GPUs and InfiniBand, the engine's imports (vLLM,
the presets' attention, VeRL, the Megatron half, Transformer Engine), the model and data paths, the tracking
server (and the login, never over plain http:// beyond loopback) from the node, the disk (free space and,
where lfs or mmlsquota reads it, the quota: pdmctl.doctor.quota). One line per check; the first that fails
ends it with exit code 2.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdmctl.doctor.quota import Quota, QuotaUnread, read_quota
from pdmctl.executors import ClusterProfile

SMI_QUERY = ["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total", "--format=csv,noheader"]

# The oldest Linux driver each CUDA major release runs on (NVIDIA's CUDA Toolkit release notes, table 3:
# minor-version compatibility within a major release). torch's CUDA 13 builds need an R580 driver.
MIN_DRIVER = {11: (450, 80, 2), 12: (525, 60, 13), 13: (580, 65, 6)}

# the engine's imports: (check name, modules tried in order: the first that imports is taken)
IMPORTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("vllm", ("vllm",)),
    # the presets' attention (presets.HF_ATTENTION, MEGATRON_ATTENTION): transformers' SDPA here, Transformer
    # Engine's cuDNN attention with transformer_engine below; never flash_attn, which the engine lock lacks
    ("attention", ("transformers.integrations.sdpa_attention",)),
    ("verl", ("verl",)),
    ("megatron", ("megatron.core",)),
    ("megatron-bridge", ("megatron.bridge", "mbridge")),  # VeRL 0.9.1's default, else its legacy path
    ("transformer-engine", ("transformer_engine.pytorch",)),
)
LOGIN_CHECKS = ("placeholders", "slurm", "nodes-driver", "tracking", "paths", "disk")
NODE_CHECKS = ("placeholders", "nvidia-smi", "driver", "gpus", "network-interface", "shm", "memlock",
               *(name for name, _ in IMPORTS), "paths", "tracking", "disk")  # fmt: skip
SHM_PER_GPU = 10**9  # bytes of /dev/shm free per GPU of the node (at least one GPU's worth on a CPU node)
INFINIBAND = Path("/sys/class/infiniband")  # the node's RDMA devices, where NCCL registers memory


class CheckFailed(Exception):
    """A check that failed; the message is its one line."""


def _on_loopback(host: str) -> bool:
    """Whether every address `host` resolves to is this machine's loopback (a name that does not resolve: no)."""
    import ipaddress
    import socket

    try:
        return all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback
                   for info in socket.getaddrinfo(host, None))  # fmt: skip
    except (OSError, ValueError):
        return False


def _login_needed_beyond_this_machine(uri: str) -> None:
    """A tracking server that answers without a login, at an address other machines reach: whoever
    reaches it can change or delete every run (one on loopback, reached from this machine only, passes)."""
    from urllib.parse import urlsplit

    host = urlsplit(uri).hostname or ""
    if not _on_loopback(host):
        raise CheckFailed(
            f"tracking server {uri}: answers without a login, so whoever reaches {host} can change or delete every "
            "run: serve it with `pdmctl server start` (a login per user) and set MLFLOW_TRACKING_USERNAME and "
            "MLFLOW_TRACKING_PASSWORD where you submit"
        )


LOGIN_VARIABLES = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")


def login_in_clear(uri: str, environ: Mapping[str, str]) -> None:
    """A login sent over plain http:// to another machine crosses the network in clear (every call of every
    run carries it, readable by anyone on the path); loopback, https:// and no login pass."""
    from urllib.parse import urlsplit

    parts = urlsplit(uri)
    given = [name for name in LOGIN_VARIABLES if environ.get(name)]
    if parts.scheme != "http" or not given or _on_loopback(parts.hostname or ""):
        return
    raise CheckFailed(f"tracking server {uri}: plain http:// to {parts.hostname}, and a login is set ({given[0]}): "
                      "it would cross the network in clear with every call; serve HTTPS (`pdmctl server start "
                      "--tls`) and give https://, or reach the server through loopback (an SSH tunnel)")  # fmt: skip


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    driver: str
    memory_mib: int | None


def parse_nvidia_smi(text: str) -> list[Gpu]:
    """`nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader` -> the GPUs.
    A line that is not four fields (an error nvidia-smi prints, 'No devices were found') raises CheckFailed."""
    gpus = []
    for line in text.splitlines():
        if not line.strip():
            continue
        cols = [c.strip() for c in line.split(",")]
        if len(cols) != 4 or not cols[0].isdigit():
            raise CheckFailed(line.strip()[:200])
        mem = re.match(r"(\d+)\s*MiB", cols[3])
        gpus.append(Gpu(int(cols[0]), cols[1], cols[2], int(mem[1]) if mem else None))
    return gpus


def parse_version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def check_driver(driver: str, torch_cuda: str | None) -> str:
    """The driver runs torch's CUDA build (the line to print), else CheckFailed."""
    if not torch_cuda:
        raise CheckFailed("torch is a CPU build (torch.version.cuda is None): install the CUDA build of torch")
    major = parse_version(torch_cuda)[0]
    need = MIN_DRIVER.get(major)
    if need is None:
        raise CheckFailed(f"torch is built for CUDA {torch_cuda}, which this check does not know (known: "
                          f"{', '.join(map(str, MIN_DRIVER))})")  # fmt: skip
    have = parse_version(driver)
    want = ".".join(map(str, need))
    if have < need:
        raise CheckFailed(f"driver {driver} is older than CUDA {torch_cuda} needs (>= {want}, R{need[0]}): torch's "
                          f"CUDA {major} build cannot start; install a torch built for an older CUDA, or update the driver")  # fmt: skip
    return f"driver {driver} runs torch's CUDA {torch_cuda} build (needs >= {want})"


def gpu_type_matches(gpu_type: str, name: str) -> bool:
    """Whether nvidia-smi's GPU name is the profile's gpu_type: its words (case and separators aside) are a run
    of the name's words: h20 is NVIDIA H20 and not NVIDIA H200; a100 is NVIDIA A100-SXM4-80GB; SLURM's
    autodetected type nvidia_h100_80gb_hbm3 is NVIDIA H100 80GB HBM3; rtx4090 is NVIDIA GeForce RTX 4090."""
    want = re.sub(r"[^a-z0-9]", "", gpu_type.lower())
    words = re.findall(r"[a-z0-9]+", name.lower())
    return any("".join(words[i:j]) == want for i in range(len(words)) for j in range(i + 1, len(words) + 1))


def _gib(mib: int) -> str:
    return f"{mib / 1024:.1f} GiB"


def check_gpus(gpus: Sequence[Gpu], wanted: int, gpu_type: str | None) -> str:
    """The node's GPUs against the profile: as many as gpus_per_node, each of its gpu_type where set; the
    memory reported (no profile field or model preset states a memory need)."""
    if len(gpus) < wanted:
        raise CheckFailed(f"{len(gpus)} GPU(s) visible, the profile's gres asks for {wanted} per node "
                          f"(gpus_per_node: {wanted})")  # fmt: skip
    names = sorted({g.name for g in gpus})
    other = sorted({g.name for g in gpus if gpu_type and not gpu_type_matches(gpu_type, g.name)})
    if other:
        raise CheckFailed(f"the GPUs are {', '.join(names)}, the profile's gpu_type is {gpu_type}"
                          + (f" ({', '.join(other)} is not)" if len(names) > 1 else ""))  # fmt: skip
    mems = sorted({g.memory_mib for g in gpus if g.memory_mib is not None})
    memory = ("memory not reported" if not mems else f"{_gib(mems[0])} each" if len(mems) == 1
              else f"{_gib(mems[0])} to {_gib(mems[-1])}")  # fmt: skip
    return f"{len(gpus)} GPU(s) ({', '.join(names)}, {memory}), the profile asks for {wanted} per node"


def checkpoint_plan(specs: Sequence[Any]) -> tuple[int, int]:
    """(bytes the runs' checkpoints keep at most, runs with checkpoints counted): VeRL runs (launch's plan)."""
    from pdmctl.backends.registry import flat_config

    total = counted = 0
    for spec in specs:
        if spec.backend != "verl":
            continue
        from pdmctl.backends.registry import _verl_job_config
        from pdmctl.backends.verl import launch

        size, kept, _ = launch.checkpoint_bytes(_verl_job_config(flat_config(spec.config), Path("/pdmctl-doctor")))
        total += size * kept
        counted += 1
    return total, counted


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} PB"


def check_disk(root: Path, need: int, counted: int, free: int | None = None,
               quota: Quota | str | None = None) -> str:  # fmt: skip
    """Free space under the run root (statvfs), and the user's quota there (pdmctl.doctor.quota: read here unless
    given; a string says why it was not read), against the checkpoint plan."""
    existing = next((p for p in (root, *root.parents) if p.exists()), None)
    if existing is None:
        raise CheckFailed(f"workdir {root}: no part of it exists")
    free = shutil.disk_usage(existing).free if free is None else free
    if need and free < need:
        raise CheckFailed(f"workdir {root}: {_bytes(free)} free, the checkpoint plan of {counted} run(s) keeps up to "
                          f"{_bytes(need)}")  # fmt: skip
    if quota is None:
        try:
            quota = read_quota(existing)
        except QuotaUnread as exc:
            quota = str(exc)
    if isinstance(quota, str):
        quoted = f"quota not read ({quota})"
    elif quota.limit is None:
        quoted = f"no quota set ({quota.command})"
    else:
        left = quota.left or 0
        if need and left < need:
            raise CheckFailed(f"workdir {root}: the quota leaves {_bytes(left)} ({_bytes(quota.used)} used of "
                              f"{_bytes(quota.limit)}, {quota.command}), the checkpoint plan of {counted} run(s) "
                              f"keeps up to {_bytes(need)}")  # fmt: skip
        quoted = f"quota: {_bytes(left)} left of {_bytes(quota.limit)} ({quota.command})"
    plan = f"the checkpoint plan of {counted} run(s) keeps up to {_bytes(need)}" if counted else (
        "no VeRL run given (--file, overrides): no checkpoint plan to compare")  # fmt: skip
    return f"workdir {root}: {_bytes(free)} free; {quoted}; {plan}"


def check_shm(total: int, free: int, gpus: int) -> str:
    """/dev/shm against the node's GPUs: NCCL's shared-memory transport between the GPUs of a node, vLLM's
    and the data loaders' buffers live there, and a container's default (Docker: 64 MiB) ends NCCL's
    first collective ("Error while creating shared memory segment")."""
    need = SHM_PER_GPU * max(1, gpus)
    if free < need:
        raise CheckFailed(f"/dev/shm has {_bytes(free)} free of {_bytes(total)}, under {_bytes(need)} for "
                          f"{max(1, gpus)} GPU(s): NCCL's and vLLM's shared memory; mount a larger one (a "
                          "container: --shm-size, or --ipc=host)")  # fmt: skip
    return f"{_bytes(free)} free of {_bytes(total)} (at least {_bytes(need)} for {max(1, gpus)} GPU(s))"


def check_memlock(soft: int, devices: Sequence[str]) -> str:
    """The locked-memory limit where the node has InfiniBand: NCCL registers the buffers it sends from with
    the RDMA device, which a limited `ulimit -l` refuses (NCCL then fails, or falls back to sockets)."""
    import resource

    limit = "unlimited" if soft == resource.RLIM_INFINITY else _bytes(soft)
    if not devices:
        return f"{limit} (no InfiniBand device on this node: NCCL goes over sockets and locks no memory)"
    if soft == resource.RLIM_INFINITY:
        return f"unlimited, for NCCL over InfiniBand ({', '.join(devices)})"
    raise CheckFailed(f"{limit} on a node with InfiniBand ({', '.join(devices)}): NCCL cannot register its "
                      "buffers; make it unlimited in the job (SLURM passes on the submitting shell's limit "
                      "unless slurm.conf says PropagateResourceLimitsExcept=MEMLOCK; a container: --ulimit "
                      "memlock=-1)")  # fmt: skip


# ---------------------------------------------------------------------------
# the checks, in order
# ---------------------------------------------------------------------------


@dataclass
class Doctor:
    profile: ClusterProfile
    tracking_uri: str
    specs: Sequence[Any] = ()
    python: str = sys.executable

    @property
    def opts(self):
        from pdmctl.executors.slurm import SlurmOptions

        return SlurmOptions.from_profile(self.profile) if self.profile.executor == "slurm" else None

    def placeholders(self) -> str:
        from pdmctl.executors.base import ExecutorError, check_placeholders

        try:
            check_placeholders(self.profile)
        except ExecutorError as exc:
            raise CheckFailed(str(exc)) from None
        return "no placeholder left in the profile"

    def slurm(self) -> str:
        from pdmctl.executors import make_executor
        from pdmctl.executors.base import ExecutorError

        if self.profile.executor != "slurm":
            return f"executor {self.profile.executor}: no scheduler to ask"
        try:
            make_executor(self.profile).check()
        except ExecutorError as exc:
            raise CheckFailed(str(exc)) from None
        opts = self.opts
        return (f"partition {opts.partition or '(default)'} takes {opts.nodes} node(s) x {opts.gpus_per_node} GPU(s), "
                f"max_concurrent {self.profile.max_concurrent} at once (sinfo)")  # fmt: skip

    def nodes_driver(self) -> str:
        """The nodes' NVIDIA driver against the environment's torch CUDA, from the login node
        (pdmctl.backends.verl.driver.check_login); a profile of another executor has no nodes to ask."""
        from pdmctl.backends.verl.driver import DriverError, check_login

        opts = self.opts
        if opts is None:
            return f"executor {self.profile.executor}: no nodes to ask (on a GPU machine: python -m pdmctl.backends.verl.driver)"
        try:
            return check_login(opts.partition, opts.python, opts.setup)
        except DriverError as exc:
            raise CheckFailed(str(exc)) from None

    def tracking(self) -> str:
        from pdmctl.ledger import LedgerError, check_reachable, is_database_uri

        uri = self.tracking_uri
        login_in_clear(uri, os.environ)  # before anything is sent
        try:
            check_reachable(uri)
        except LedgerError as exc:
            raise CheckFailed(str(exc)) from None
        if is_database_uri(uri):
            return f"tracking store {uri}: usable from {os.uname().nodename}"
        user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
        if not (user and password):
            import urllib.error
            import urllib.request
            from urllib.parse import urlsplit

            try:
                from pdmctl.ledger.uris import tls_context

                urllib.request.urlopen(uri.rstrip("/") + "/api/2.0/mlflow/experiments/search?max_results=1", timeout=30,
                                       context=tls_context())  # fmt: skip
            except urllib.error.HTTPError as exc:
                if exc.code == 403 and b"Invalid Host header" in exc.read(4096):
                    host = urlsplit(uri).netloc
                    raise CheckFailed(f"tracking server {uri}: refuses the host name {host} (MLflow's guard against "
                                      f"DNS rebinding): start it with --allowed-hosts {host} (pdmctl server start "
                                      "takes it too), or reach it by an address it allows") from None  # fmt: skip
                if exc.code in (401, 403):
                    raise CheckFailed(f"tracking server {uri}: asks for a login, and none reached "
                                      f"{os.uname().nodename}: set MLFLOW_TRACKING_USERNAME and "
                                      "MLFLOW_TRACKING_PASSWORD where you submit") from None  # fmt: skip
            except OSError:
                pass
            _login_needed_beyond_this_machine(uri)
            return f"tracking server {uri}: answers from {os.uname().nodename} (no login asked, none given)"
        from pdmctl.ledger.server import check_login

        try:
            check_login(uri.rstrip("/"), user, password)
        except LedgerError as exc:
            if "answered a call without a login" in str(exc):
                _login_needed_beyond_this_machine(uri)
                return f"tracking server {uri}: answers from {os.uname().nodename} (a server without a login)"
            raise CheckFailed(str(exc).removeprefix("pdmctl server: ")) from None
        return f"tracking server {uri}: answers from {os.uname().nodename}; login {user} accepted"

    def paths(self) -> str:
        opts = self.opts
        named = [(n, getattr(opts, n)) for n in ("models_dir", "data_dir") if opts and getattr(opts, n)]
        for name, value in named:
            path = Path(value)
            if not path.is_dir():
                raise CheckFailed(f"{name} {value}: not a directory on {os.uname().nodename}")
            try:
                next(iter(path.iterdir()), None)
            except OSError as exc:
                raise CheckFailed(f"{name} {value}: cannot be read on {os.uname().nodename} ({exc.strerror})") from None
        offline = False
        if self.specs:
            from pdmctl.backends.registry import flat_config, get_backend
            from pdmctl.executors import make_executor

            cluster = make_executor(self.profile).job_settings()
            offline = bool(cluster.get("offline"))
            for spec in self.specs:
                try:
                    get_backend(spec.backend).check_cluster(flat_config(spec.config), cluster)
                except ValueError as exc:
                    raise CheckFailed(f"run {spec.key} ({spec.summary}): {exc}") from None
        if not named and not self.specs:
            return "no models_dir or data_dir in the profile, no run given: nothing to look for"
        what = ", ".join(f"{n} {v}" for n, v in named) or "no shared directory named"
        runs = "" if not self.specs else (f"; the weights and data of {len(self.specs)} run(s) are there" if offline
                                          else f"; {len(self.specs)} run(s) not looked for: the profile is not offline "
                                          "(its jobs may fetch from the hub)")  # fmt: skip
        return f"visible on {os.uname().nodename}: {what}{runs}"

    def disk(self) -> str:
        need, counted = checkpoint_plan(self.specs)
        return check_disk(self.profile.run_root, need, counted)  # and the quota where lfs or mmlsquota reads it

    # --- on the node ----------------------------------------------------------------------

    def nvidia_smi(self) -> str:
        try:
            proc = subprocess.run(SMI_QUERY, capture_output=True, text=True, timeout=60, check=False)
        except FileNotFoundError:
            raise CheckFailed(f"not found on {os.uname().nodename} (no NVIDIA driver in this job's "
                              "environment)") from None  # fmt: skip
        except subprocess.TimeoutExpired:
            raise CheckFailed("no answer in 60 s (a hung GPU or driver)") from None
        if proc.returncode != 0:
            out = (proc.stdout + proc.stderr).strip().splitlines()
            raise CheckFailed(f"exit {proc.returncode}: {out[0] if out else ''}")
        self._gpus = parse_nvidia_smi(proc.stdout)
        if not self._gpus:
            raise CheckFailed("no GPU listed")
        drivers = sorted({g.driver for g in self._gpus})
        return f"{len(self._gpus)} GPU(s), driver {', '.join(drivers)}"

    def driver(self) -> str:
        cuda = subprocess.run([self.python, "-c", "import torch; print(torch.version.cuda or '')"],
                              capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
        if cuda.returncode != 0:
            raise CheckFailed(f"torch does not import: {_last_line(cuda.stderr)}")
        return check_driver(min((g.driver for g in self._gpus), key=parse_version), cuda.stdout.strip() or None)

    def gpus(self) -> str:
        opts = self.opts
        wanted = opts.gpus_per_node if opts else 0
        return check_gpus(self._gpus, wanted, opts.gpu_type if opts else None)

    def network_interface(self) -> str:
        """The profile's network_interface looked up as the job body looks it up (jobbody.interface_address):
        there, up, with an IPv4 address; else the first job fails at once, after the queue wait."""
        opts = self.opts
        name = opts.network_interface if opts else None
        if not name:
            return "none set in the profile (Ray binds the address it picks)"
        from pdmctl.backends.verl.jobbody import InterfaceError, interface_address

        try:
            return f"{name} has {interface_address(name)} on this node (Ray binds it)"
        except InterfaceError as exc:
            raise CheckFailed(str(exc)) from None

    def shm(self) -> str:
        try:
            st = os.statvfs("/dev/shm")
        except OSError as exc:
            raise CheckFailed(f"/dev/shm: {exc.strerror or exc} (NCCL and vLLM need it)") from None
        opts = self.opts
        return check_shm(st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize, opts.gpus_per_node if opts else 0)

    def memlock(self) -> str:
        import resource

        try:
            devices = sorted(p.name for p in INFINIBAND.iterdir())
        except OSError:
            devices = []
        return check_memlock(resource.getrlimit(resource.RLIMIT_MEMLOCK)[0], devices)

    def imports(self, modules: tuple[str, ...]) -> str:
        tried = []
        for module in modules:
            code = (f"import importlib, sys; m = importlib.import_module({module!r}); top = sys.modules[{module!r}.split('.')[0]]; "
                    "print(getattr(m, '__version__', None) or getattr(top, '__version__', '?'))")  # fmt: skip
            proc = subprocess.run([self.python, "-c", code], capture_output=True, text=True, timeout=600, check=False)
            if proc.returncode == 0:
                return f"{module} {proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else '?'} imports"
            tried.append(f"{module}: {_last_line(proc.stderr)}")
        raise CheckFailed("; ".join(tried))

    def checks(self, on_node: bool) -> Iterator[tuple[str, Callable[[], str]]]:
        imports = dict(IMPORTS)
        for name in NODE_CHECKS if on_node else LOGIN_CHECKS:
            if name in imports:
                yield name, lambda modules=imports[name]: self.imports(modules)
            else:
                yield name, getattr(self, name.replace("-", "_"))


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "no output"


NEEDS = {"driver": "nvidia-smi", "gpus": "nvidia-smi"}  # a node check -> the check whose answer it reads


def run_checks(doctor: Doctor, on_node: bool, skip: Sequence[str], say: Callable[[str], None]) -> bool:
    """Each check's line, in order; False at the first that fails (after its line)."""
    return run_lines(doctor.checks(on_node), skip, say, NEEDS)


def run_lines(checks: Iterable[tuple[str, Callable[[], str]]], skip: Sequence[str], say: Callable[[str], None],
              needs: Mapping[str, str]) -> bool:  # fmt: skip
    """Each check's line (`ok`, `skip`, `FAIL`), in order; False at the first that fails (after its line). A
    check left out (`skip`) leaves out those that need it (`needs`: a check -> the one it needs), and theirs."""
    left_out: set[str] = set()
    for name, check in checks:
        if name in skip or needs.get(name) in left_out:
            say(f"skip  {name}" if name in skip else f"skip  {name} (needs {needs[name]})")
            left_out.add(name)
            continue
        try:
            line = check()
        except CheckFailed as exc:
            say(f"FAIL  {name}: {exc}")
            return False
        say(f"ok    {name}: {line}")
    return True


def job_command(profile: ClusterProfile, profile_path: str, python: str, tracking_uri: str | None,
                skip: Sequence[str], sweep_args: Sequence[str], time_min: int = 15) -> list[str]:  # fmt: skip
    """`srun` of a job of the profile's nodes, one task a node, that runs each node's checks and those across
    them (pdmctl.doctor.nodes): setup lines first (set -e), the job's environment (the profile's exports, env: and
    network:), then `pdmctl doctor --on-node`. One node's failure ends the others' tasks (--kill-on-bad-exit)."""
    from pdmctl.executors.slurm import SlurmExecutor, _fatal

    ex = SlurmExecutor(profile)
    opts = ex.options
    argv = [python, "-m", "pdmctl.entry", "doctor", "--cluster", profile_path, "--on-node",
            *(["--tracking-uri", tracking_uri] if tracking_uri else []), *(f"--skip={s}" for s in skip),
            *sweep_args]  # fmt: skip
    script = "\n".join([*ex.job_exports(), *_fatal(opts.setup), *(f"export {k}={shlex.quote(v)}" for k, v in opts.env),
                        *(f"export {k}={shlex.quote(v)}" for k, v in opts.network), "exec " + shlex.join(argv)])  # fmt: skip
    cmd = ["srun", f"--nodes={opts.nodes}", f"--ntasks={opts.nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
           f"--cpus-per-task={opts.cpus_per_task}", f"--time={min(opts.time, time_min)}",
           f"--job-name={opts.job_name}-doctor"]  # fmt: skip
    for flag, value in (("partition", opts.partition), ("account", opts.account), ("qos", opts.qos),
                        ("gres", opts.gres)):  # fmt: skip
        if value:
            cmd.append(f"--{flag}={value}")
    if opts.mem_gb:
        cmd.append(f"--mem={int(opts.mem_gb * 1024)}M")
    for key, value in opts.extra_sbatch().items():
        cmd.append(f"--{key}" if value is True else f"--{key}={value}")
    return [*cmd, "bash", "-c", script]
