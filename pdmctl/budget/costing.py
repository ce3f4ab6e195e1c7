"""The cost model (pdmctl.budget.cost) applied to a sweep: each run's estimate through its backend, calibrated on
finished runs of the testbed, the plan as JSON (--dry-run --json; docs/PLAN_JSON.md), the testbed's text cost
line. The hours a sweep's runs spent beside the prediction: pdmctl.budget.spent."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pdmctl.budget.cost import (
    TOY_STARTUP_S,
    Calibration,
    Estimate,
    Span,
    _r,
    duration,
    end_times,
    spent_seconds,
    total,
    total_json,
    total_text,
    toy_rollouts,
)


def calibrate(records: Sequence[Any], sweep: str) -> dict[str, Calibration]:
    """Per testbed setting (`toy: MODEL PRECISION`), what its finished runs of `sweep` measured: each run's wall
    time (`spent_seconds`) against its rollouts, fitted as start-up + rate x rollouts by least squares where
    the runs have two lengths or more and the longer ones took longer, else the stated start-up taken off; the
    rate's range is the runs' own rates about that start-up. VeRL runs are not calibrated here: their estimates keep resting on the
    stated assumptions."""
    from pdmctl.backends.registry import flat_config

    rates: dict[str, list[tuple[float, str]]] = {}
    for record in records:
        spec = record.spec
        if record.status != "FINISHED" or spec is None or spec.backend != "toy":
            continue
        seconds = spent_seconds(record, now=0.0)
        if seconds is None:
            continue
        flat = flat_config(spec.config)
        rates.setdefault(f"toy: {flat['model']} {flat['precision']}", []).append(
            (toy_rollouts(flat), seconds, record.key))
    out = {}
    for setting, found in rates.items():
        sizes = [float(n) for n, _, _ in found]
        walls = [w for _, w, _ in found]
        slope = intercept = 0.0
        if len(set(sizes)) >= 2:
            import numpy as np

            slope, intercept = (float(x) for x in np.polyfit(sizes, walls, 1))
        if slope > 0:  # the longer runs took longer: the intercept is the seconds before the first rollout
            fitted = max(0.0, intercept)
            startup = Span(fitted, fitted, fitted)
            basis = f"fitted on runs of {len(set(sizes))} lengths"
        elif len(set(sizes)) >= 2:  # noise (a cold first run, a loaded machine) outweighed the work: no fit
            startup, basis = TOY_STARTUP_S, "the stated one: the longer runs were not slower, so no fit"
        else:
            startup, basis = TOY_STARTUP_S, "the stated one: the runs are of one length"
        values = [max(0.0, w - startup.expected) / n for n, w in zip(sizes, walls, strict=True)]
        mean = sum(values) / len(values)
        keys = ", ".join(k for _, _, k in found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        out[setting] = Calibration(Span(mean, min(values), max(values)), startup, basis,
                                   f"calibrated on {len(found)} finished run(s) of sweep {sweep} ({keys})")  # fmt: skip
    return out



# ---------------------------------------------------------------------------
# The plan as JSON (--dry-run --json; docs/PLAN_JSON.md)
# ---------------------------------------------------------------------------

PLAN_FORMAT = "pdmctl-plan/1"


def calibrate_preflight(ledger: Any, sweep: str) -> dict[str, Any]:
    """Per VeRL setting (`verl: SETTING`, the backend's setting), what the finished runs of `sweep`'s preflight
    (`pdmctl preflight`, sweep `<sweep>.preflight`) measured: its steps' seconds (VeRL's timing_s/step), each
    attempt's start-up to its first step and its checkpoint writes, as median (lowest-highest)."""
    import statistics

    from pdmctl.backends.registry import flat_config, get_backend
    from pdmctl.budget.cost import StepCalibration
    from pdmctl.preflight import FIRST_STEP, STEP, preflight_sweep

    save, testing = "timing_s/save_checkpoint", "timing_s/testing"
    name = preflight_sweep(sweep)
    records = [r for r in ledger.runs(name) if r.status == "FINISHED" and r.spec is not None
               and r.spec.backend == "verl"]  # fmt: skip
    if not records:
        return {}
    histories = ledger.metric_histories([r.run_id for r in records], [STEP, FIRST_STEP, save, testing])
    found: dict[str, dict[str, list[float]]] = {}
    keys: dict[str, list[str]] = {}
    for record in records:
        setting = f"verl: {get_backend('verl').setting(flat_config(record.spec.config))}"
        got = histories.get(record.run_id, {})
        into = found.setdefault(setting, {STEP: [], FIRST_STEP: [], save: [], testing: []})
        for metric in into:
            into[metric] += [v for _, v in got.get(metric, []) if v == v and v >= 0]
        keys.setdefault(setting, []).append(record.key)

    def span(values: list[float]) -> Span:
        return Span(statistics.median(values), min(values), max(values))

    out: dict[str, Any] = {}
    for setting, values in found.items():
        if not values[STEP] or not values[FIRST_STEP]:
            continue
        out[setting] = StepCalibration(span(values[STEP]), span(values[FIRST_STEP]),
                                       span(values[save]) if values[save] else None,
                                       f"preflight {name}'s {len(keys[setting])} run(s) of this setting "
                                       f"({', '.join(keys[setting][:4])})",
                                       span(values[testing]) if values[testing] else None)  # fmt: skip
    return out


