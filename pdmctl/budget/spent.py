"""The hours a sweep's runs spent beside what pdmctl.budget.cost predicted for them, per setting and for the sweep, and
the time a sweep that still runs is expected to take to finish (`pdmctl status`, `pdmctl report`).

Where the hours come from:
* SLURM with accounting: one `sacct -n -P -X -D -j JOBS -o JobID,Elapsed,AllocTRES` call for all of a sweep's
  jobs; every record of a job counts (-D: a requeued job has one per start), each its Elapsed x the GPUs of its
  AllocTRES (gres/gpu) for a GPU run, x its CPUs (cpu=) for a CPU run (the testbed).
* Else (no sacct, sacct failed, or it has no record of the run's jobs): the ledger's attempt records, each
  attempt from its start to the next attempt's or the run's end (`pdmctl.budget.cost.spent_seconds`), x the devices
  the estimate says the run holds.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdmctl.budget.cost import (
    RESTS_ON,
    Estimate,
    Span,
    Total,
    duration,
    number,
    spent_seconds,
    total,
    total_text,
    wall_seconds,
)

SACCT_TIMEOUT_S = 30
FROM_SACCT, FROM_LEDGER = "from sacct", "from the ledger's attempt times"
_JOB_ID = re.compile(r"\d+(?:_\d+)?")


# ---------------------------------------------------------------------------
# sacct: its output read, never trusted
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Usage:
    """One sacct record of a job (a requeued job has one per start): its wall seconds and what it held."""

    seconds: float
    gpus: int
    cpus: int


def parse_elapsed(text: str) -> float | None:
    """sacct's time fields, `[DD-[HH:]]MM:SS` with an optional `.fraction`: `1-02:03:04`, `00:05:06`, `05:06`,
    `05:06.123` -> seconds; None for anything else (`UNLIMITED`, `INVALID`, garbage)."""
    match = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+(?:\.\d+)?)", text.strip())
    if match is None:
        return None
    days, hours, minutes, seconds = match.groups()
    if float(seconds) >= 60 or (hours is not None and int(minutes) >= 60):
        return None
    return int(days or 0) * 86400 + int(hours or 0) * 3600 + int(minutes) * 60 + float(seconds)


def parse_tres(text: str) -> tuple[int, int]:
    """AllocTRES (`billing=8,cpu=8,gres/gpu=4,mem=64G,node=1`) -> (GPUs, CPUs); a missing field is 0. Typed GPUs
    (`gres/gpu:h100=4`) count where the untyped total is not given."""
    fields: dict[str, str] = dict(f.partition("=")[::2] for f in text.strip().split(",") if "=" in f)

    def count(value: str | None) -> int:
        return int(value) if value is not None and value.isdigit() else 0

    gpus = count(fields.get("gres/gpu"))
    if not gpus:
        gpus = sum(count(v) for k, v in fields.items() if k.startswith("gres/gpu:"))
    return gpus, count(fields.get("cpu"))


def parse_sacct(text: str) -> dict[str, list[Usage]]:
    """`JobID|Elapsed|AllocTRES` lines -> job id -> its records (one per start of a requeued job). Lines that
    are not of that shape (a pending range `123_[4-9]`, a time sacct cannot give, garbage) are left out."""
    out: dict[str, list[Usage]] = {}
    for line in text.splitlines():
        cols = line.strip().split("|")
        if len(cols) != 3 or not _JOB_ID.fullmatch(cols[0]):
            continue
        seconds = parse_elapsed(cols[1])
        if seconds is None:
            continue
        gpus, cpus = parse_tres(cols[2])
        out.setdefault(cols[0], []).append(Usage(seconds, gpus, cpus))
    return out


def sacct_usage(job_ids: Sequence[str]) -> dict[str, list[Usage]] | None:
    """One sacct call for all the jobs (by their arrays); None where sacct is not here or fails."""
    bases = sorted({j.split("_")[0] for j in job_ids if _JOB_ID.fullmatch(j)}, key=int)
    if not bases or shutil.which("sacct") is None:
        return None
    cmd = ["sacct", "-n", "-P", "-X", "-D", "-j", ",".join(bases), "-o", "JobID,Elapsed,AllocTRES"]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, errors="replace", timeout=SACCT_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None
    return parse_sacct(proc.stdout) if proc.returncode == 0 else None


def _job_ids(record: Any) -> list[str]:
    found = [str(a["job_id"]) for a in record.attempts if a.get("job_id")]
    return list(dict.fromkeys(found or ([record.job_id] if record.job_id else [])))


def _on_slurm(record: Any) -> bool:
    """Whether the run's jobs went to SLURM: its executor tag (JSON: executor, profile, run root) says so."""
    import json

    try:
        return json.loads(record.executor or "{}").get("executor") == "slurm"
    except (ValueError, AttributeError):
        return False


