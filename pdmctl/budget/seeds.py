"""`pdmctl seeds`: how many more seeds would resolve each comparison of a sweep, what they cost, and (with
--submit) the runs that add them.

It reads the sweep's finished runs as the report does (`report.collect`, `report.build.comparisons`). For
every paired comparison (a mask against the baseline, per setting and held-out set) it prints the interval
the report would show once seeds are added after looking (`report.sequential`: group-sequential, each
stage at its share of α), whether that interval leaves out 0 (resolved), and, where not, the seeds at which
the paired t-test at the next stage's level (α/2^(stage+1)) reaches 80% power at the observed difference
and spread (`report.power`). The extra runs cost what this row's finished runs took (CPU-hours for the
testbed; "unknown" elsewhere). With --submit the extra seeds become ordinary runs of the same configs,
registered and submitted through `orchestrate.sweep` (same keys, ledger, one live job per run), each
marked with the look after which it was added (provenance field `look`), so that the report knows.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

import typer

from pdmctl.shell import complete

MAX_SEEDS = 10  # default cap on a row's seeds in all


def register(app: typer.Typer) -> None:
    app.command(name="seeds")(seeds)


@dataclass(frozen=True)
class Proposal:
    """One comparison on one column: where it stands and the seeds that would resolve it."""

    setting: str
    mask: str  # the mask's row label
    baseline: str  # the baseline's row label
    column: str
    n: int  # matched seeds
    stages: int  # 1 + the additions its seeds went through
    difference: float  # in percentage points
    spread: float  # the per-seed differences' standard deviation, in points
    low: float | None  # the sequential interval, in points
    high: float | None
    resolved: bool
    needed: int | None  # matched seeds for 80% power at the next stage's level; None: more than power.MAX_SEEDS
    extra: int  # seeds to add (0 when resolved or out of reach)
    fixed: int | None = None  # the same for a new sweep of fixed size, at the whole α (the report's power table)
    values: tuple[float, ...] = ()  # the per-seed differences (fractions) and each one's stage
    stage_of: tuple[int, ...] = ()
    interval: str = ""  # what the interval is, in the report's words (report.intervals.sequential_label)
    # the interval the report prints today where it differs (no seeds added to the sweep yet: fixed size)
    report_interval: str = ""
    report_low: float | None = None
    report_high: float | None = None
    last_look: int = 0  # the look after which its last seeds were added (0: none added to it)


@dataclass(frozen=True)
class Look:
    proposals: list[Proposal]
    additions: dict[Any, int]  # row key -> seeds to add (the most any of its comparisons needs, capped)
    seeds_of: dict[Any, list[int]]  # row key -> the seeds it has (finished or not)
    look: int  # the number of this look (1 + the looks already recorded on the sweep's runs)
    unfinished: int  # runs of the sweep that have not ended
    unpaired: list[str]  # comparisons without a seed in common (nothing to add to)
    waiting: list[tuple[str, int]] = field(default_factory=list)  # (comparison, runs of its setting not ended)


def propose(data, definition, max_seeds: int) -> Look:
    """Each paired comparison's proposal, from the report's own collection `data` of the sweep."""
    from pdmctl.ledger import TERMINAL
    from pdmctl.report import power
    from pdmctl.report.build import _run_values, comparisons, held_out_names
    from pdmctl.report.intervals import sequential_label, short_name
    from pdmctl.report.sequential import run_look, sequential_interval, stage_alpha
    from pdmctl.report.sequential import stages as stage_numbers

    labels = tuple(c.label for c in definition.columns) + ((definition.average,) if definition.average else ())
    alpha = 1 - definition.confidence.level
    proposals, additions, unpaired = [], defaultdict(int), []
    names = held_out_names(data, definition)
    keys, seed_of, _ = _row_keys(data)
    open_in: dict[str, int] = defaultdict(int)  # setting -> its runs that have not ended
    for run_id, row in keys.items():
        open_in[row.setting] += data.records[run_id].status not in TERMINAL
    waiting, waited = [], []
    read_sequentially = any(run_look(r) for r in data.records.values())  # as report.sequential.apply reads it
    for comparison in comparisons(data, definition, labels):
        if open_in[comparison.row.setting]:  # not looked at before every run of its setting ended
            waiting.append((f"{comparison.row.setting} {comparison.row.label} vs {comparison.baseline.label}",
                            open_in[comparison.row.setting]))  # fmt: skip
            waited.append(comparison.row)
            continue
        if not comparison.seeds:  # no seed in common: nothing to add to
            unpaired.append(f"{comparison.row.setting} {comparison.row.label} vs {comparison.baseline.label}")
            continue
        mine = {p.seed: p for p in data.by_row[comparison.row]}
        theirs = {p.seed: p for p in data.by_row[comparison.baseline]}
        looks = [max(run_look(data.records[mine[s].run_id]), run_look(data.records[theirs[s].run_id]))
                 for s in comparison.seeds]  # fmt: skip
        wanted = 0
        for label in labels:
            d = [_run_values(mine[s], labels, definition.average)[label]
                 - _run_values(theirs[s], labels, definition.average)[label] for s in comparison.seeds]  # fmt: skip
            interval, _, stages = sequential_interval(d, looks, definition.confidence.level)
            stage_of = tuple(stage_numbers(looks))
            diff = sum(d) / len(d)
            spread = float(_sd(d))
            resolved = interval is not None and (interval.low > 0 or interval.high < 0)
            needed = fixed = None
            if not resolved and spread > 0:
                needed = power.seeds_needed(abs(diff) / spread, paired=True, alpha=stage_alpha(stages + 1, alpha))
                fixed = power.seeds_needed(abs(diff) / spread, paired=True, alpha=alpha)
            extra = 0 if resolved or needed is None else max(1, needed - len(d))
            wanted = max(wanted, extra)
            fixed_size = comparison.cells[label].difference.interval  # the report's until seeds are added
            said = "" if read_sequentially else (
                f"{short_name(definition.confidence)} interval over {len(d)} matched seeds (fixed size)")
            proposals.append(Proposal(comparison.row.setting, comparison.row.label, comparison.baseline.label,
                                      names.get(label, label),
                                      len(d), stages, 100 * diff, 100 * spread,
                                      None if interval is None else 100 * interval.low,
                                      None if interval is None else 100 * interval.high, resolved, needed, extra,
                                      fixed, tuple(d), stage_of,
                                      sequential_label(definition.confidence.level, len(d), stages, max(looks)),
                                      said, None if said == "" or fixed_size is None else 100 * fixed_size.low,
                                      None if said == "" or fixed_size is None else 100 * fixed_size.high,
                                      max(looks)))  # fmt: skip
        for row in (comparison.row, comparison.baseline):
            additions[row] = max(additions[row], wanted)
    seeds_of: dict[Any, set[int]] = defaultdict(set)
    for run_id, row in keys.items():
        seeds_of[row].add(seed_of[run_id])
    for row in list(additions):
        additions[row] = max(0, min(additions[row], max_seeds - len(seeds_of[row])))
    told = {row.setting for row in waited}  # the settings with no comparison collected yet are listed too
    waiting += [(setting, n) for setting, n in sorted(open_in.items()) if n and setting not in told]
    looks = [run_look(r) for r in data.records.values()]
    unfinished = sum(1 for r in data.records.values() if r.status not in TERMINAL)
    return Look(proposals, {r: n for r, n in additions.items() if n}, {r: sorted(s) for r, s in seeds_of.items()},
                max(looks, default=0) + 1, unfinished, unpaired, waiting)  # fmt: skip


def expected_course(look: Look, level: float, max_seeds: int) -> dict[Any, float]:
    """row -> the matched seeds at which the rule is expected to stop (`seeds_rule.simulate_rule` at each
    unresolved comparison's observed difference and spread, the most of its columns), for the rows this
    look adds to."""
    from pdmctl.budget.seeds_rule import simulate_rule

    by_pair: dict[tuple[str, str], float] = defaultdict(float)
    for p in look.proposals:
        key = (p.setting, p.mask)
        if p.resolved or not p.extra or not p.spread > 0:
            by_pair[key] = max(by_pair[key], p.n)
            continue
        mean = sum(p.values) / len(p.values)
        run = simulate_rule(p.values, mean, p.spread / 100, 1 - level, max_seeds, stages=p.stage_of)
        by_pair[key] = max(by_pair[key], run.seeds)
        by_pair[(p.setting, p.baseline)] = max(by_pair[(p.setting, p.baseline)], run.seeds)
    return {row: by_pair.get((row.setting, row.label), float(len(look.seeds_of.get(row, []))))
            for row in look.additions}  # fmt: skip


def course_text(look: Look, course: dict[Any, float], costs: dict[Any, tuple[str, float]]) -> tuple[str, dict[str, float]]:
    """The expectation in words, and its cost (device -> hours) where every row's is known."""
    from pdmctl.budget.seeds_rule import DRAWS

    total: dict[str, float] = defaultdict(float)
    for row, final in course.items():
        if row not in costs:
            total.clear()
            break
        total[costs[row][0]] += max(0.0, final - len(look.seeds_of.get(row, []))) * costs[row][1]
    seeds = ", ".join(f"{row.setting} {row.label} {final:.1f}" for row, final in course.items())
    cost = " + ".join(f"{hours_text(h)} {u}-hours" for u, h in sorted(total.items())) if total else "cost unknown"
    return (f"the rule is expected to stop at about {seeds} seeds ({DRAWS} seeded draws at the observed "
            f"difference and spread, --max-seeds the cap), adding {cost} in all"), dict(total)  # fmt: skip


def _sd(values: Sequence[float]) -> float:
    if len(values) < 2:
        return math.nan
    m = sum(values) / len(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def _row_keys(data):
    from pdmctl.report.collect import row_keys

    return row_keys(list(data.records.values()))


def new_specs(data, look: Look) -> list:
    """The runs that add the proposed seeds: each row's config with the seeds after the highest its setting
    has (finished or not), so the two rows of a comparison get the same new seeds."""
    from pdmctl.spec import RunSpec

    keys, _, _ = _row_keys(data)
    setting_max: dict[str, int] = defaultdict(lambda: -1)
    for row, seeds in look.seeds_of.items():
        setting_max[row.setting] = max(setting_max[row.setting], *seeds)
    out = []
    for row, extra in look.additions.items():
        record = next(data.records[run_id] for run_id, r in keys.items() if r == row and data.records[run_id].spec)
        spec = record.spec
        first = setting_max[row.setting] + 1
        for seed in range(first, first + extra):
            out.append(RunSpec.from_config(spec.sweep, {**spec.config, "seed": seed}))
    return out


def row_hours(data) -> dict[Any, float]:
    """row -> the mean wall hours of its finished runs, from their recorded start and end."""
    from pdmctl.ledger import FINISHED

    keys, _, _ = _row_keys(data)
    spent: dict[Any, list[float]] = defaultdict(list)
    for run_id, row in keys.items():
        r = data.records[run_id]
        if r.status == FINISHED and r.start_time and r.end_time and r.end_time > r.start_time:
            spent[row].append((r.end_time - r.start_time) / 3.6e6)
    return {row: sum(h) / len(h) for row, h in spent.items()}


def model_hours(data, look: Look, ctx) -> dict[Any, tuple[str, float]]:
    """row -> (device, hours) of one added run by the cost model (`budget.costing.estimate_specs`, the dry
    run's), for the rows whose cost `cost_text` cannot take from measured durations (VeRL's; a testbed row
    without recorded ones). Empty where the model cannot be read here."""
    from pdmctl.budget.cost import Estimate
    from pdmctl.budget.costing import estimate_specs
    from pdmctl.executors import make_executor

    hours = row_hours(data)
    specs = {row: spec for row, spec in _row_specs(data).items()
             if row in look.additions and (spec.backend != "toy" or row not in hours)}  # fmt: skip
    if not specs:
        return {}
    try:
        estimates = estimate_specs(list(specs.values()), ctx, make_executor(ctx.profile))
    except Exception:
        return {}
    return {row: (e.unit, e.hours.expected) for row, spec in specs.items()
            if isinstance(e := estimates.get(spec.key), Estimate)}  # fmt: skip


def _row_specs(data) -> dict[Any, Any]:
    keys, _, _ = _row_keys(data)
    return {row: data.records[run_id].spec for run_id, row in keys.items() if data.records[run_id].spec}


def run_costs(data, look: Look, modelled: dict[Any, tuple[str, float]] | None = None) -> dict[Any, tuple[str, float]]:
    """row -> (device, hours) of one more run: the testbed's measured durations (one core a run), else the
    cost model's (`modelled`); rows with neither are left out."""
    hours, backend_of = row_hours(data), {row: spec.backend for row, spec in _row_specs(data).items()}
    out = {row: ("CPU", hours[row]) for row in look.additions if backend_of.get(row) == "toy" and row in hours}
    return {**{r: v for r, v in (modelled or {}).items() if r not in out}, **out}


def hours_text(hours: float) -> str:
    """Hours as people write them: three significant digits, whole hours with thousands separators from 1,000."""
    return f"{hours:,.0f}" if hours >= 1000 else f"{hours:.3g}"


def cost_text(data, look: Look, modelled: dict[Any, tuple[str, float]] | None = None) -> str:
    """What the extra runs would cost: CPU-hours for the testbed (one core a run) from the rows' recorded
    durations, the cost model's expected device-hours (`model_hours`) for the others; "unknown" where
    neither is known here."""
    costs = run_costs(data, look, modelled)
    total: dict[str, float] = defaultdict(float)
    unknown = []
    for row, extra in look.additions.items():
        if row not in costs:
            unknown.append(row.label)
            continue
        total[costs[row][0]] += extra * costs[row][1]
    runs = sum(look.additions.values())
    if unknown:
        return f"{runs} run(s); cost unknown (no recorded testbed durations or cost model for {', '.join(sorted(set(unknown)))})"
    sources = "the cost model" if modelled and set(modelled) & set(look.additions) else ""
    if any(costs[r][0] == "CPU" and r not in (modelled or {}) for r in look.additions):
        sources = "the rows' finished runs' recorded durations, one core a run" + (" and " + sources if sources else "")
    return f"{runs} run(s), about {' + '.join(f'{hours_text(h)} {u}-hours' for u, h in sorted(total.items()))} ({sources})"


def two_intervals(look: Look, level: float) -> str:
    """One line on how this command's intervals stand to the report's: the same, or why they differ."""
    if not any(p.report_interval for p in look.proposals):
        return (f"intervals: the report prints these same ones (seeds were added to this sweep after look "
                f"{look.look - 1}: every paired comparison is read as a group-sequential design)")  # fmt: skip
    return (f"intervals: no seeds have been added to this sweep after looking, so the report prints the "
            f"fixed-size {100 * level:g}% interval over the seeds it has; this look reads each comparison as stage "
            f"1 of a group-sequential design, at {100 * (1 - (1 - level) / 2):g}%, so that adding seeds because of "
            f"what it shows keeps {100 * level:g}% coverage; once seeds are added (--submit) the report prints the "
            "group-sequential interval too")  # fmt: skip


def _fmt(x: float | None) -> str:
    """A difference in points, within its range [−100, 100]."""
    return "n/a" if x is None or not math.isfinite(x) else f"{min(100.0, max(-100.0, x)):+.1f}"


def seeds(
    sweep: Annotated[
        str | None,
        typer.Argument(
            metavar="SWEEP", help="The sweep (default: the ledger's only one).", autocompletion=complete.sweeps
        ),
    ] = None,
    definition: Annotated[
        str,
        typer.Option(
            "--report",
            "--definition",
            "-d",
            help="Report definition: reports/NAME.yaml or a path.",
            autocompletion=complete.report_definitions,
        ),
    ] = "default",
    submit: Annotated[bool, typer.Option("--submit", help="Register and submit the proposed seeds as runs.")] = False,
    max_seeds: Annotated[
        int, typer.Option("--max-seeds", help="At most this many seeds per row in all (finished or not).")
    ] = MAX_SEEDS,
    max_hours: Annotated[
        float | None,
        typer.Option("--max-hours", help="Submit nothing when this look's added runs are expected to cost more "
                     "device-hours than this (or their cost is unknown)."),
    ] = None,
    cluster: Annotated[
        str,
        typer.Option(
            "--cluster", "-c", help="Cluster profile under clusters/ (or a path).", autocompletion=complete.clusters
        ),
    ] = "local",
    tracking_uri: Annotated[
        str | None,
        typer.Option("--tracking-uri", help="MLflow store (default: $MLFLOW_TRACKING_URI, the profile's, ./mlflow.db)."),
    ] = None,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="The look as one JSON document on stdout (docs/JSON.md), with --submit the runs it submitted; "
            "its messages go to stderr.",
        ),
    ] = False,
) -> None:
    """Per comparison with the baseline: whether it is resolved, the seeds that would resolve it, their cost;
    --submit adds them (marked as added after this look; the report then uses a group-sequential interval)."""
    from pdmctl.extras import refusal
    from pdmctl.terminal import fail

    if (line := refusal("pdmctl seeds", "report", ("scipy",))) is not None:
        fail(line)  # before the report's statistics, which import it
    from pdmctl import added_seeds
    from pdmctl.ledger import check_owner, ledger_exists, open_ledger
    from pdmctl.orchestrate import make_context
    from pdmctl.report.cli import _choose_sweeps
    from pdmctl.report.collect import collect
    from pdmctl.report.definition import ReportError, load_definition
    from pdmctl.terminal import console, err, fail, guard

    out = err if as_json else console  # the document alone on stdout
    modelled: dict[Any, tuple[str, float]] = {}  # row -> the cost model's hours of one added run

    def done(submitted: dict | None = None) -> None:
        if as_json:
            from pdmctl.shell import print_document

            print_document(look_document(chosen[0], data, look, submitted, modelled, spec.confidence.level))

    with guard():
        if max_seeds < 2:
            fail(f"--max-seeds: must be at least 2, got {max_seeds}")
        if max_hours is not None and not (math.isfinite(max_hours) and max_hours > 0):
            fail(f"--max-hours: must be a positive number of hours, got {max_hours}")
        try:
            spec = load_definition(definition)
        except ReportError as exc:
            fail(str(exc))
        ctx = make_context(cluster, tracking_uri)
        check_owner(ctx.tracking_uri, sweep, write=submit)  # another login's sweep: refused
        if not ledger_exists(ctx.tracking_uri):
            fail(f"no ledger at {ctx.tracking_uri}: run a sweep first, or pass --tracking-uri")
        ledger = open_ledger(ctx.tracking_uri)
        added_seeds.complete(ledger, take_lock=True)  # the marks an interrupted --submit left undone, first
        chosen = _choose_sweeps([sweep] if sweep else [], ledger.sweeps(), ctx.tracking_uri)
        if isinstance(chosen, str):
            fail(chosen)
        data = collect(ledger, chosen, spec)
        look = propose(data, spec, max_seeds)
        if submit and look.unfinished:
            left = submit_left(data, look, ctx)
            if left:
                done({"look": look.look - 1, "runs": len(left), "run_ids": None})
                out.print(f"look {look.look - 1}: submitted {len(left)} run(s) of seeds added after that "
                              "look that an interrupted --submit had registered but not submitted; follow with "
                              f"pdmctl status {chosen[0]}", highlight=False, markup=False)  # fmt: skip
                return
        if look.waiting and not look.proposals and not look.unpaired:
            fail(f"sweep {chosen[0]}: nothing to look at yet: {look.unfinished} run(s) have not ended and no "
                 "setting has all its runs ended; look again when one has")  # fmt: skip
        for p in [] if as_json else look.proposals:
            where = f"{p.setting} {p.mask} vs {p.baseline} on {p.column}"
            state = "resolved" if p.resolved else (
                f"needs {p.needed} seeds (+{p.extra}) at stage {p.stages + 1}'s level"
                + (f" (a new sweep of fixed size: {p.fixed}, the report's power table)" if p.fixed is not None else "")
                if p.needed is not None else "out of reach (more than 1000 seeds)")
            report = (f"; the report's {p.report_interval} [{_fmt(p.report_low)}, {_fmt(p.report_high)}]"
                      if p.report_interval else "")  # fmt: skip
            console.print(f"{where}: {_fmt(p.difference)} pp (sd {p.spread:.1f}); {p.interval} "
                          f"[{_fmt(p.low)}, {_fmt(p.high)}]{report}: {state}", highlight=False, markup=False,
                          soft_wrap=True)  # fmt: skip
        if look.proposals and not as_json:
            console.print(two_intervals(look, spec.confidence.level), highlight=False, markup=False, soft_wrap=True)
        for where in [] if as_json else look.unpaired:
            console.print(f"{where}: unpaired (no seed in common), left as it is", highlight=False, markup=False)
        for where, n in [] if as_json else look.waiting:
            console.print(f"{where}: waiting: {n} run(s) of this setting not ended", highlight=False, markup=False)
        if not look.proposals:
            out.print("no paired comparison with the baseline among the finished runs", highlight=False)
        if not look.additions:
            done()
            out.print("nothing to add", highlight=False)
            return
        adds = ", ".join(f"{row.setting} {row.label} +{n}" for row, n in look.additions.items())
        modelled = model_hours(data, look, ctx)
        costs = run_costs(data, look, modelled)
        course, _ = course_text(look, expected_course(look, spec.confidence.level, max_seeds), costs)
        if not as_json:
            console.print(f"look {look.look} proposes: {adds}; {cost_text(data, look, modelled)}", highlight=False,
                          markup=False, soft_wrap=True)  # fmt: skip
            console.print(course, highlight=False, markup=False, soft_wrap=True)
        if max_hours is not None:
            now = sum(n * costs[row][1] for row, n in look.additions.items() if row in costs)
            over = any(row not in costs for row in look.additions) or now > max_hours
            if over and submit:
                fail(f"--max-hours {max_hours:g}: this look's runs cost {'an unknown number of' if any(row not in costs for row in look.additions) else f'about {hours_text(now)}'} "
                     "device-hours, over the cap; nothing submitted (lower --max-seeds, or raise the cap)")  # fmt: skip
        if not submit:
            done()
            out.print("add them with --submit", highlight=False)
            return
        specs = new_specs(data, look)
        run_ids = submit_marked(specs, ctx, look.look)
    done({"look": look.look, "runs": len(run_ids), "run_ids": run_ids})
    out.print(f"look {look.look}: submitted {len(run_ids)} run(s) of seeds added after this look; "
                  f"follow with pdmctl status {chosen[0]}", highlight=False, markup=False)  # fmt: skip