def plan_profile(ctx: Any, offline: bool = False) -> tuple[Any, str | None]:
    """`check_profile` for a plan (a dry run): where no SLURM answers here (no `sinfo`: a laptop) or with
    `offline`, a SLURM profile is taken as it states its partition and nodes, and the line saying so is
    returned beside the executor (None: checked)."""
    import shutil

    from pdmctl.executors import make_executor
    from pdmctl.executors.base import placeholders

    left = placeholders(ctx.profile)
    executor = make_executor(ctx.profile)
    if left is None and (executor.name != "slurm" or not (offline or shutil.which("sinfo") is None)):
        executor.check()
        return executor, None
    lines = [f"plan only: {left}"] if left is not None else []
    if executor.name == "slurm":
        why = "--offline" if offline else "no sinfo here" if shutil.which("sinfo") is None else "placeholders"
        partition = getattr(getattr(executor, "options", None), "partition", None) or "(the default)"
        lines.append(f"cluster {ctx.profile.name}: not checked against SLURM ({why}): its partition {partition} and "
                     f"{executor.nodes_per_job()} node(s) a job are taken as the profile states them; the weights and "
                     "data on its storage are not looked for")  # fmt: skip
    return executor, "\n".join(lines)


def preflight_calibration(ctx: Any, sweep: str) -> dict[str, Any]:
    """What `sweep`'s preflight measured of its VeRL settings (`calibrate_preflight`) in the context's ledger;
    nothing where the ledger does not exist."""
    from pdmctl.ledger import ledger_exists, open_ledger

    return calibrate_preflight(open_ledger(ctx.tracking_uri), sweep) if ledger_exists(ctx.tracking_uri) else {}


def slots(ctx: Any, executor: Any) -> int | None:
    """Runs at once: the profile's max_concurrent, else the local executor's cap (one per core)."""
    return ctx.profile.max_concurrent or getattr(executor, "cap", None)


def cluster_settings(ctx: Any, executor: Any) -> dict[str, Any]:
    """What the backends' estimates read of the cluster (describe_runs' settings, and the CPUs of a job)."""
    options = getattr(executor, "options", None)
    return {**executor.job_settings(), "nodes": executor.nodes_per_job(), "tracking_uri": ctx.tracking_uri,
            "max_concurrent": slots(ctx, executor), "cpus_per_task": getattr(options, "cpus_per_task", None)}  # fmt: skip