def run_spent(record: Any, estimate: Estimate, usage: Mapping[str, list[Usage]] | None,
              now: float) -> tuple[float, str] | None:  # fmt: skip
    """Device-seconds a run spent and where they come from (FROM_SACCT or FROM_LEDGER); None where no attempt
    has started. sacct where it holds a record of the run's jobs (for a GPU run, one that names its GPUs)."""
    used = [u for job in _job_ids(record) for u in (usage or {}).get(job, ())]
    if used and estimate.unit == "GPU" and any(u.gpus for u in used):
        return sum(u.seconds * u.gpus for u in used), FROM_SACCT
    if used and estimate.unit == "CPU":
        return sum(u.seconds * (u.cpus or estimate.devices) for u in used), FROM_SACCT
    seconds = spent_seconds(record, now)
    return None if seconds is None else (seconds * estimate.devices, FROM_LEDGER)


# ---------------------------------------------------------------------------
# The time left
# ---------------------------------------------------------------------------


def time_left(
    running: Sequence[tuple[Estimate, float]], queued: Sequence[Estimate], slots: int | None
) -> Span:
    """Wall seconds until the last run ends (expected, low, high): each running run's estimate less the
    seconds it has run (never below 0), then the queued runs in order, on `slots` slots as the dry run places
    them (`pdmctl.budget.cost.wall_seconds`)."""
    rest = [
        Span(*(max(0.0, getattr(e.seconds, k) - done) for k in ("expected", "low", "high")))
        for e, done in running
    ]
    rest += [e.seconds for e in queued]
    return Span(*(wall_seconds([getattr(s, k) for s in rest], slots) for k in ("expected", "low", "high")))


def left_text(left: Span, slots: int | None) -> str:
    if left.high <= 0:
        return "its running runs have run past their predicted time: no estimate of the time left"
    return (f"about {duration(left.expected)} left (range {duration(left.low)}-{duration(left.high)}) at "
            f"{slots or 'all'} at a time")  # fmt: skip


# ---------------------------------------------------------------------------
# Per setting and per sweep
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """A setting's (or the whole sweep's) runs: the hours spent by those that started, the prediction for the
    same runs, and for all of them."""

    name: str
    runs: int  # with an estimate
    started: int
    spent_hours: float
    predicted: Total | None  # the started runs'
    whole: Total


@dataclass(frozen=True)
class SweepCost:
    sweep: str
    unit: str
    settings: list[Row]
    sweep_row: Row
    source: str  # FROM_SACCT, FROM_LEDGER, or sacct with the runs it had no record of
    slots: int | None
    left: Span | None = None  # wall seconds to the sweep's end; None where nothing is queued or running


def _setting(spec: Any) -> str:
    from pdmctl.backends.registry import flat_config, get_backend

    try:
        return f"{spec.backend}: {get_backend(spec.backend).setting(flat_config(spec.config))}"
    except Exception:  # a recorded config this pdmctl reads no setting from: the backend's name alone
        return spec.backend


def _row(name: str, pairs: list[tuple[Any, Estimate]], spent: Mapping[str, tuple[float, str]],
         at_once: int | None) -> Row:  # fmt: skip
    started = [e for r, e in pairs if r.key in spent]
    return Row(name, len(pairs), len(started), sum(spent[r.key][0] for r, _ in pairs if r.key in spent) / 3600,
               total(started, at_once) if started else None, total([e for _, e in pairs], at_once))  # fmt: skip


