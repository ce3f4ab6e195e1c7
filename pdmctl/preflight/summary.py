"""What `pdmctl preflight` prints: each setting's preflight job and its cost (a dry run), then each setting's
verdict from the ledger (its measurements, or its first error in one line)."""

from __future__ import annotations

import re
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pdmctl import preflight
from pdmctl.preflight import FIRST_STEP, STEP
from pdmctl.spec import RunSpec

SAVE = "timing_s/save_checkpoint"  # VeRL's: a checkpoint's write
MEMORY = ("perf/max_memory_allocated_gb", "perf/max_memory_reserved_gb")  # VeRL's, per rank's peak
TOPK = "pdmctl/topk_carried_frac"  # the share of response tokens whose rollout top-K reached the loss
METRICS = (FIRST_STEP, STEP, SAVE, *MEMORY, TOPK)


def _setting(spec: RunSpec) -> str:
    from pdmctl.backends.registry import flat_config, get_backend

    return f"{get_backend(spec.backend).setting(flat_config(spec.config))} {spec.config['mask']['name']}"


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h" if seconds >= 360 else f"{seconds / 60:.1f} min"


def plan_lines(chosen: Sequence[RunSpec], ctx: Any, executor: Any, steps: int, total_runs: int) -> list[str]:
    """The dry run: the preflight jobs, one line each with its expected cost, and their total."""
    from pdmctl.budget.costing import estimate_specs

    estimates = estimate_specs(chosen, ctx, executor)
    lines = [f"preflight {chosen[0].sweep}: {len(chosen)} job(s), one per setting and mask method of the sweep's "
             f"{total_runs} run(s); each trains {steps} steps with a checkpoint after every step, requeues itself "
             f"after step {preflight.REQUEUE_AT_STEP}'s checkpoint through SLURM's time-limit signal (USR2), resumes "
             "from it and trains the rest"]  # fmt: skip
    hours = [0.0, 0.0, 0.0]
    unit = None
    for spec in chosen:
        estimate = estimates.get(spec.key)
        if isinstance(estimate, str) or estimate is None:
            lines.append(f"  {_setting(spec)} ({spec.key}): {estimate or 'no cost model'}")
            continue
        startup = estimate.parts.get("startup", 0.0) / max(1, estimate.attempts)
        extra = startup * estimate.devices / 3600  # the requeued attempt's start-up
        h = estimate.hours
        hours = [hours[0] + h.expected + extra, hours[1] + h.low + extra, hours[2] + h.high + extra]
        unit = estimate.unit
        lines.append(f"  {_setting(spec)} ({spec.key}): {estimate.devices} {estimate.unit}(s), expected "
                     f"{_hours(estimate.seconds.expected + startup)} wall ({_hours(estimate.seconds.low + startup)}-"
                     f"{_hours(estimate.seconds.high + startup)}), two attempts")  # fmt: skip
    if unit is not None:
        lines.append(f"preflight total: {hours[0]:,.1f} {unit}-hours expected ({hours[1]:,.1f}-{hours[2]:,.1f})")
    return lines


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} bytes"


def _median(history: Sequence[tuple[int, float]]) -> float | None:
    values = [v for _, v in history if v == v]
    return statistics.median(values) if values else None


def _bytes(path: Path) -> int | None:
    try:
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else None
    except OSError:
        return None


def _checkpoint_bytes(checkpoints: Path) -> int | None:
    """The size of the newest checkpoint on disk (VeRL's global_step_N directory, the testbed's step file)."""
    try:
        saved = sorted((p for p in checkpoints.iterdir() if p.name.startswith(("global_step_", "step_"))),
                       key=lambda p: int("".join(c for c in p.name if c.isdigit()) or 0))  # fmt: skip
    except OSError:
        return None
    if not saved:
        return None
    return saved[-1].stat().st_size if saved[-1].is_file() else _bytes(saved[-1])


def predicted_step_seconds(estimate: Any, flat: Mapping[str, Any]) -> float | None:
    """The cost model's seconds a step of this run (its rollout, training and fixed time, without start-up,
    evaluations and checkpoint writes), or None where it has no estimate."""
    if estimate is None or isinstance(estimate, str):
        return None
    steps = flat.get("steps") or flat.get("total_training_steps")
    work = sum(v for k, v in estimate.parts.items() if k in ("rollout", "train", "step_fixed", "training", "steps"))
    return work / int(steps) if steps and work > 0 else None


