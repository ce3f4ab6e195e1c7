"""A test's hold: a job kept still mid-training, so that a requeue, a time limit or a lost node finds it
there whatever the machine's speed (the toy backend trains a step in milliseconds, the tiny VeRL model
in about a second; SLURM acts on a time limit or a dead node within 20-60 s).

`hold_if_asked(step, fresh_run, env, seconds_env)`: when the environment variable `env` names `step` and the run had
nothing logged or checkpointed when its job started (so a requeued or resumed attempt never holds), it
prints `pdmctl: held at step N …` every 10 s (a job's stall watchdog reads silence as a hang) and lets go
after `seconds_env` seconds (default 300). Nothing sets these variables but the tests.
"""

from __future__ import annotations

import os
import time

DEFAULT_HOLD_S = 300.0


def hold_seconds(seconds_env: str) -> float:
    """`seconds_env`'s value, else 300; anything but a number of seconds in (0, 1 day) is the default."""
    try:
        limit = float(os.environ.get(seconds_env, str(DEFAULT_HOLD_S)))
    except ValueError:
        limit = float("nan")
    return limit if 0 < limit < 86400 else DEFAULT_HOLD_S  # nan compares False


def hold_if_asked(step: int, fresh_run: bool, env: str, seconds_env: str) -> None:
    """Hold at `step` of a run that started fresh, when `env` asks for that step (module docstring)."""
    wanted = os.environ.get(env, "").strip()
    if not (fresh_run and wanted.isdigit() and int(wanted) == step):
        return
    limit = hold_seconds(seconds_env)
    started = time.monotonic()
    while (held := time.monotonic() - started) < limit:
        print(f"pdmctl: held at step {step} for {held:.0f} s ({env}, a test's)", flush=True)
        time.sleep(min(10.0, limit - held))
    print(f"pdmctl: let go at step {step} after {limit:.0f} s", flush=True)
