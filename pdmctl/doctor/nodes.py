"""`pdmctl doctor --job`'s checks across the nodes of one allocation of the profile's size: run in each of its
tasks (one a node, `srun`), once that node's own checks have passed.

- shared-files: task 0 writes a file into the run root; each other node reads it, finds the same models and
  data directories (every file's name and size) and the same environment (the job's Python, pdmctl's and
  torch's versions), and writes back that it did; task 0 waits for every node's answer.
- all-reduce: torch.distributed across every node, its rendezvous at task 0's address on the profile's `network:`
  interface (NCCL_SOCKET_IFNAME, else GLOO_SOCKET_IFNAME, else network_interface), as the trainer's collectives
  will run: the nodes' own gloo group first (one rank a node: the checks' messages), then the bandwidth
  (pdmctl.doctor.allreduce): NCCL over every GPU where the profile gives GPUs, one rank a GPU in processes this
  task starts, with the transport NCCL's log names; gloo in that group, one rank a node, where it gives none.
- ray: Ray started on the profile's network_interface as the job body starts it, task 0 the head, and every
  node joined within the wait; each node's Ray ended afterwards.

Each waits at most PDMCTL_DOCTOR_WAIT_S (300 s) for the others; one line per check and node, and the first that
fails ends that node's checks (srun then ends the others). A job of one node runs the all-reduce alone, across
its own GPUs (`one_node_all_reduce`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdmctl.doctor import CheckFailed, Doctor, _bytes, allreduce, run_lines

CLUSTER_CHECKS = ("shared-files", "all-reduce", "ray")
WAIT_ENV = "PDMCTL_DOCTOR_WAIT_S"
LISTING_LIMIT = 100_000  # files listed in a models or data directory (a model's shards, a data set's files)


@dataclass
class Task:
    """This task of the doctor's job step: its rank among `size` (one a node), its node, the step's id."""

    rank: int
    size: int
    node: str
    step: str

    @classmethod
    def from_env(cls) -> Task | None:
        """The task as srun describes it; None outside a step of several tasks."""
        size = int(os.environ.get("SLURM_NTASKS") or 1)
        if size < 2:
            return None
        step = f"{os.environ.get('SLURM_JOB_ID', '0')}.{os.environ.get('SLURM_STEP_ID', '0')}"
        node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        return cls(int(os.environ.get("SLURM_PROCID") or 0), size, node, step)


def wait_s() -> float:
    return float(os.environ.get(WAIT_ENV) or 300)


def listing(root: str | None) -> tuple[int, str]:
    """(files, digest of every file's relative path and size) under `root`; (0, '') where none is named."""
    if not root:
        return 0, ""
    digest, count = hashlib.sha256(), 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            try:
                size = os.stat(path).st_size
            except OSError:
                size = -1
            digest.update(f"{os.path.relpath(path, root)}\0{size}\n".encode())
            count += 1
            if count >= LISTING_LIMIT:
                return count, digest.hexdigest()
    return count, digest.hexdigest()


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0], "executable": sys.executable}
    for package in ("pdmctl", "torch", "ray", "verl", "vllm"):
        with contextlib.suppress(PackageNotFoundError):
            out[package] = version(package)
    return out


