"""The question `pdmctl cancel` asks before it cancels anything: how many runs, of which sweeps, in which
states. `--yes` answers it; without a terminal on stdin to ask on, and without --yes, nothing is cancelled (one
line, exit 2): a script says --yes where it means it."""

from __future__ import annotations

import sys
from collections import Counter

import typer

EXIT_DECLINED = 1


def cancellable(ctx, target: str | None) -> list:
    """The runs `pdmctl cancel TARGET` would cancel: the queued, running and not yet started runs of the sweep
    (or the one run; neither: of every sweep this login may change), chosen as `orchestrate.cancel` chooses."""
    from pdmctl import orchestrate
    from pdmctl.ledger import ledger_exists, open_ledger

    if not ledger_exists(ctx.tracking_uri):  # no store yet: nothing to cancel, and a target names nothing
        if target is not None:
            raise orchestrate.RunNotFound(
                f"{target!r}: no such sweep or run (no store at {ctx.tracking_uri} yet)"
            )
        return []
    ledger = open_ledger(ctx.tracking_uri)
    views = orchestrate.status(ctx, None)
    if target is None or target in {v.sweep for v in views}:
        chosen = [v for v in views if (target is None or v.sweep == target) and ledger.writable(v.record)]
    else:  # a run of another login's sweep: refused, as cancel refuses it
        chosen = [v for v in [orchestrate.find_run(views, target)] if ledger.writable(v.record, refuse=True)]
    return [v for v in chosen if v.state in orchestrate.ACTIVE or v.state == orchestrate.RunState.UNSUBMITTED]


def nothing_line(target: str | None) -> str:
    """What `cancel` says where no run is queued, running or waiting to start (exit 0: nothing was left to stop)."""
    where = "in any sweep you may change" if target is None else f"in {target}"
    return f"nothing to cancel: no queued, running or unstarted run {where}"


def describe(runs, target: str | None) -> str:
    """`3 run(s) of sweep syn (2 running, 1 queued)`."""
    sweeps = sorted({v.sweep for v in runs})
    states = Counter(str(v.state) for v in runs)
    of = (f"run {runs[0].key} ({runs[0].summary}) of sweep {sweeps[0]}" if len(runs) == 1 and target not in sweeps
          else f"{len(runs)} run(s) of sweep{'s' if len(sweeps) > 1 else ''} {', '.join(sweeps)}")  # fmt: skip
    return f"{of} ({', '.join(f'{n} {s}' for s, n in sorted(states.items()))})"


def confirm_cancel(runs, target: str | None, yes: bool) -> None:
    """Return where cancelling `runs` may go on: none to cancel, --yes, or a yes at the prompt. Otherwise exit,
    none cancelled: 2 without a terminal to ask on, 1 on any answer but yes (or the end of input)."""
    from pdmctl.terminal import err, fail

    if yes or not runs:
        return
    what = describe(runs, target)
    if not sys.stdin or not sys.stdin.isatty():
        fail(f"cancel: would cancel {what}; stdin is not a terminal to confirm on: give --yes (-y) to cancel "
             "without asking")  # fmt: skip
    sys.stderr.write(f"cancel {what}? [y/N] ")  # stderr: stdout keeps only what was cancelled
    sys.stderr.flush()
    answer = sys.stdin.readline()  # the end of input: "", a no
    if answer.strip().lower() not in ("y", "yes"):
        err.print("nothing cancelled", highlight=False, markup=False)
        raise typer.Exit(EXIT_DECLINED)