def estimate_specs(specs: Sequence[Any], ctx: Any, executor: Any,
                   calibration: Mapping[str, Calibration] | None = None) -> dict[str, Estimate | str]:
    """run key -> its Estimate, or why it has none, for runs of any backend (calibrated where `calibration`
    measured the run's setting)."""
    from collections import defaultdict

    from pdmctl.backends.registry import DescribedRun, flat_config, get_backend

    cluster = {**cluster_settings(ctx, executor), "calibration": dict(calibration or {})}
    by_backend: dict[str, list[DescribedRun]] = defaultdict(list)
    for spec in specs:
        by_backend[spec.backend].append(DescribedRun(spec.key, spec.summary, flat_config(spec.config),
                                                     ctx.run_dir_parent(spec) / "RUN_ID"))  # fmt: skip
    out: dict[str, Estimate | str] = {}
    for name, runs in by_backend.items():
        out.update(get_backend(name).estimate(runs, cluster))
    return out


def plan_json(plan: Any, ctx: Any, executor: Any, order: str, ledger_unread: str | None = None,
              calibration: Mapping[str, Calibration] | None = None) -> dict[str, Any]:
    """The dry run's plan as JSON data (PLAN_FORMAT): every run in array order with its cost, per setting and for
    the runs the sweep would submit."""
    from pdmctl.backends.registry import flat_config, get_backend
    from pdmctl.order import replicates

    specs = plan.specs
    estimates = estimate_specs(specs, ctx, executor, calibration)
    replicate_of = replicates(specs)
    submit = {s.key for s in plan.to_submit}
    given = executor.nodes_per_job()
    runs, by_setting = [], {}
    for position, spec in enumerate(specs, 1):
        backend, flat = get_backend(spec.backend), flat_config(spec.config)
        setting = f"{spec.backend}: {backend.setting(flat)}"
        estimate = estimates.get(spec.key)
        runs.append({"order": position, "key": spec.key, "summary": spec.summary, "setting": setting,
                     "seed": spec.seed, "replicate": replicate_of[spec.key], "state": str(plan.states[spec.key]),
                     "action": "submit" if spec.key in submit else "skip", "nodes": backend.nodes(flat) or given,
                     "config": spec.config,
                     "cost": estimate.as_json() if isinstance(estimate, Estimate) else None,
                     "cost_missing": estimate if isinstance(estimate, str) else None})  # fmt: skip
        if spec.key in submit:
            by_setting.setdefault(setting, []).append((estimate, runs[-1]["nodes"]))
    at_once = slots(ctx, executor)

    def summed(found: Sequence[tuple[Any, int]]) -> dict[str, Any] | None:
        """Hours summed; the wall time with each run on its nodes, those of fewer side by side in a share."""
        if not found or not all(isinstance(e, Estimate) for e, _ in found):
            return None
        t = total_json(total([e for e, _ in found], at_once, [n for _, n in found], given))
        t["rests_on"] = sorted({e.rests_on for e, _ in found})
        return t

    answers = first_answers(plan, ctx, executor, calibration)

    def first_day(name: str) -> dict[str, float] | None:
        when = answers.get(name)
        if when is None or isinstance(when, str):  # its replicate 0 has ended; a run without an estimate
            return {"expected": 0.0, "low": 0.0, "high": 0.0} if when is None else None
        return {"expected": _r(when.expected), "low": _r(when.low), "high": _r(when.high)}

    settings = [{"setting": name, "runs": len(found), "cost": summed(found), "first_comparison_day": first_day(name)}
                for name, found in by_setting.items()]  # fmt: skip
    nodes_of = {r["key"]: r["nodes"] for r in runs}
    to_submit = [(estimates.get(s.key), nodes_of[s.key]) for s in plan.to_submit]
    return {"format": PLAN_FORMAT, "sweep": specs[0].sweep if specs else None, "cluster": ctx.profile.name,
            "executor": ctx.profile.executor, "order": order, "nodes_per_job": given, "max_concurrent": at_once,
            "ledger_read": ledger_unread is None, "runs": runs, "settings": settings,
            "sweep_cost": summed(to_submit)}  # fmt: skip