def _outward_address() -> str:
    """The address this node reaches others from (its default route's), without sending anything."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("10.255.255.255", 1))
            return sock.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def _free_port(address: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


def _address_on(interface: str | None) -> str:
    if not interface:
        return _outward_address()
    from pdmctl.backends.verl.jobbody import InterfaceError, interface_address

    try:
        return interface_address(interface)
    except InterfaceError as exc:
        raise CheckFailed(str(exc)) from None


def _wait_for(found: Callable[[], Any], seconds: float) -> Any:
    deadline = time.monotonic() + seconds
    while not (value := found()):
        if time.monotonic() > deadline:
            return value
        time.sleep(0.5)
    return value


@dataclass
class NodesDoctor:
    doctor: Doctor
    task: Task
    _first: dict[str, Any] = field(default_factory=dict)  # what task 0 wrote (its address, port, listings)
    _group: bool = False
    _gloo: Any = None  # the gloo group of the checks' own messages (all_reduce makes it)

    @property
    def network(self) -> dict[str, str]:
        opts = self.doctor.opts
        return dict(opts.network) if opts else {}

    def rendezvous_interface(self) -> str | None:
        """Where the trainer's collectives go: the profile's NCCL or gloo interface, else network_interface."""
        net, opts = self.network, self.doctor.opts
        name = net.get("NCCL_SOCKET_IFNAME") or net.get("GLOO_SOCKET_IFNAME") or (opts.network_interface if opts else None)
        return name.split(",")[0].lstrip("=^") if name else None

    # --- shared-files -----------------------------------------------------------------------

    def shared_files(self) -> str:
        opts, t = self.doctor.opts, self.task
        folder = self.doctor.profile.run_root / ".doctor" / t.step
        first, wait = folder / "first.json", wait_s()
        dirs = {name: getattr(opts, name) for name in ("models_dir", "data_dir") if opts and getattr(opts, name)}
        mine = {"node": t.node, "versions": _versions(), "listings": {n: listing(d) for n, d in dirs.items()}}
        if t.rank == 0:
            address = _address_on(self.rendezvous_interface())
            mine.update(address=address, port=_free_port(address), ranks_port=_free_port(address))
            try:
                folder.mkdir(parents=True, exist_ok=True)
                (folder / "first.tmp").write_text(json.dumps(mine))
                os.replace(folder / "first.tmp", first)
            except OSError as exc:
                raise CheckFailed(f"run root {self.doctor.profile.run_root}: cannot be written on {t.node} "
                                  f"({exc.strerror or exc})") from None  # fmt: skip
            self._first = mine
            answers = _wait_for(lambda: len(list(folder.glob("read-*.json"))) >= t.size - 1 or None, wait)
            read = sorted(p.stem.removeprefix("read-") for p in folder.glob("read-*.json"))
            with contextlib.suppress(OSError):
                for path in folder.iterdir():
                    path.unlink()
                folder.rmdir()
            if not answers:
                raise CheckFailed(f"run root {self.doctor.profile.run_root}: a file written on {t.node} was read on "
                                  f"{len(read)} of the {t.size - 1} other node(s) in {wait:.0f} s ({', '.join(read) or 'none'}): "
                                  "put the profile's workdir on storage every node mounts")  # fmt: skip
            return (f"run root {self.doctor.profile.run_root}: written on {t.node}, read on {t.size - 1} other node(s)"
                    + "".join(f"; {n} {dirs[n]}: {c} file(s)" for n, (c, _) in mine["listings"].items()))  # fmt: skip
        if not _wait_for(first.exists, wait):
            raise CheckFailed(f"run root {self.doctor.profile.run_root}: the file the first node writes there is not "
                              f"seen on {t.node} after {wait:.0f} s: put the profile's workdir on storage every "
                              "node mounts")  # fmt: skip
        self._first = json.loads(first.read_text())
        there = self._first["node"]
        for name, (count, digest) in mine["listings"].items():
            theirs = self._first["listings"].get(name)
            if theirs is not None and theirs[1] != digest:
                raise CheckFailed(f"{name} {dirs[name]}: {count} file(s) on {t.node}, {theirs[0]} on {there}, or of "
                                  "other sizes: every node must see the same copy (shared storage, or the same "
                                  "staged files)")  # fmt: skip
        differ = [f"{k} {v} here, {self._first['versions'].get(k)} on {there}" for k, v in mine["versions"].items()
                  if self._first["versions"].get(k) != v]  # fmt: skip
        if differ:
            raise CheckFailed(f"the job's environment differs between nodes: {'; '.join(differ)}")
        (folder / f"read-{t.node}.json").write_text(json.dumps({"node": t.node}))
        return (f"run root {self.doctor.profile.run_root}: {there}'s file read on {t.node}; the same "
                + ", ".join([*(n for n in mine["listings"]), "environment"]) + f" as {there}")

    # --- all-reduce -------------------------------------------------------------------------

    def all_reduce(self) -> str:
        import datetime

        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # a failed rendezvous's retries: one line, not stacks
        import torch
        import torch.distributed as dist

        opts, t = self.doctor.opts, self.task
        local = opts.gpus_per_node if opts else 0
        gpus = bool(local) and torch.cuda.is_available()
        address, port = self._first["address"], self._first["port"]
        over = self.rendezvous_interface() or "the default route's interface"
        hint = ("check the profile's network: (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME) and that the nodes reach each "
                "other there")  # fmt: skip
        try:  # the nodes' own group (one rank a node, gloo): the one-node-CPU measurement, and the checks' messages
            dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=t.rank, world_size=t.size,
                                    timeout=datetime.timedelta(seconds=wait_s()))  # fmt: skip
            self._group = True
            if not gpus:
                got = allreduce.measure(dist, "cpu", allreduce.CPU_BYTES, *allreduce.CPU_ITERATIONS)
            # the checks' own small messages, bounded by the waits between them
            self._gloo = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=3 * wait_s() + 120))
        except Exception as exc:  # whatever the backend raises: its own words, in one line
            words = " ".join(str(exc).split())[:300].rstrip(".")
            raise CheckFailed(f"gloo across {t.size} node(s) (rendezvous {address}:{port}, over {over}): {words}: "
                              f"{hint}") from None  # fmt: skip
        if not gpus:
            how = "one a node; gloo over TCP" + (", torch sees no GPU" if local else "")
            return f"gloo across {t.size} node(s) over {over}: {_measured(got, t.size, allreduce.CPU_BYTES, how)}"
        if torch.cuda.device_count() < local:
            raise CheckFailed(f"torch sees {torch.cuda.device_count()} GPU(s) on {t.node}, the profile gives "
                              f"{local} (gpus_per_node)")  # fmt: skip
        head, ranks_port = f"nccl across {t.size} node(s) x {local} GPU(s) over {over}", self._first["ranks_port"]
        try:
            got, transport = allreduce.run_local_ranks("nccl", t.rank, t.size, local, address, ranks_port, wait_s())
        except RuntimeError as exc:
            words = " ".join(str(exc).split())[:300].rstrip(".")
            raise CheckFailed(f"nccl across {t.size} node(s) x {local} GPU(s) (rendezvous {address}:{ranks_port}, "
                              f"over {over}): {words}: {hint}") from None  # fmt: skip
        assert transport is not None
        measured = _measured(got, t.size * local, allreduce.GPU_BYTES, f"{local} a node; {transport.describe()}")
        assert opts is not None  # GPUs come from the profile
        infiniband = allreduce.names_infiniband({**dict(opts.env), **dict(opts.network)}, opts.network_interface)
        fallback = allreduce.check_transport(transport, infiniband)
        if fallback:
            raise CheckFailed(f"{head}: {fallback}; {measured.partition('; ')[2]}")
        return f"{head}: {measured}"

    # --- ray --------------------------------------------------------------------------------

    def ray(self) -> str:
        try:
            return self._ray()
        except CheckFailed:
            raise
        except Exception as exc:  # a collective between the nodes failed: another node's Ray check ended
            words = " ".join(str(exc).split())[:200]
            raise CheckFailed(f"lost the other nodes while starting Ray ({words}): see their lines") from None

    def _ray(self) -> str:
        import torch.distributed as dist

        opts, t = self.doctor.opts, self.task
        interface = opts.network_interface if opts else None
        ray_bin = Path(self.doctor.python).parent / "ray"
        if not ray_bin.exists():
            raise CheckFailed(f"no `ray` beside {self.doctor.python} on {t.node}: the VeRL runs start Ray with it "
                              "(install the engine environment, scripts/engine-env.sh)")  # fmt: skip
        mine = _address_on(interface)
        group = self._gloo
        # the job body's ports (a block of 10 from the job id) and a token of this job's own (Ray >= 2.52)
        job = int(os.environ.get("SLURM_JOB_ID") or 0)
        base = 20000 + (job % 1276) * 10
        head = [(f"{mine}:{base}", secrets.token_hex(32)) if t.rank == 0 else None]
        dist.broadcast_object_list(head, src=0, group=group)
        (address, token), port = head[0], base
        host = address.partition(":")[0]
        from pdmctl.backends.verl import cpu

        tag = cpu.new_tag()  # what Ray's teardown leaves (its idle workers) carries it: ended by it afterwards
        env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, cpu.ENGINE_TAG_ENV: tag}
        ports = [f"--node-manager-port={base + 1}", f"--object-manager-port={base + 2}",
                 f"--ray-client-server-port={base + 3}", f"--dashboard-agent-listen-port={base + 4}",
                 f"--dashboard-agent-grpc-port={base + 5}", f"--metrics-export-port={base + 6}",
                 f"--runtime-env-agent-port={base + 7}"]  # fmt: skip
        common = [str(ray_bin), "start", "--block", f"--node-ip-address={mine}", *ports, "--num-cpus=1",
                  "--num-gpus=0", "--disable-usage-stats"]  # fmt: skip
        wait, started = wait_s(), time.monotonic()
        with contextlib.ExitStack() as stack:
            stack.callback(shutil.rmtree, f"/tmp/ray-doctor-{job}", ignore_errors=True)  # its Ray files, once Ray ended
            stack.callback(cpu.cleanup, tag, time.time(), 5.0)  # after `ray start` has ended: what it left
            ready: list[Any] = [None]
            if t.rank == 0:  # the head first, then the workers join it (as the job body starts them)
                proc = stack.enter_context(self._process([*common, "--head", f"--port={port}", "--include-dashboard=false",
                                                          f"--temp-dir=/tmp/ray-doctor-{job}"], env))  # fmt: skip
                up = _wait_for(lambda: proc.poll() is not None or _answers(host, port) or None, wait)
                ready = [bool(up) and proc.poll() is None]
            dist.broadcast_object_list(ready, src=0, group=group)
            if not ready[0]:
                raise CheckFailed(f"the Ray head on {t.node if t.rank == 0 else host} did not start within {wait:.0f} s")
            if t.rank != 0:
                proc = stack.enter_context(self._process([*common, f"--address={address}"], env))
            joined: list[Any] = [_joined(address, t.size, wait, env) if t.rank == 0 else None]
            dist.broadcast_object_list(joined, src=0, group=group)
            gathered: list[Any] = [None] * t.size
            dist.all_gather_object(gathered, (t.node, proc.poll() is None), group=group)
        count, error = joined[0]
        where = f"network interface {interface}" if interface else "the address Ray picks"
        if count != t.size:
            gone = ", ".join(node for node, ok in gathered if not ok)
            ended = f"; Ray ended on {gone}" if gone else ""
            raise CheckFailed(f"{count} of {t.size} node(s) joined the Ray head at {address} on {where} within "
                              f"{wait:.0f} s{f' ({error})' if error else ''}{ended}: the nodes must reach each other "
                              "there (the profile's network_interface)")  # fmt: skip
        return (f"{t.size} node(s) joined the head at {address} on {where} in {time.monotonic() - started:.0f} s; "
                f"{t.node} bound {mine}")

    @contextlib.contextmanager
    def _process(self, command: list[str], env: dict[str, str]) -> Iterator[subprocess.Popen]:
        """`ray start --block` in a process group of its own, ended (TERM, then KILL) however the check ends."""
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True, env=env)  # fmt: skip
        try:
            yield proc
        finally:
            for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 5)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(grace)
                    break

    def close(self) -> None:
        if self._group:
            import torch.distributed as dist

            with contextlib.suppress(Exception):
                dist.destroy_process_group()

    def checks(self) -> Iterator[tuple[str, Callable[[], str]]]:
        yield "shared-files", self.shared_files
        yield "all-reduce", self.all_reduce
        yield "ray", self.ray


def _measured(got: allreduce.Measured, ranks: int, size: int, how: str) -> str:
    """The all-reduce's sum (CheckFailed unless every element is the rank count) and bandwidth, for its line."""
    if not got.low == got.high == ranks:
        raise CheckFailed(f"the sum over {ranks} rank(s) came back as {got.low:g} to {got.high:g}")
    return (f"the sum came back {ranks}; {size >> 20} MiB in {got.seconds * 1000:.1f} ms: bus bandwidth "
            f"{_bytes(allreduce.bus_bandwidth(size, got.seconds, ranks))}/s, algorithm bandwidth "
            f"{_bytes(size / got.seconds if got.seconds else 0)}/s ({ranks} rank(s), {how})")


