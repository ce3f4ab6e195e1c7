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
    duration,
    hours_text,
    spent_seconds,
    total,
    total_json,
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
    from pdmctl.executors.base import check_placeholders

    check_placeholders(ctx.profile)
    executor = make_executor(ctx.profile)
    if executor.name != "slurm" or not (offline or shutil.which("sinfo") is None):
        executor.check()
        return executor, None
    partition = getattr(getattr(executor, "options", None), "partition", None) or "(the default)"
    return executor, (f"cluster {ctx.profile.name}: not checked against SLURM ({'--offline' if offline else 'no sinfo here'}"
                      f"): its partition {partition} and {executor.nodes_per_job()} node(s) a job are taken as the "
                      "profile states them")  # fmt: skip


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
    from pdmctl.orchestrate import replicates

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

    settings = [{"setting": name, "runs": len(found), "cost": summed(found)} for name, found in by_setting.items()]
    nodes_of = {r["key"]: r["nodes"] for r in runs}
    to_submit = [(estimates.get(s.key), nodes_of[s.key]) for s in plan.to_submit]
    return {"format": PLAN_FORMAT, "sweep": specs[0].sweep if specs else None, "cluster": ctx.profile.name,
            "executor": ctx.profile.executor, "order": order, "nodes_per_job": given, "max_concurrent": at_once,
            "ledger_read": ledger_unread is None, "runs": runs, "settings": settings,
            "sweep_cost": summed(to_submit)}  # fmt: skip


def testbed_line(specs: Sequence[Any], ctx: Any, executor: Any,
                 calibration: Mapping[str, Calibration] | None = None) -> str | None:
    """The text dry run's cost line for the testbed's runs to submit (VeRL's are describe.py's), or None."""
    toy = [s for s in specs if s.backend == "toy"]
    if not toy:
        return None
    found = [e for e in estimate_specs(toy, ctx, executor, calibration).values() if isinstance(e, Estimate)]
    t = total(found, slots(ctx, executor))
    basis = sorted({e.rests_on for e in found})
    return (f"testbed cost: {len(found)} run(s), {hours_text(t.hours, t.upper_hours, 'CPU')}; {duration(t.wall_s.expected)} "
            f"of wall time expected ({duration(t.wall_s.low)}-{duration(t.wall_s.high)}) at {slots(ctx, executor)} at a "
            f"time; rests on {'; '.join(basis)}")  # fmt: skip
