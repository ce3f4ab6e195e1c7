"""The bandwidth half of `doctor --job`'s `all-reduce` check: a buffer of a size that measures bandwidth, summed
across the job a few times after a warm-up, as the trainer's gradients and weights will be.

Where the profile gives GPUs every GPU of every node takes part, one rank a GPU (ranks = nodes x gpus_per_node):
each node's doctor starts its local ranks (`python -m pdmctl.doctor.allreduce`, one process a GPU, as torchrun
would) over NCCL, with NCCL's log (NCCL_DEBUG=INFO, subsystems INIT and NET) written to files the node's doctor
reads the transport NCCL chose from (`parse_transport`). Without GPUs one rank a node sums a few MiB over
gloo, in the doctor's own process group. The line gives NCCL's bus bandwidth (busbw = size / time x 2(n-1)/n,
nccl-tests' definition, the per-link rate a ring all-reduce reaches) and the algorithm bandwidth (size / time).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

GPU_BYTES = 64 << 20  # a GPU's buffer: past NCCL's latency-bound sizes, where nccl-tests' busbw levels off
CPU_BYTES = 4 << 20  # one a node over gloo: a few MiB, so a CPU cluster's check stays quick
GPU_ITERATIONS = (5, 20)  # (warm-up, timed)
CPU_ITERATIONS = (2, 5)
NCCL_LOG_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}


def bus_bandwidth(size: int, seconds: float, ranks: int) -> float:
    """NCCL's bus bandwidth of an all-reduce (bytes/s): algorithm bandwidth x 2(n-1)/n."""
    return size / seconds * 2 * (ranks - 1) / ranks if seconds > 0 else 0.0


@dataclass(frozen=True)
class Transport:
    """What NCCL's log says it chose: `network` (its "Using network IB"), the transports of its channels
    between nodes (`between`: NET/IB, NET/IB (GDRDMA), NET/Socket, ...) and within a node (`within`:
    P2P/CUMEM, P2P/IPC, SHM, ...), and a line of its own about InfiniBand where it wrote one ("NET/IB : No
    device found.")."""

    network: str | None = None
    between: tuple[str, ...] = ()
    within: tuple[str, ...] = ()
    ib_note: str | None = None

    @property
    def socket_fallback(self) -> bool:
        return any(t.startswith("NET/Socket") for t in self.between) or (not self.between and self.network == "Socket")

    def describe(self) -> str:
        if not (self.network or self.between or self.within):
            return "transport not in NCCL's log (no network or channel line)"
        parts = []
        if self.between:
            parts.append(f"{', '.join(self.between)} between nodes")
        elif self.network:
            parts.append(f"network {self.network}")
        if self.within:
            parts.append(f"{', '.join(self.within)} within a node")
        return "transport " + ", ".join(parts) + " (NCCL's log)"


_PREFIX = re.compile(r"^.*?NCCL (?:INFO|WARN) ")


def parse_transport(log: str) -> Transport:
    """The transport NCCL chose, from its log (NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,NET): "Using network
    IB|Socket|...", each channel's "via NET/IB/0/GDRDMA", "via NET/Socket/1", "via P2P/CUMEM/read", "via
    P2P/IPC", "via SHM/direct/direct", ... (their forms since NCCL 2.4, PXN's "NET/IB/0(1)" too)."""
    network, between, within, note = None, [], [], None
    for line in log.splitlines():
        if "NCCL" not in line:
            continue
        text = _PREFIX.sub("", line.strip())
        if m := re.match(r"Using network (.+?)\s*$", text):
            network = m[1]
        elif m := re.search(r" via NET/([^/]+)/\S*", text):
            kind = f"NET/{m[1]}" + (" (GDRDMA)" if "/GDRDMA" in m[0] else "")
            if kind not in between:
                between.append(kind)
        elif m := re.search(r" via (P2P/(?:direct pointer|indirect|\w+)|SHM|NVLS|COLLNET)", text):
            if m[1] not in within:
                within.append(m[1])
        elif note is None and re.search(r"NET/IB : No device found|libibverbs|NCCL_IB_HCA .*no device", text):
            note = text.strip()[:160]
    return Transport(network, tuple(between), tuple(within), note)


def names_infiniband(settings: Mapping[str, str], interface: str | None) -> str | None:
    """What in the profile names InfiniBand (NCCL_IB_HCA set, or an interface ib*: network_interface,
    NCCL_SOCKET_IFNAME), for the line; None where nothing does or NCCL_IB_DISABLE turns it off."""
    if settings.get("NCCL_IB_DISABLE", "0").strip() not in ("", "0"):
        return None
    if settings.get("NCCL_IB_HCA"):
        return f"NCCL_IB_HCA={settings['NCCL_IB_HCA']}"
    if interface and interface.startswith("ib"):
        return f"network_interface {interface}"
    ifname = settings.get("NCCL_SOCKET_IFNAME", "")
    if ifname.lstrip("=").startswith("ib"):
        return f"NCCL_SOCKET_IFNAME={ifname}"
    return None


def check_transport(transport: Transport, infiniband: str | None) -> str | None:
    """The failure's words where NCCL went over sockets though the profile names InfiniBand; None otherwise."""
    if not (infiniband and transport.socket_fallback):
        return None
    why = f" (NCCL: {transport.ib_note})" if transport.ib_note else ""
    return (f"NCCL fell back to sockets (NET/Socket) between the nodes though the profile names InfiniBand "
            f"({infiniband}){why}: the job must see the RDMA devices (/dev/infiniband, libibverbs) and "
            "NCCL_IB_HCA name them")  # fmt: skip


