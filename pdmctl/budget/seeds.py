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
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Look:
    proposals: list[Proposal]
    additions: dict[Any, int]  # row key -> seeds to add (the most any of its comparisons needs, capped)
    seeds_of: dict[Any, list[int]]  # row key -> the seeds it has (finished or not)
    look: int  # the number of this look (1 + the looks already recorded on the sweep's runs)
    unfinished: int  # runs of the sweep that have not ended
    unpaired: list[str]  # comparisons without a seed in common (nothing to add to)


def propose(data, definition, max_seeds: int) -> Look:
    """Each paired comparison's proposal, from the report's own collection `data` of the sweep."""
    from pdmctl.ledger import TERMINAL
    from pdmctl.report import power
    from pdmctl.report.build import _run_values, comparisons, held_out_names
    from pdmctl.report.sequential import run_look, sequential_interval, stage_alpha

    labels = tuple(c.label for c in definition.columns) + ((definition.average,) if definition.average else ())
    alpha = 1 - definition.confidence.level
    proposals, additions, unpaired = [], defaultdict(int), []
    names = held_out_names(data, definition)
    for comparison in comparisons(data, definition, labels):
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
            diff = sum(d) / len(d)
            spread = float(_sd(d))
            resolved = interval is not None and (interval.low > 0 or interval.high < 0)
            needed = fixed = None
            if not resolved and spread > 0:
                needed = power.seeds_needed(abs(diff) / spread, paired=True, alpha=stage_alpha(stages + 1, alpha))
                fixed = power.seeds_needed(abs(diff) / spread, paired=True, alpha=alpha)
            extra = 0 if resolved or needed is None else max(1, needed - len(d))
            wanted = max(wanted, extra)
            proposals.append(Proposal(comparison.row.setting, comparison.row.label, comparison.baseline.label,
                                      names.get(label, label),
                                      len(d), stages, 100 * diff, 100 * spread,
                                      None if interval is None else 100 * interval.low,
                                      None if interval is None else 100 * interval.high, resolved, needed, extra,
                                      fixed))  # fmt: skip
        for row in (comparison.row, comparison.baseline):
            additions[row] = max(additions[row], wanted)
    seeds_of: dict[Any, set[int]] = defaultdict(set)
    keys, seed_of, _ = _row_keys(data)
    for run_id, row in keys.items():
        seeds_of[row].add(seed_of[run_id])
    for row in list(additions):
        additions[row] = max(0, min(additions[row], max_seeds - len(seeds_of[row])))
    looks = [run_look(r) for r in data.records.values()]
    unfinished = sum(1 for r in data.records.values() if r.status not in TERMINAL)
    return Look(proposals, {r: n for r, n in additions.items() if n}, {r: sorted(s) for r, s in seeds_of.items()},
                max(looks, default=0) + 1, unfinished, unpaired)  # fmt: skip


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


