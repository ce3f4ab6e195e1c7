"""Waiting on a sweep's runs (`sweep --wait`, `resume --wait`, `preflight --wait`): a progress bar until every
run has ended, through a tracking server's outage; a Ctrl-C stops the waiting, never the runs, and says how to
follow them (exit 130)."""

from __future__ import annotations

import shlex
import sys
import time
from collections import Counter

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pdmctl.terminal import console

EXIT_INTERRUPTED = 130  # the shell's code for SIGINT (128 + 2)


def wait(ctx, sweep_name: str | None, poll: float = 2.0, cluster: str | None = None) -> None:
    """Block until every run of `sweep_name` (None: of every sweep) has ended; exit 1 where one did not finish.
    `cluster`: the --cluster the command was given, for the command a Ctrl-C suggests."""
    try:
        views = _progress(ctx, sweep_name, poll)
    except KeyboardInterrupt:
        print(interrupted_line(ctx, sweep_name, cluster), file=sys.stderr, flush=True)
        sys.exit(EXIT_INTERRUPTED)
    from pdmctl import orchestrate

    # stopped: by its declared collapse rule
    final = (orchestrate.RunState.FINISHED, orchestrate.RunState.STOPPED)
    bad = [v for v in views if v.state not in final]
    if bad:
        console.print(
            f"{len(bad)} run(s) did not finish: see [bold]pdmctl status[/], then [bold]pdmctl resume[/]"
        )
        raise typer.Exit(1)


def interrupted_line(ctx, sweep_name: str | None, cluster: str | None) -> str:
    """What a Ctrl-C while waiting says: the runs go on, and the commands that follow them."""
    where = follow_options(ctx, cluster)
    sweep = f" {shlex.quote(sweep_name)}" if sweep_name else ""
    return (f"pdmctl: stopped waiting; the runs go on. Follow them: pdmctl status{sweep}{where} --watch; a run's "
            f"output: pdmctl logs KEY{where} --follow; stop them: pdmctl cancel{sweep}{where}")  # fmt: skip


def follow_options(ctx, cluster: str | None) -> str:
    """The --cluster and --tracking-uri another command needs to find the same runs ('' where the defaults do)."""
    from pdmctl.ledger import _redact, resolve_tracking_uri

    out = ""
    if cluster and cluster != "local":
        out += f" --cluster {shlex.quote(cluster)}"
    try:
        default = resolve_tracking_uri(None, ctx.profile.tracking_uri)
    except Exception:  # the defaults name no usable store: the URI in use must be given
        default = None
    if ctx.tracking_uri != default:
        out += f" --tracking-uri {shlex.quote(_redact(ctx.tracking_uri))}"
    return out


def _progress(ctx, sweep_name: str | None, poll: float) -> list:
    """The progress bar until every run has ended; the runs' last views."""
    from pdmctl import orchestrate
    from pdmctl.ledger import sqlite_path

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:  # fmt: skip
        task = progress.add_task("runs", total=None)
        away_since: float | None = None
        # reads that failed in a row while the server answered /health: a dropped connection, a hiccup
        failed = 0
        while True:
            try:
                views = orchestrate.status(ctx, sweep_name)
            except Exception:
                # the tracking server went away a while (the jobs keep what it does not confirm and train on):
                # wait for it, as the jobs do; a read that fails where the server answers is tried again a few
                # times, then raised
                why = orchestrate.ledger_unreachable(ctx)
                failed = 0 if why is not None else failed + 1
                if why is None and (failed > 3 or sqlite_path(ctx.tracking_uri) is not None):
                    raise
                if why is None:
                    time.sleep(poll)
                    continue
                if away_since is None:
                    away_since = time.monotonic()
                    progress.console.print(f"{why}; waiting for it (Ctrl-C stops waiting, the runs go on)",
                                           highlight=False, markup=False, soft_wrap=True)  # fmt: skip
                progress.update(task, description=f"tracking server not answering for "
                                f"{time.monotonic() - away_since:.0f} s")  # fmt: skip
                time.sleep(max(poll, 5.0))
                continue
            failed = 0
            if away_since is not None:
                progress.console.print(f"the tracking server answers again after {time.monotonic() - away_since:.0f} s",
                                       highlight=False, markup=False)  # fmt: skip
                away_since = None
            counts = Counter(v.state for v in views)
            done = sum(n for s, n in counts.items() if s not in orchestrate.ACTIVE)
            desc = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
            progress.update(task, total=len(views), completed=done, description=desc)
            if views and done == len(views):
                return views
            time.sleep(poll)