@dataclass(frozen=True)
class Measured:
    """An all-reduce's outcome: the sum's lowest and highest element (each should be the rank count) and the
    slowest rank's seconds a timed iteration."""

    low: float
    high: float
    seconds: float


def measure(dist: Any, device: str, size: int, warmup: int, iterations: int, group: Any = None) -> Measured:
    """A buffer of ones summed (checked against the rank count), then zeros summed `warmup` times and timed
    over `iterations`; the time is the slowest rank's."""
    import torch

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)

    data = torch.ones(size // 4, dtype=torch.float32, device=device)
    dist.all_reduce(data, group=group)
    low, high = float(data.min()), float(data.max())
    data.zero_()
    for _ in range(max(0, warmup - 1)):
        dist.all_reduce(data, group=group)
    sync()
    started = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(data, group=group)
    sync()
    took = torch.tensor([time.perf_counter() - started], dtype=torch.float64, device=device)
    dist.all_reduce(took, op=dist.ReduceOp.MAX, group=group)
    return Measured(low, high, float(took.item()) / iterations)


# --- the local ranks: one process a GPU ----------------------------------------------------------------


def worker(config: Mapping[str, Any]) -> dict[str, Any]:
    """One rank: its GPU (`local_rank`), the job's process group at `address:port`, the measurement."""
    import torch
    import torch.distributed as dist

    device = "cpu"
    if config["backend"] == "nccl":
        torch.cuda.set_device(config["local_rank"])
        device = f"cuda:{config['local_rank']}"
    dist.init_process_group(config["backend"], init_method=f"tcp://{config['address']}:{config['port']}",
                            rank=config["rank"], world_size=config["world"],
                            timeout=datetime.timedelta(seconds=config["wait"]))  # fmt: skip
    try:
        got = measure(dist, device, config["size"], config["warmup"], config["iterations"])
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    return {"low": got.low, "high": got.high, "seconds": got.seconds}


def main(argv: Sequence[str]) -> int:
    config = json.loads(argv[0])
    try:
        out = worker(config)
    except Exception as exc:  # the backend's own words, one line, for the node's doctor to quote
        print(json.dumps({"error": " ".join(str(exc).split())[:300] or type(exc).__name__}), flush=True)
        return 1
    print(json.dumps(out), flush=True)
    return 0


@contextlib.contextmanager
def _started(commands: list[list[str]], env: Mapping[str, str], folder: str) -> Iterator[list[subprocess.Popen]]:
    """The ranks' processes, each in a session of its own with its output in `folder` (rank-I.out, .err),
    killed however the check ends."""
    procs: list[subprocess.Popen] = []
    try:
        for i, command in enumerate(commands):
            with open(os.path.join(folder, f"rank-{i}.out"), "w") as out, \
                    open(os.path.join(folder, f"rank-{i}.err"), "w") as err:  # fmt: skip
                procs.append(subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                              env=dict(env), start_new_session=True))  # fmt: skip
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)


def run_local_ranks(backend: str, node_rank: int, nodes: int, local: int, address: str, port: int,
                    wait: float, size: int = GPU_BYTES, iterations: tuple[int, int] = GPU_ITERATIONS,
                    python: str = sys.executable) -> tuple[Measured, Transport | None]:  # fmt: skip
    """This node's `local` ranks (ranks node_rank x local + i of nodes x local), each a process of its own, its
    GPU i where the backend is NCCL; their measurement (every rank's agrees: the slowest's time) and, with
    NCCL, the transport its log names. RuntimeError (the first failed rank's words) where one fails, or where
    they have not ended in `wait` (the rendezvous) and a minute more."""
    with tempfile.TemporaryDirectory(prefix="pdmctl-doctor-allreduce-") as folder:
        env = {**os.environ, **({**NCCL_LOG_ENV, "NCCL_DEBUG_FILE": os.path.join(folder, "nccl.%h.%p.log")}
                                if backend == "nccl" else {})}  # fmt: skip
        commands = []
        for i in range(local):
            config = {"backend": backend, "rank": node_rank * local + i, "world": nodes * local, "local_rank": i,
                      "address": address, "port": port, "wait": wait, "size": size, "warmup": iterations[0],
                      "iterations": iterations[1]}  # fmt: skip
            commands.append([python, "-m", "pdmctl.doctor.allreduce", json.dumps(config)])
        deadline = time.monotonic() + wait + 60
        with _started(commands, env, folder) as procs:
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                if any(p.poll() not in (None, 0) for p in procs):
                    break  # a rank failed: the others would wait for it until the timeout
                time.sleep(0.2)
            ended = [p.poll() is not None for p in procs]
        results = [_result(_read(os.path.join(folder, f"rank-{i}.out")), _read(os.path.join(folder, f"rank-{i}.err")),
                           proc.returncode) for i, proc in enumerate(procs)]  # fmt: skip
        failed = next((r["error"] for r, done in zip(results, ended, strict=True) if done and "error" in r), None)
        if failed or not all(ended):
            raise RuntimeError(failed or f"rank(s) still running after {wait + 60:.0f} s, ended")
        transport = None
        if backend == "nccl":
            logs = sorted(name for name in os.listdir(folder) if name.startswith("nccl."))
            transport = parse_transport("".join(_read(os.path.join(folder, name)) for name in logs))
    first = results[0]
    return Measured(first["low"], first["high"], first["seconds"]), transport


def _result(out: str, err: str, code: int | None) -> dict[str, Any]:
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if lines:
        with contextlib.suppress(ValueError):
            return json.loads(lines[-1])
    said = [ln.strip() for ln in err.splitlines() if ln.strip()]
    return {"error": said[-1][:300] if said else f"a rank ended with exit code {code}, saying nothing"}


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as handle:
            return handle.read()
    except OSError:
        return ""


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