def look_document(sweep: str, data, look: Look, submitted: dict | None,
                  modelled: dict[Any, tuple[str, float]] | None = None, level: float = 0.95) -> dict[str, Any]:  # fmt: skip
    """`seeds --json`: each comparison's proposal, the seeds each row would get and their cost, and what
    --submit submitted (null without it). Differences in percentage points (docs/JSON.md)."""
    from pdmctl.shell import number

    proposals = [{"setting": p.setting, "mask": p.mask, "baseline": p.baseline, "column": p.column, "n": p.n,
                  "stage": p.stages, "difference_pp": number(p.difference), "spread_pp": number(p.spread),
                  "low_pp": number(p.low), "high_pp": number(p.high),
                  "interval": {"kind": "group-sequential", "level": level, "stage": p.stages,
                               "after_look": p.last_look or None, "label": p.interval},
                  "report_interval": None if not p.report_interval else {
                      "kind": "fixed", "label": p.report_interval, "low_pp": number(p.report_low),
                      "high_pp": number(p.report_high)},
                  "resolved": p.resolved,
                  "seeds_needed": p.needed, "extra": p.extra, "fixed_sweep_seeds": p.fixed} for p in look.proposals]  # fmt: skip
    additions = [{"setting": row.setting, "row": row.label, "has": len(look.seeds_of.get(row, [])), "add": n}
                 for row, n in look.additions.items()]  # fmt: skip
    return {"command": "seeds", "sweep": sweep, "look": look.look, "unfinished": look.unfinished,
            "comparisons": proposals, "unpaired": list(look.unpaired), "additions": additions,
            "cost": cost_text(data, look, modelled) if look.additions else None, "submitted": submitted,
            "waiting": [{"comparison": where, "runs_not_ended": n} for where, n in look.waiting]}  # fmt: skip


