"""The trainer's progress, as the job's stall watchdog judges it.

A VeRL trainer can be silent for a long time while it works: VeRL's default
`rollout.disable_log_stats: true` keeps vLLM quiet while it generates thousands of responses of up to
16k tokens, and it can print while it is stuck (Ray's warnings about resources it waits for). So the
watchdog does not time prints; it times progress, which the job's own processes report:

* each vLLM server counts the tokens it generates, as vLLM streams them (`topk`'s patch of the server),
* each actor process counts the micro-batches its loss has seen (`actor_loss.pdm_ppo_loss`),
* VeRL's console logger prints `step:N - ...` once a step (or a validation) is done,
* the job process itself sees a checkpoint's files grow on disk while VeRL saves one (`checkpoints`).

A process that made progress prints `pdmctl-progress KIND=COUNT host=H pid=P` at most every
`PDMCTL_PROGRESS_EVERY_S` seconds (default 30), and only when its count moved; Ray passes a worker's
output to the driver, so it reaches the job's reader (`jobbody._run_trainer`) from every node. A line
counts as progress there only where its count is higher than the last one seen from that process. Before
the first progress of an attempt (start-up: Ray, the model's weights, vLLM's engine), any line counts.

The limit is the model preset's (`ModelPreset.stall_s`: the longest step phase that reports nothing,
with a margin), unless the cluster profile's `engine_stall_s` (exported as `PDMCTL_ENGINE_STALL_S`)
says otherwise. This module imports nothing of VeRL's or vLLM's: the job process reads it too.
"""

from __future__ import annotations

import math
import os
import re
import socket
import threading
import time

PREFIX = "pdmctl-progress"
EVERY_ENV = "PDMCTL_PROGRESS_EVERY_S"  # how often a worker reports progress at most (seconds)
DEFAULT_EVERY_S = 30.0
_LINE = re.compile(rf"{PREFIX} (\w+)=(\d+) host=(\S+) pid=(\d+)")
_STEP = re.compile(r"(?:^|\) )step:(\d+) - ")  # VeRL's console logger (verl/utils/logger/aggregate_logger.py)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours a worker's prefix: `\x1b[36m(TaskRunner pid=3)\x1b[0m step:1 - `


def every_s() -> float:
    given = os.environ.get(EVERY_ENV, "").strip()
    try:
        value = float(given) if given else DEFAULT_EVERY_S
    except ValueError:
        value = DEFAULT_EVERY_S
    return value if math.isfinite(value) and value >= 0 else DEFAULT_EVERY_S


class _Counter:
    """One process's count of one kind of progress, reported at most every `every_s()` seconds."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.count = 0
        self.reported = 0
        self.at = -math.inf
        self.lock = threading.Lock()

    def add(self, amount: int) -> None:
        if amount <= 0:
            return
        with self.lock:
            self.count += amount
            now = time.monotonic()
            if now - self.at < every_s():
                return
            self.at, self.reported = now, self.count
        print(f"{PREFIX} {self.kind}={self.count} host={socket.gethostname()} pid={os.getpid()}", flush=True)


_COUNTERS: dict[str, _Counter] = {}


def add(kind: str, amount: int = 1) -> None:
    """In a worker: `amount` more of `kind` done (tokens generated, micro-batches trained)."""
    counter = _COUNTERS.get(kind)
    if counter is None:
        counter = _COUNTERS.setdefault(kind, _Counter(kind))
    counter.add(amount)


class Watchdog:
    """In the job process: whether the trainer has made progress within `limit_s` seconds."""

    def __init__(self, limit_s: float, clock=time.monotonic) -> None:
        self.limit_s = limit_s
        self.clock = clock
        self.last = clock()
        self.started = False  # a progress report seen: from then on only progress counts
        self.counts: dict[tuple[str, str, str], int] = {}
        self.step = -1
        self.what = "start-up"  # the last progress seen, for the message of a stall

    def line(self, text: str) -> bool:
        """Read one line of the trainer's output; True where it shows progress."""
        progressed = False
        text = _ANSI.sub("", text)
        for kind, count, host, pid in _LINE.findall(text):
            key = (kind, host, pid)
            if int(count) > self.counts.get(key, -1):
                self.counts[key] = int(count)
                progressed, self.what = True, f"{kind}={count} on {host} (pid {pid})"
        step = _STEP.search(text)
        if step and int(step.group(1)) > self.step:
            self.step = int(step.group(1))
            progressed, self.what = True, f"step {self.step} logged"
        if progressed:
            self.started = True
            self.last = self.clock()
        elif not self.started and text.strip():
            self.last = self.clock()
        return progressed

    def poke(self, what: str) -> None:
        """Progress seen outside the trainer's output (a checkpoint's files growing on disk)."""
        self.started = True
        self.last = self.clock()
        self.what = what

    def stalled(self) -> bool:
        return self.clock() - self.last > self.limit_s

    def reason(self) -> str:
        phase = "in start-up: no progress yet, and no line either" if not self.started else f"the last: {self.what}"
        return f"the trainer made no progress for {self.limit_s:.0f} s ({phase}) and was ended as hung"