def cost_text(data, look: Look) -> str:
    """What the extra runs would cost: CPU-hours for the testbed (one core a run) from the rows' recorded
    durations; "unknown" where a backend's devices or a row's durations are not known here."""
    hours = row_hours(data)
    keys, _, _ = _row_keys(data)
    backend_of = {row: data.records[run_id].spec.backend for run_id, row in keys.items() if data.records[run_id].spec}
    total, unknown = 0.0, []
    for row, extra in look.additions.items():
        if backend_of.get(row) != "toy" or row not in hours:
            unknown.append(row.label)
            continue
        total += extra * hours[row]
    runs = sum(look.additions.values())
    if unknown:
        return f"{runs} run(s); cost unknown (no recorded testbed durations for {', '.join(sorted(set(unknown)))})"
    return f"{runs} run(s), about {total:.3g} CPU-hours (the rows' finished runs' recorded durations, one core a run)"


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
    from pdmctl import added_seeds
    from pdmctl.ledger import check_owner, ledger_exists, open_ledger
    from pdmctl.orchestrate import make_context
    from pdmctl.report.cli import _choose_sweeps
    from pdmctl.report.collect import collect
    from pdmctl.report.definition import ReportError, load_definition
    from pdmctl.terminal import console, err, fail, guard

    out = err if as_json else console  # the document alone on stdout

    def done(submitted: dict | None = None) -> None:
        if as_json:
            from pdmctl.shell import print_document

            print_document(look_document(chosen[0], data, look, submitted))

    with guard():
        if max_seeds < 2:
            fail(f"--max-seeds: must be at least 2, got {max_seeds}")
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
            fail(f"sweep {chosen[0]}: {look.unfinished} run(s) have not ended; look again when they have")
        for p in [] if as_json else look.proposals:
            where = f"{p.setting} {p.mask} vs {p.baseline} on {p.column}"
            state = "resolved" if p.resolved else (
                f"needs {p.needed} seeds (+{p.extra}) at stage {p.stages + 1}'s level"
                + (f" (a new sweep of fixed size: {p.fixed}, the report's power table)" if p.fixed is not None else "")
                if p.needed is not None else "out of reach (more than 1000 seeds)")
            console.print(f"{where}: {_fmt(p.difference)} pp (sd {p.spread:.1f}) over {p.n} seeds, stage {p.stages}, "
                          f"interval [{_fmt(p.low)}, {_fmt(p.high)}]: {state}", highlight=False, markup=False,
                          soft_wrap=True)  # fmt: skip
        for where in [] if as_json else look.unpaired:
            console.print(f"{where}: unpaired (no seed in common), left as it is", highlight=False, markup=False)
        if not look.proposals:
            out.print("no paired comparison with the baseline among the finished runs", highlight=False)
        if not look.additions:
            done()
            out.print("nothing to add", highlight=False)
            return
        adds = ", ".join(f"{row.setting} {row.label} +{n}" for row, n in look.additions.items())
        if not as_json:
            console.print(f"look {look.look} proposes: {adds}; {cost_text(data, look)}", highlight=False,
                          markup=False, soft_wrap=True)  # fmt: skip
        if not submit:
            done()
            out.print("add them with --submit", highlight=False)
            return
        specs = new_specs(data, look)
        run_ids = submit_marked(specs, ctx, look.look)
    done({"look": look.look, "runs": len(run_ids), "run_ids": run_ids})
    out.print(f"look {look.look}: submitted {len(run_ids)} run(s) of seeds added after this look; "
                  f"follow with pdmctl status {chosen[0]}", highlight=False, markup=False)  # fmt: skip


def look_document(sweep: str, data, look: Look, submitted: dict | None) -> dict[str, Any]:
    """`seeds --json`: each comparison's proposal, the seeds each row would get and their cost, and what
    --submit submitted (null without it). Differences in percentage points (docs/JSON.md)."""
    from pdmctl.shell import number

    proposals = [{"setting": p.setting, "mask": p.mask, "baseline": p.baseline, "column": p.column, "n": p.n,
                  "stage": p.stages, "difference_pp": number(p.difference), "spread_pp": number(p.spread),
                  "low_pp": number(p.low), "high_pp": number(p.high), "resolved": p.resolved,
                  "seeds_needed": p.needed, "extra": p.extra, "fixed_sweep_seeds": p.fixed} for p in look.proposals]  # fmt: skip
    additions = [{"setting": row.setting, "row": row.label, "has": len(look.seeds_of.get(row, [])), "add": n}
                 for row, n in look.additions.items()]  # fmt: skip
    return {"command": "seeds", "sweep": sweep, "look": look.look, "unfinished": look.unfinished,
            "comparisons": proposals, "unpaired": list(look.unpaired), "additions": additions,
            "cost": cost_text(data, look) if look.additions else None, "submitted": submitted}  # fmt: skip


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
    """Submit what an interrupted `seeds --submit` registered and marked but never submitted, when every run
    of the sweep that has not ended is one the last look added: the job ids (none when those runs are
    queued or running, or other runs have not ended)."""
    from pdmctl import orchestrate
    from pdmctl.ledger import TERMINAL
    from pdmctl.report.sequential import run_look

    last = look.look - 1  # the last look that added seeds (0: none did)
    open_runs = [r for r in data.records.values() if r.status not in TERMINAL]
    if last < 1 or not open_runs or any(run_look(r) != last or r.spec is None for r in open_runs):
        return []
    _, job_ids = orchestrate.sweep([r.spec for r in open_runs], ctx, order="seed")
    return job_ids