ONE_NODE_CPU_RANKS = 2  # a one-node job without GPUs: processes summing over gloo on the node's loopback


def one_node_all_reduce(doctor: Doctor, node: str) -> str:
    """The all-reduce of a one-node job: every GPU the profile gives the node, one rank a GPU, each a process
    over NCCL (its rendezvous on the loopback), with the transport NCCL's log names within the node; without
    GPUs, ONE_NODE_CPU_RANKS processes over gloo. Its line: the sum, the bus and algorithm bandwidth."""
    import torch

    opts = doctor.opts
    local = opts.gpus_per_node if opts else 0
    gpus = bool(local) and torch.cuda.is_available()
    if gpus and torch.cuda.device_count() < local:
        raise CheckFailed(f"torch sees {torch.cuda.device_count()} GPU(s) on {node}, the profile gives {local} "
                          "(gpus_per_node)")  # fmt: skip
    backend, ranks = ("nccl", local) if gpus else ("gloo", ONE_NODE_CPU_RANKS)
    size, iterations = (allreduce.GPU_BYTES, allreduce.GPU_ITERATIONS) if gpus else (
        allreduce.CPU_BYTES, allreduce.CPU_ITERATIONS)  # fmt: skip
    head = f"{backend} on {node}, {ranks} {'GPU(s)' if gpus else 'process(es)'}"
    try:
        got, transport = allreduce.run_local_ranks(backend, 0, 1, ranks, "127.0.0.1", _free_port("127.0.0.1"),
                                                   wait_s(), size, iterations)  # fmt: skip
    except RuntimeError as exc:
        raise CheckFailed(f"{head}: {' '.join(str(exc).split())[:300].rstrip('.')}") from None
    how = (f"one a GPU; {transport.describe()}" if transport is not None else
           "gloo over TCP on the loopback" + (", torch sees no GPU" if local else ""))  # fmt: skip
    return f"{head}: {_measured(got, ranks, size, how)}"