def submit_marked(specs: list, ctx, look: int) -> list[str]:
    """Register `specs`, mark the new runs as added after `look`, then submit them as a sweep submits (the
    mark is on each run before its job goes out). Registering and marking are one step as far as anyone can
    see: a journal written first names the runs (`added_seeds`), and whatever interrupts the two, the next
    `seeds`, `sweep` or `resume` marks them before it reads or submits anything. Returns the new runs' ids."""
    from pdmctl import added_seeds, orchestrate
    from pdmctl.ledger import open_ledger

    executor = orchestrate.check_before_submit(ctx)
    orchestrate.check_runs(specs, ctx, executor)
    orchestrate.check_installed(specs, ctx)  # before anything is written, as a sweep checks it
    ledger = open_ledger(ctx.tracking_uri)
    with ledger.lock():
        added_seeds.complete(ledger)
        before = {r.key for r in ledger.runs(specs[0].sweep)}
        keys = [s.key for s in specs if s.key not in before]
        added_seeds.write(ctx.tracking_uri, specs[0].sweep, look, keys)
        ids = ledger.register(specs, {s.key: str(ctx.run_dir_parent(s)) for s in specs})
        added_seeds.complete(ledger)  # marks them, then removes the journal
    orchestrate.sweep(specs, ctx, order="seed")
    return [ids[k] for k in keys]


def submit_left(data, look: Look, ctx) -> list[str]:
    """Submit what an interrupted `seeds --submit` registered and marked but never submitted: the runs a look
    added that have not ended go through `orchestrate.sweep` (one live job per run), the job ids (none when
    those runs are queued or running). Runs no look added (a setting still running) are left to `resume`."""
    from pdmctl import orchestrate
    from pdmctl.ledger import TERMINAL
    from pdmctl.report.sequential import run_look

    open_runs = [r for r in data.records.values() if r.status not in TERMINAL and run_look(r) and r.spec]
    if not open_runs:
        return []
    _, job_ids = orchestrate.sweep([r.spec for r in open_runs], ctx, order="seed")
    return job_ids
