"""pdmctl from Python (a notebook): sweep, status, wait and report, over the code the command line runs.

    from pdmctl import api

    s = api.sweep(["mask=mine,pdm_agg", "seeds=2", "backend.steps=6"], name="mine", wait=True)
    api.status(s)                    # one dict per run: key, summary, state, step, avg16, metrics, ...
    r = api.report([s])              # reports/mine/: r.files, r.out_dir, and the tables' data in r.data

Each function takes what the command of the same name takes (`cluster`, `tracking_uri`, ...) and goes
through the same modules (`pdmctl.grid`, `pdmctl.orchestrate`, `pdmctl.report`). Bad input raises `BadInput`,
a ValueError whose message is the one line the command would print, the original error as its cause;
nothing here exits the interpreter or prints. A run that ends badly is no error: its row says so.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["BadInput", "Report", "Sweep", "report", "status", "sweep", "wait"]


class BadInput(ValueError):
    """Input pdmctl refuses (a grid that does not expand, an unknown sweep, a plugin that does not load, a ledger
    it cannot read); the message is one line."""


@dataclass(frozen=True)
class Sweep:
    """A submitted sweep: its name, its runs' keys in array order, the job ids submitted now (none for runs
    already served), and where its runs are tracked."""

    name: str
    keys: tuple[str, ...]
    job_ids: tuple[str, ...]
    cluster: str = "local"
    tracking_uri: str | None = None


@dataclass(frozen=True)
class Report:
    """A written report: its directory, its files (the page last), and the report's data (tables, comparisons,
    exclusions: `pdmctl.report.build.build_report`'s result)."""

    out_dir: Path
    files: tuple[Path, ...]
    data: Any


@contextmanager
def _refusals() -> Iterator[None]:
    """pdmctl's user errors as BadInput, one line."""
    from pdmctl.executors.base import ExecutorError
    from pdmctl.grid import GridError
    from pdmctl.ledger import LedgerError
    from pdmctl.orchestrate import RunDirError, RunNotFound
    from pdmctl.plugins import PluginError
    from pdmctl.report.definition import ReportError
    from pdmctl.spec import SpecError
    from pdmctl.testhooks import TestHookError

    try:
        yield
    except (GridError, SpecError, LedgerError, ExecutorError, RunNotFound, RunDirError, TestHookError, PluginError,
            ReportError) as exc:  # fmt: skip
        text = str(exc).strip()
        raise BadInput(text.splitlines()[0] if text else type(exc).__name__) from exc


def sweep(overrides: Sequence[str] = (), *, file: str | None = None, name: str | None = None,
          cluster: str = "local", tracking_uri: str | None = None, order: str | None = None,
          max_runs: int | None = None, wait: bool = False, timeout: float | None = None,
          poll: float = 2.0) -> Sweep:  # fmt: skip
    """`pdmctl sweep OVERRIDES [--file FILE] [--name NAME] [--wait]`: expand the grid, register it in the
    ledger and submit the runs no job serves. With `wait`, return once every run has ended (`wait`)."""
    if isinstance(overrides, str):
        raise BadInput(f"overrides: a list of strings, got the string {overrides!r:.80}")
    from pdmctl import grid, orchestrate

    with _refusals():
        sweep_file = grid.load_sweep_file(file) if file else None
        chosen = grid.check_order(order, "order") if order is not None else (sweep_file and sweep_file.order) or "answers"
        ctx = orchestrate.make_context(cluster, tracking_uri)
        orchestrate.check_placeholders(ctx.profile)
        specs = grid.expand(list(overrides), sweep_file, name, max_runs=grid.MAX_RUNS if max_runs is None else max_runs)
        specs = orchestrate.pin_data(specs, ctx)
        plan, job_ids = orchestrate.sweep(specs, ctx, order=chosen, priority=sweep_file.priority if sweep_file else ())
    out = Sweep(specs[0].sweep, tuple(s.key for s in plan.specs), tuple(job_ids), cluster, ctx.tracking_uri)
    if wait:
        _wait(out, timeout, poll)
    return out


def status(sweep: Sweep | str | None = None, *, cluster: str = "local", tracking_uri: str | None = None) -> list[dict]:
    """`pdmctl status [SWEEP]`: one dict per run, sorted by sweep and summary: `sweep`, `key`, `summary`, `state`
    (finished, running, failed, ...), `reason` (why it failed or stopped, a notice; None), `step` and `avg16` (its
    latest evaluation's mean over the held-out sets, a fraction; None before one), `metrics` (each metric's
    latest value), `attempts`, `job_id`, `run_id` and `config` (the run config). A Sweep brings its own cluster
    and tracking URI. An unknown sweep name is BadInput."""
    from pdmctl import orchestrate

    name, cluster, tracking_uri = _where(sweep, cluster, tracking_uri)
    with _refusals():
        ctx = orchestrate.make_context(cluster, tracking_uri)
        views = orchestrate.status(ctx, name)
        if name is not None and not views:
            raise BadInput(f"sweep {name!r}: no runs in {_redacted(ctx.tracking_uri)}")
    return [_row(v) for v in sorted(views, key=lambda v: (v.sweep, v.summary))]


def wait(sweep: Sweep | str, *, cluster: str = "local", tracking_uri: str | None = None,
         timeout: float | None = None, poll: float = 2.0) -> list[dict]:  # fmt: skip
    """Block until every run of `sweep` has ended (finished, failed, cancelled, stopped, ...); its rows
    (`status`). TimeoutError after `timeout` seconds, the runs going on."""
    name, cluster, tracking_uri = _where(sweep, cluster, tracking_uri)
    return _wait(Sweep(str(name), (), (), cluster, tracking_uri), timeout, poll)