def sweep_costs(records: Sequence[Any], ctx: Any, now: float, states: Mapping[str, str] | None = None,
                use_sacct: bool = True) -> list[SweepCost | str]:  # fmt: skip
    """Each sweep's cost (or the line saying why it has none). `states`: run key -> "running" or "queued" for
    the runs not yet ended (status' word), from which the time left is estimated; None: no time left."""
    from pdmctl.budget.costing import estimate_specs, slots
    from pdmctl.executors import make_executor

    by_sweep: dict[str, list[Any]] = {}
    for record in records:
        if record.spec is not None:
            by_sweep.setdefault(record.sweep, []).append(record)
    if not by_sweep:
        return []
    try:
        executor = make_executor(ctx.profile)
    except Exception:  # a profile this command cannot build an executor from: no prediction, nothing to say
        return []
    at_once = slots(ctx, executor)
    out: list[SweepCost | str] = []
    for sweep, found in by_sweep.items():
        try:
            estimates = estimate_specs([r.spec for r in found], ctx, executor)
        except (ValueError, OSError) as exc:  # a recorded config this pdmctl cannot estimate: say so, go on
            out.append(f"cost of {sweep}: no prediction ({str(exc).splitlines()[0] if str(exc) else exc!r})")
            continue
        known = [(r, e) for r in found if isinstance(e := estimates.get(r.key), Estimate)]
        if not known:
            out.append(
                f"cost of {sweep}: no estimate for its runs, so no prediction to set the hours spent against"
            )
            continue
        slurm = [j for r, _ in known if _on_slurm(r) for j in _job_ids(r)]
        usage = sacct_usage(slurm) if use_sacct and slurm else None
        spent = {r.key: s for r, e in known if (s := run_spent(r, e, usage, now)) is not None}
        sources = [source for _, source in spent.values()]
        source = FROM_SACCT if sources and all(s == FROM_SACCT for s in sources) else FROM_LEDGER
        if FROM_SACCT in sources and FROM_LEDGER in sources:
            source = f"{FROM_SACCT} ({sources.count(FROM_LEDGER)} run(s) {FROM_LEDGER})"

        settings: dict[str, list[tuple[Any, Estimate]]] = {}
        for r, e in known:
            settings.setdefault(_setting(r.spec), []).append((r, e))
        left = None
        if states is not None and any(states.get(r.key) in ("running", "queued") for r, _ in known):
            running = [(e, spent_seconds(r, now) or 0.0) for r, e in known if states.get(r.key) == "running"]
            left = time_left(running, [e for r, e in known if states.get(r.key) == "queued"], at_once)
        out.append(SweepCost(sweep, "/".join(sorted({e.unit for _, e in known})),
                             [_row(name, pairs, spent, at_once) for name, pairs in sorted(settings.items())],
                             _row("the sweep", known, spent, at_once),
                             source, at_once, left))  # fmt: skip
    return out


# ---------------------------------------------------------------------------
# In words
# ---------------------------------------------------------------------------


def predicted_cell(t: Total | None) -> str:
    """`0.12 (0.08-0.4), at cap 0.5`: a prediction's hours in a table cell; the length-cap figure (every
    response at its cap) only where it is not the high end (VeRL's)."""
    if t is None:
        return ""
    h = t.hours
    return f"{number(h.expected)} ({number(h.low)}-{number(h.high)})" + (
        f", at cap {number(t.upper_hours)}" if t.upper_assumes else "")


def sweep_line(cost: SweepCost) -> str:
    """The sweep's one line: the hours spent by the runs that started, where they come from, the prediction for
    them and for the whole sweep, and the time left while it runs."""
    r, unit = cost.sweep_row, cost.unit
    how = ("each job record's Elapsed x the " + ("GPUs" if unit == "GPU" else f"{unit}s") + " it was allocated"
           if cost.source.startswith(FROM_SACCT)
           else f"each attempt's start to the next attempt's or the run's end, x the {unit}s it holds")  # fmt: skip
    line = (
        f"cost of {cost.sweep}: {number(r.spent_hours)} {unit}-hours spent by the {r.started} run(s) that "
        f"started ({cost.source}: {how})"
    )
    if r.predicted is not None:
        line += f", predicted {total_text(r.predicted, unit)}"
    line += f"; the sweep's {r.runs} run(s): {total_text(r.whole, unit)}"
    if cost.left is not None:
        line += f"; {left_text(cost.left, cost.slots)}"
    return f"{line}; the prediction rests on {RESTS_ON}"


COLUMNS = ("setting", "runs", "started", "spent", "predicted for those started", "predicted for all runs")


def table_rows(cost: SweepCost) -> list[tuple[str, ...]]:
    """One row per setting, then the sweep's (where it has more than one setting)."""
    rows = cost.settings + ([cost.sweep_row] if len(cost.settings) > 1 else [])
    return [(r.name, str(r.runs), str(r.started), number(r.spent_hours), predicted_cell(r.predicted),
             predicted_cell(r.whole)) for r in rows]  # fmt: skip


def status_output(views: Sequence[Any], ctx: Any, now: float | None = None) -> list[Any]:
    """What `pdmctl status` prints under its table: per sweep, a small table by setting (rich) and its line."""
    import time

    from rich.table import Table
    from rich.text import Text

    states = {v.key: str(v.state) for v in views}
    records = [v.record for v in views if v.record is not None]
    out: list[Any] = []
    for cost in sweep_costs(records, ctx, time.time() if now is None else now, states):
        if isinstance(cost, str):
            out.append(cost)
            continue
        table = Table(title=Text(f"{cost.sweep}: {cost.unit}-hours spent and predicted, per setting"),
                      title_justify="left", box=None, pad_edge=False)  # fmt: skip
        for i, header in enumerate(COLUMNS):
            table.add_column(Text(header), justify="right" if i else "left", no_wrap=i < 4)
        for cells in table_rows(cost):
            table.add_row(*map(Text, cells))
        out += [table, sweep_line(cost)]
    return out
