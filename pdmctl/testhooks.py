"""A test's hold: a job kept still mid-training, so that a requeue, a time limit or a lost node finds it
there whatever the machine's speed (the toy backend trains a step in milliseconds, the tiny VeRL model
in about a second; SLURM acts on a time limit or a dead node within 20-60 s).

`hold_if_asked(step, fresh_run, env, seconds_env)`: when the environment variable `env` names `step` and the run had
nothing logged or checkpointed when its job started (so a requeued or resumed attempt never holds), it
prints `pdmctl: held at step N …` every 10 s, with a progress report (`pdmctl-progress test_hold_s=…`: a
VeRL job's stall watchdog ends a trainer that reports no progress, and a hold is a test's, not a hang), and
lets go after `seconds_env` seconds (default 300). `fail_if_asked(step, fresh_run, env)`, under the same
rule, makes a fresh run's job fail there instead, and `lose_node_if_asked` as if it had lost a node;
`breaks` names real failures by mask method (a module the environment lacks, an allocation the machine
cannot hold, a planted checkpoint). Nothing sets these variables but the tests.

**Test-only.** A hook left in a user's shell would stall or break real runs without a word, so submitting
(`orchestrate.check_before_submit`: sweep, resume, tune) refuses any of `HOOKS` in one line unless pytest is
running the test that sets it (pytest sets `PYTEST_CURRENT_TEST` for the test in progress, and it reaches
the processes a test starts; no shell has it).
"""

from __future__ import annotations

import os
import time

DEFAULT_HOLD_S = 300.0
# every variable that is a test's hook: the holds (toy, VeRL) and the failure injections (toy, VeRL)
HOOKS = ("PDMCTL_TOY_HOLD_AT_STEP", "PDMCTL_TOY_HOLD_S", "PDMCTL_TOY_FAIL_AT_STEP", "PDMCTL_TOY_LOSE_NODE_AT_STEP",
         "PDMCTL_TOY_BREAK", "PDMCTL_VERL_HOLD_AT_STEP", "PDMCTL_VERL_HOLD_S", "PDMCTL_VERL_FAIL")  # fmt: skip
UNDER_TEST = "PYTEST_CURRENT_TEST"


class TestHookError(RuntimeError):
    """A test's hook set outside a test; the message is one line."""

    __test__ = False  # not a pytest test class, whatever its name


def check_environment() -> None:
    """Refuse (TestHookError) a test's hook in the environment of a submission that no test made."""
    if os.environ.get(UNDER_TEST):
        return
    for name in HOOKS:
        if os.environ.get(name):
            raise TestHookError(f"{name}={os.environ[name][:40]!r} is set: a test's hook, which would hold or "
                                f"break the jobs; unset it (unset {name}) and submit again")  # fmt: skip


def hold_seconds(seconds_env: str) -> float:
    """`seconds_env`'s value, else 300; anything but a number of seconds in (0, 1 day) is the default."""
    try:
        limit = float(os.environ.get(seconds_env, str(DEFAULT_HOLD_S)))
    except ValueError:
        limit = float("nan")
    return limit if 0 < limit < 86400 else DEFAULT_HOLD_S  # nan compares False


def asked(step: int, fresh_run: bool, env: str) -> bool:
    """Whether `env` names `step` of a run that started fresh (nothing logged or checkpointed)."""
    wanted = os.environ.get(env, "").strip()
    return fresh_run and wanted.isdigit() and int(wanted) == step


class InjectedFailure(RuntimeError):
    """A test's failure, raised by `fail_if_asked`."""


def fail_if_asked(step: int, fresh_run: bool, env: str) -> None:
    """Fail (InjectedFailure) at `step` of a run that started fresh, when `env` names that step: the job ends
    mid-training on its own, its run FAILED, as when a lost node fails a trainer before the scheduler has seen
    the loss; a requeued or resumed attempt takes the run on from its checkpoint and does not fail."""
    if asked(step, fresh_run, env):
        raise InjectedFailure(f"failed at step {step} ({env}, a test's)")


def breaks(env: str, method: str) -> dict[str, str]:
    """The real failures `env` asks of a fresh run of this mask method: entries `KIND[:ARG]@METHOD`, space
    separated (`oom@pdm import:transformer_engine@grpo plant@dppo`); {KIND: ARG}."""
    asked_for = {}
    for entry in os.environ.get(env, "").split():
        what, _, who = entry.partition("@")
        kind, _, arg = what.partition(":")
        if who == method:
            asked_for[kind] = arg
    return asked_for


def break_at_first_forward(kinds: dict[str, str]) -> None:
    """What a setting that cannot run meets at its first forward, for real: a module the environment lacks
    (`import:NAME`, Python's own import), an allocation the machine cannot hold (`oom`, torch's allocator)."""
    if "import" in kinds:
        import importlib

        importlib.import_module(kinds["import"] or "transformer_engine")
    if "oom" in kinds:
        import torch

        torch.empty(1 << 50, dtype=torch.uint8)  # 1 PiB: the allocator's own out-of-memory error


class Planted:
    """A pickle that runs code where it is loaded: makes the directory `marker` (os.mkdir), as a planted
    checkpoint would run anything."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def plant_checkpoint(path, marker) -> None:
    """Write over the checkpoint at `path` a pickle that would make `marker` if it ran (`plant`): the next
    attempt's resume meets a checkpoint its loader must refuse."""
    import pickle

    path.write_bytes(pickle.dumps({"state": Planted(str(marker))}))


def lose_node_if_asked(step: int, fresh_run: bool, env: str) -> None:
    """As `fail_if_asked`, with the failure of an attempt that lost a node (`backends.base.NodeLost`): the job
    asks SLURM for its next attempt itself."""
    if asked(step, fresh_run, env):
        from pdmctl.backends.base import NodeLost

        raise NodeLost(f"lost at step {step} ({env}, a test's)")


def hold_if_asked(step: int, fresh_run: bool, env: str, seconds_env: str) -> None:
    """Hold at `step` of a run that started fresh, when `env` asks for that step (module docstring)."""
    if not asked(step, fresh_run, env):
        return
    limit = hold_seconds(seconds_env)
    started = time.monotonic()
    import socket

    from pdmctl import wayout

    while (held := time.monotonic() - started) < limit:
        if wayout.requested():  # the job was signalled to save on the way out: the step goes on to its end
            print(f"pdmctl: let go at step {step} after {held:.0f} s: the job saves on the way out", flush=True)
            return
        print(f"pdmctl: held at step {step} for {held:.0f} s ({env}, a test's)", flush=True)
        print(f"pdmctl-progress test_hold_s={int(held) + 1} host={socket.gethostname()} pid={os.getpid()}", flush=True)
        time.sleep(min(1.0 if wayout.grace_seconds() else 10.0, limit - held))
    print(f"pdmctl: let go at step {step} after {limit:.0f} s", flush=True)