def first_answers(plan: Any, ctx: Any, executor: Any,
                  calibration: Mapping[str, Calibration] | None = None) -> dict[str, Span | str | None]:
    """Per setting (in array order), when its first complete comparison is in: the day replicate 0 of every
    one of its arms has ended, from the queue's first start, with the runs to submit placed in array order on
    the profile's slots (`cost.end_times`) at their expected, low and high times. None: already in (every
    such run ended); a text: why it cannot be said (a run without an estimate)."""
    from pdmctl.backends.registry import flat_config, get_backend
    from pdmctl.order import replicates, setting_of

    submit = list(plan.to_submit)
    estimates = estimate_specs(submit, ctx, executor, calibration)
    given = executor.nodes_per_job()
    nodes = [get_backend(s.backend).nodes(flat_config(s.config)) or given for s in submit]
    known = all(isinstance(estimates.get(s.key), Estimate) for s in submit)
    ends: dict[str, list[float]] = {}
    if known:
        for bound in ("expected", "low", "high"):
            times = end_times([getattr(estimates[s.key].seconds, bound) for s in submit], slots(ctx, executor),
                              nodes, given)  # fmt: skip
            for spec, end in zip(submit, times, strict=True):
                ends.setdefault(spec.key, []).append(end)
    waiting = {s.key for s in submit}
    replicate_of = replicates(plan.specs)
    out: dict[str, Span | str | None] = {}
    for spec in plan.specs:
        name = setting_of(spec)
        out.setdefault(name, None)
        if replicate_of[spec.key] != 0 or spec.key not in waiting or isinstance(out[name], str):
            continue
        if not known:
            missing = next(s for s in submit if not isinstance(estimates.get(s.key), Estimate))
            out[name] = f"not estimated: {estimates.get(missing.key) or 'no cost model for ' + missing.summary}"
            continue
        day = [end / 86400 for end in ends[spec.key]]
        before = out[name] if isinstance(out[name], Span) else Span(0.0, 0.0, 0.0)
        out[name] = Span(max(before.expected, day[0]), max(before.low, day[1]), max(before.high, day[2]))
    return out


def first_answers_lines(plan: Any, ctx: Any, executor: Any,
                        calibration: Mapping[str, Calibration] | None = None) -> list[str]:
    """The dry run's lines on when each setting's first complete comparison is in (`first_answers`)."""
    if not plan.specs:
        return []
    found = first_answers(plan, ctx, executor, calibration)
    lines = ["first complete comparison per setting (replicate 0 of every arm ended), days from the queue's "
             "first start, expected (low-high; high: every run at its cost's high end), at the profile's runs at a time:"]  # fmt: skip
    for name, when in found.items():
        if when is None:
            text = "in already (its replicate 0 has ended)"
        elif isinstance(when, str):
            text = when
        else:
            text = f"day {when.expected:.1f} ({when.low:.1f}-{when.high:.1f})"
        lines.append(f"  {name}: {text}")
    return lines


def testbed_line(specs: Sequence[Any], ctx: Any, executor: Any,
                 calibration: Mapping[str, Calibration] | None = None) -> str | None:
    """The text dry run's cost line for the testbed's runs to submit (VeRL's are describe.py's), or None."""
    toy = [s for s in specs if s.backend == "toy"]
    if not toy:
        return None
    found = [e for e in estimate_specs(toy, ctx, executor, calibration).values() if isinstance(e, Estimate)]
    t = total(found, slots(ctx, executor))
    basis = sorted({e.rests_on for e in found})
    return (f"testbed cost: {len(found)} run(s), {total_text(t, 'CPU')}; {duration(t.wall_s.expected)} "
            f"of wall time expected ({duration(t.wall_s.low)}-{duration(t.wall_s.high)}, high at the same rate) at "
            f"{slots(ctx, executor)} at a time; rests on {'; '.join(basis)}")  # fmt: skip