def measurements(histories: Mapping[str, list[tuple[int, float]]], run_dir: Path | None,
                 predicted_step_s: float | None = None) -> str:
    """One run's measurements in words (what it did not log: left out)."""
    parts = []
    first = histories.get(FIRST_STEP, [])
    if first:
        parts.append(f"first step after {first[0][1]:.0f} s")
        if len(first) > 1:
            parts.append(f"the resumed attempt's after {first[-1][1]:.0f} s")
    step = _median(histories.get(STEP, []))
    if step is not None:
        parts.append(f"a step {step:.1f} s (median of {len(histories[STEP])})")
    if step is not None and predicted_step_s is not None:
        parts[-1] += f", the cost model's {predicted_step_s:.1f} s"
    save = _median(histories.get(SAVE, []))
    checkpoint = _checkpoint_bytes(run_dir / "checkpoints") if run_dir else None
    if checkpoint is not None or save is not None:
        size = _size(checkpoint) if checkpoint is not None else "size unknown"
        parts.append(f"a checkpoint {size}" + (f" written in {save:.1f} s" if save is not None else ""))
    for name in MEMORY:
        peak = max((v for _, v in histories.get(name, [])), default=None)
        if peak is not None:
            parts.append(f"{name.rsplit('/', 1)[1].replace('_gb', '')} {peak:.1f} GB a rank")
    carried = histories.get(TOPK, [])
    if carried:
        parts.append(f"top-K carried on {min(v for _, v in carried):.0%} of tokens at least, every step")
    return "; ".join(parts) or "no measurements logged"


def verdicts(chosen: Sequence[RunSpec], ctx: Any, executor: Any) -> tuple[list[str], int, int]:
    """Each setting's verdict (lines), the settings that failed and those not ended yet."""
    from pdmctl import orchestrate
    from pdmctl.backends.registry import flat_config
    from pdmctl.budget.costing import estimate_specs
    from pdmctl.ledger import open_ledger

    estimates = estimate_specs(chosen, ctx, executor)

    views = {v.key: v for v in orchestrate.status(ctx, chosen[0].sweep)}
    records = [v.record for v in views.values() if v.record is not None]
    histories = open_ledger(ctx.tracking_uri).metric_histories([r.run_id for r in records], [*METRICS, "train/mask_frac"]) \
        if records else {}  # fmt: skip
    lines, failed, pending = [], 0, 0
    for spec in chosen:
        view = views.get(spec.key)
        label = f"{_setting(spec)} ({spec.key})"
        if view is None or view.record is None:
            lines.append(f"  not submitted  {label}")
            pending += 1
            continue
        record = view.record
        state = str(view.state)
        run_dir = ctx.run_dir(record)
        got = histories.get(record.run_id, {})
        steps = sorted({s for s, _ in got.get("train/mask_frac", [])} | {s for s, _ in got.get(STEP, [])})
        predicted = predicted_step_seconds(estimates.get(spec.key), flat_config(spec.config))
        if state == orchestrate.RunState.FINISHED:
            resumed = record.attempt >= 2 and any(s > preflight.REQUEUE_AT_STEP for s in steps)
            if not resumed:
                failed += 1
                lines.append(f"  FAIL  {label}: finished without resuming (attempts {record.attempt}, steps "
                             f"{steps}): its job was not requeued after step {preflight.REQUEUE_AT_STEP}")  # fmt: skip
                continue
            lines.append(f"  ok    {label}: steps {steps[0]}-{steps[-1]} in {record.attempt} attempts, requeued after "
                         f"step {preflight.REQUEUE_AT_STEP} and resumed from its checkpoint; "
                         f"{measurements(got, run_dir, predicted)}")  # fmt: skip
        elif view.state in orchestrate.ACTIVE:
            pending += 1
            lines.append(f"  {state:<6}{label}: step {steps[-1] if steps else 0} of attempt {record.attempt}")
        else:
            failed += 1
            lines.append(f"  FAIL  {label}: {first_error(record, run_dir)}")
    return lines, failed, pending


# what stops a setting most often, in the words of torch, CUDA, Python and the checkpoint loaders
# (VeRL's guard, pdmctl.backends.verl.safeload; torch's weights-only reader), named before the error
KINDS = (
    ("out of memory", re.compile(r"out of memory|OutOfMemoryError|can't allocate memory|not enough memory", re.I)),
    ("a module the job's environment lacks", re.compile(r"ModuleNotFoundError|No module named")),
    ("a checkpoint its loader refused", re.compile(r": refused: it |Weights only load failed|no checkpoint loads")),
)


def kind_of(error: str) -> str | None:
    """What kind of failure an error line is (KINDS), or None."""
    return next((kind for kind, pattern in KINDS if pattern.search(error)), None)


def first_error(record: Any, run_dir: Path) -> str:
    """The job's own word on why it failed (its reason), else the last error line of its latest log, after
    its kind where it is one of KINDS."""
    from pdmctl.orchestrate import last_error_line

    found = " ".join(str(record.reason).split()) if record.reason else None
    for attempt in range(max(1, record.attempt), 0, -1):
        if found:
            break
        found = last_error_line(run_dir / "logs" / f"attempt-{attempt}.log")
    if not found:
        return f"{record.status} with no error logged (logs in {run_dir / 'logs'})"
    kind = kind_of(found)
    return f"{kind}: {found[:300]}" if kind else found[:300]
