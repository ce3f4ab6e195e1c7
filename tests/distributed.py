"""Run a function in a real `torch.distributed` group of local processes (gloo, CPU).

Each rank runs `fn(rank, world_size, *args)` in a fresh spawned process; what it
returns comes back (through `torch.save`), and a rank's exception fails the caller
with that rank's traceback. No mock: the collectives are gloo's own.
"""

from __future__ import annotations

import socket
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, out: str, args: tuple) -> None:
    import torch.distributed as dist

    path = Path(out)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        torch.save(fn(rank, world, *args), path / f"{rank}.pt")
    except BaseException:
        (path / f"{rank}.err").write_text(traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_group(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300) -> list[Any]:
    """`[fn(0, n, *args), …, fn(n-1, n, *args)]`, each computed by its own rank of an n-process group."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="pdmctl-dist-") as out:
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world_size, port, out, args)) for r in range(world_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
        errors = sorted(Path(out).glob("*.err"))
        if errors:
            raise AssertionError("\n".join(f"rank {e.stem}:\n{e.read_text()}" for e in errors))
        codes = [p.exitcode for p in procs]
        if any(code != 0 for code in codes):
            raise AssertionError(f"ranks exited with {codes} (timeout {timeout:.0f} s?)")
        return [torch.load(Path(out) / f"{r}.pt", weights_only=False) for r in range(world_size)]