def _answers(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(2)
        return sock.connect_ex((host, port)) == 0


def _joined(address: str, size: int, wait: float, env: dict[str, str]) -> tuple[int, str]:
    """(alive nodes in the Ray cluster at `address` once all `size` have joined or `wait` has passed, error)."""
    code = ("import json, sys, time, ray\n"
            "ray.init(address=sys.argv[1], logging_level='ERROR', log_to_driver=False)\n"
            "deadline = time.monotonic() + float(sys.argv[3])\n"
            "while True:\n"
            "    alive = sum(1 for n in ray.nodes() if n.get('Alive'))\n"
            "    if alive >= int(sys.argv[2]) or time.monotonic() > deadline: break\n"
            "    time.sleep(1)\n"
            "print(json.dumps(alive))\n")  # fmt: skip
    try:
        proc = subprocess.run([sys.executable, "-c", code, address, str(size), str(wait)], capture_output=True,
                              text=True, timeout=wait + 120, check=False, env=env)  # fmt: skip
    except subprocess.TimeoutExpired:
        return 0, f"no answer from the head in {wait + 120:.0f} s"
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        return 0, lines[-1][:200] if lines else f"exit {proc.returncode}"
    return int(proc.stdout.strip().splitlines()[-1]), ""


def run_checks(doctor: Doctor, task: Task, skip: list[str], say: Callable[[str], None]) -> bool:
    """Each check's line, in order, for this node; False at the first that fails (after its line). A check
    left out leaves out those after it that need it (the rendezvous address, the process group)."""
    nodes = NodesDoctor(doctor, task)
    # srun ends the other nodes' tasks (TERM) when one fails: unwind, so that each node's Ray is ended
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        return run_lines(nodes.checks(), skip, say, {"all-reduce": "shared-files", "ray": "all-reduce"})
    finally:
        nodes.close()