def report(sweeps: Sequence[Sweep | str] = (), *, out: str | Path | None = None, definition: str = "default",
           baseline: str | None = None, at: str | None = None, interval: str | None = None,
           panels: str | None = None, two_level: bool = False, cluster: str | None = None,
           tracking_uri: str | None = None) -> Report:  # fmt: skip
    """`pdmctl report SWEEP...`: build the report (tables with seed intervals, comparisons with the baseline,
    figures) and write it to `out` (default reports/<sweep>+<sweep>/). Sweeps given as Sweep bring their cluster
    and tracking URI (the first one's), unless named here. No sweep: the ledger's only one."""
    from pdmctl.extras import refusal

    if (line := refusal("api.report", "report")) is not None:
        raise BadInput(line)
    from pdmctl.budget.spent import sweep_costs
    from pdmctl.ledger import ledger_exists, open_ledger
    from pdmctl.orchestrate import make_context
    from pdmctl.report.build import build_report
    from pdmctl.report.definition import load_definition
    from pdmctl.report.write import write_report

    if isinstance(sweeps, str | Sweep):
        sweeps = [sweeps]
    first = next((s for s in sweeps if isinstance(s, Sweep)), None)
    cluster = cluster or (first.cluster if first else "local")
    tracking_uri = tracking_uri or (first.tracking_uri if first else None)
    names = [s.name if isinstance(s, Sweep) else str(s) for s in sweeps]
    with _refusals():
        spec = load_definition(definition).with_options(at=at, baseline=baseline, interval=interval, panels=panels)
        ctx = make_context(cluster, tracking_uri)
        if not ledger_exists(ctx.tracking_uri):
            raise BadInput(f"no ledger at {_redacted(ctx.tracking_uri)}: run a sweep first")
        ledger = open_ledger(ctx.tracking_uri)
        chosen = _choose(names, ledger.sweeps(), _redacted(ctx.tracking_uri))
        result = build_report(ledger, chosen, spec, two_level=two_level)
        records = [r for name in result.sweeps for r in ledger.runs(name)]
        result = dataclasses.replace(result, cost=sweep_costs(records, ctx, time.time()))  # hours spent, per setting
        if baseline is not None and not result.baseline_present:
            raise BadInput(f"baseline: mask {baseline!r} has no runs in {', '.join(chosen)}")
        out_dir = Path(out) if out is not None else Path("reports") / "+".join(chosen)
        files = write_report(result, out_dir)
    return Report(out_dir, tuple(files), result)


# ---------------------------------------------------------------------------


def _where(sweep: Sweep | str | None, cluster: str, tracking_uri: str | None) -> tuple[str | None, str, str | None]:
    if isinstance(sweep, Sweep):
        return sweep.name, sweep.cluster, tracking_uri or sweep.tracking_uri
    if sweep is not None and not isinstance(sweep, str):
        raise BadInput(f"sweep: a Sweep or a sweep's name, got {type(sweep).__name__}")
    return sweep, cluster, tracking_uri


def _wait(sweep: Sweep, timeout: float | None, poll: float) -> list[dict]:
    from pdmctl import orchestrate

    if not poll > 0:
        raise BadInput(f"poll: must be a number of seconds > 0, got {poll!r}")
    deadline = None if timeout is None else time.monotonic() + timeout
    with _refusals():
        ctx = orchestrate.make_context(sweep.cluster, sweep.tracking_uri)
    while True:
        with _refusals():
            views = orchestrate.status(ctx, sweep.name)
        if not any(v.state in orchestrate.ACTIVE for v in views):
            return [_row(v) for v in sorted(views, key=lambda v: (v.sweep, v.summary))]
        if deadline is not None and time.monotonic() > deadline:
            running = sum(v.state in orchestrate.ACTIVE for v in views)
            raise TimeoutError(f"sweep {sweep.name!r}: {running} run(s) still queued or running after {timeout:g} s")
        time.sleep(poll)


def _row(view: Any) -> dict[str, Any]:
    r = view.record
    reason = None
    if r is not None:
        reason = (r.reason if str(view.state) != "finished" else None) or r.notice
    return {"sweep": view.sweep, "key": view.key, "summary": view.summary, "state": str(view.state),
            "reason": reason, "step": r.step if r else None, "avg16": r.avg16 if r else None,
            "metrics": {name: value for name, (_, value) in r.latest.items()} if r else {},
            "attempts": r.attempt if r else 0, "job_id": r.job_id if r else None, "run_id": r.run_id if r else None,
            "config": (r.spec.config if r.spec is not None else None) if r else None}  # fmt: skip


def _choose(asked: list[str], known: list[str], uri: str) -> list[str]:
    if not known:
        raise BadInput(f"no sweeps in {uri}")
    if not asked:
        if len(known) > 1:
            raise BadInput(f"{len(known)} sweeps in {uri}: name one or more ({', '.join(known)})")
        return list(known)
    unknown = [s for s in asked if s not in known]
    if unknown:
        raise BadInput(f"sweep {unknown[0]!r}: no runs in {uri} (known: {', '.join(known)})")
    return list(dict.fromkeys(asked))


def _redacted(uri: str) -> str:
    from pdmctl.ledger import _redact

    return _redact(uri)
