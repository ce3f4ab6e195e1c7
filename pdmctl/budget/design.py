"""A design that fits: given a limit in days of the profile's slots or in device-hours, the largest part of the
sweep's grid that fits it, as a proposal beside the plan (the grid itself is never changed).

The designs tried keep the grid's arms and take, of its settings, the cheapest ones first (the order in which
`order.answers_first` runs them), and of its seeds the first n of every arm (n from the grid's count down to
2, the fewest a paired comparison can test). Each is costed as the dry run costs the sweep: the runs to submit,
at their expected times, placed in the "answers" order on the profile's slots (`cost.end_times`), its range
from the low and high times. The proposal is the design with the most settings, then the most seeds, whose
expected figure fits (at least 3 seeds an arm where such a design fits); each kept setting's comparisons are then said with the smallest paired difference (in
seed standard deviations) that n seeds detect with 80% power at α = 0.05 (`report.power.resolvable`, the
report's own paired t-test), and the settings left out are named. Steps are not shortened: a run cut short
answers another question than the one its grid asked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdmctl.budget.cost import Estimate, Span, end_times, number

MIN_SEEDS = 3  # the fewest seeds an arm a proposal keeps where it can: the seed counts people use are 3-5


@dataclass(frozen=True)
class Design:
    settings: tuple[str, ...]  # kept, in the order they run
    seeds: int  # per arm
    runs: int
    hours: Span  # device-hours, summed
    days: Span  # wall days on the slots
    unit: str


def candidates(specs: Sequence[Any], estimates: Mapping[str, Estimate | str], slots: int | None,
               nodes: Mapping[str, int], slot_nodes: int) -> list[Design]:
    """Every design of the cheapest-first settings prefixes x the first n seeds of every arm, costed."""
    from pdmctl.order import answers_first, replicates, setting_of

    seconds = {key: e.seconds.expected for key, e in estimates.items() if isinstance(e, Estimate)}
    ordered = answers_first(specs, seconds)
    replicate_of = replicates(ordered)
    settings = list(dict.fromkeys(setting_of(s) for s in ordered))
    most = max(replicate_of.values(), default=-1) + 1
    out = []
    for kept in range(len(settings), 0, -1):
        chosen = set(settings[:kept])
        for n in range(most, 1, -1):
            runs = [s for s in ordered if setting_of(s) in chosen and replicate_of[s.key] < n]
            found = [estimates.get(s.key) for s in runs]
            if not runs or not all(isinstance(e, Estimate) for e in found):
                continue
            used = [nodes[s.key] for s in runs]
            days = Span(*(max(end_times([getattr(e.seconds, b) for e in found], slots, used, slot_nodes)) / 86400
                          for b in ("expected", "low", "high")))  # fmt: skip
            hours = Span(sum(e.hours.expected for e in found), sum(e.hours.low for e in found),
                         sum(e.hours.high for e in found))  # fmt: skip
            unit = "/".join(sorted({e.unit for e in found}))
            out.append(Design(tuple(settings[:kept]), n, len(runs), hours, days, unit))
    return out


def propose(designs: Sequence[Design], days: float | None = None, hours: float | None = None) -> Design | None:
    """Of the designs whose expected days and hours fit the limits, the one with the most settings, then the
    most seeds, among those of at least MIN_SEEDS seeds an arm where any fits (two seeds detect only a
    difference of about 12 seed SDs), else among all."""
    fitting = [d for d in designs if (days is None or d.days.expected <= days)
               and (hours is None or d.hours.expected <= hours)]  # fmt: skip
    enough = [d for d in fitting if d.seeds >= min(MIN_SEEDS, max(x.seeds for x in designs))]
    return max(enough or fitting, key=lambda d: (len(d.settings), d.seeds, -d.hours.expected), default=None)


def design_lines(plan: Any, ctx: Any, executor: Any, days: float | None = None, hours: float | None = None,
                 calibration: Mapping[str, Any] | None = None) -> list[str]:
    """The dry run's lines for `--days` / `--budget`: the grid's own figure, the proposal, what it resolves
    and what it leaves out."""
    from pdmctl import extras
    from pdmctl.backends.registry import flat_config, get_backend
    from pdmctl.budget.costing import estimate_specs, slots
    from pdmctl.order import setting_of

    limit = " and ".join(([f"{number(days)} days"] if days is not None else [])
                         + ([f"{number(hours)} device-hours"] if hours is not None else []))  # fmt: skip
    submit = list(plan.to_submit)
    if not submit:
        return [f"design for {limit}: nothing to submit"]
    estimates = estimate_specs(submit, ctx, executor, calibration)
    missing = [s for s in submit if not isinstance(estimates.get(s.key), Estimate)]
    if missing:
        return [f"design for {limit}: not proposed: {missing[0].summary} has no cost estimate "
                f"({estimates.get(missing[0].key)})"]  # fmt: skip
    given = executor.nodes_per_job()
    nodes = {s.key: get_backend(s.backend).nodes(flat_config(s.config)) or given for s in submit}
    designs = candidates(submit, estimates, slots(ctx, executor), nodes, given)
    if not designs:  # a design compares the arms on 2 seeds or more
        return [f"design for {limit}: not proposed: the grid has one seed an arm, and a design compares each arm "
                "on 2 or more (seeds=2)"]  # fmt: skip
    whole = designs[0]  # every setting, every seed: the grid as given
    lines = [f"design for {limit}: the grid as given is {whole.runs} run(s), {_figure(whole)}"]
    best = propose(designs, days, hours)
    if best is None:
        cheapest = min(designs, key=lambda d: d.hours.expected)
        return [*lines, f"  nothing fits: the smallest design (its cheapest setting, 2 seeds an arm) takes "
                        f"{_figure(cheapest)}"]  # fmt: skip
    if best == whole:
        lines.append("  it fits as it is")
    else:
        lines.append(f"  proposed (the grid is not changed; give these seeds and settings to run it): "
                     f"{best.seeds} seed(s) an arm, {len(best.settings)} of {len(whole.settings)} setting(s), "
                     f"{best.runs} run(s), {_figure(best)}")  # fmt: skip
    arms = {name: len({s.summary.rsplit(' seed=', 1)[0] for s in submit if setting_of(s) == name})
            for name in best.settings}  # fmt: skip
    if extras.missing(("scipy",)):  # the power analysis is the [report] extra's; the design is not
        effect = "the difference it detects: pip install 'pdmctl[report]'"
    else:
        from pdmctl.report.power import resolvable

        effect = (f"a difference of {resolvable(best.seeds):.2f} seed SDs or more with 80% power (paired t-test, "
                  f"α = 0.05)")  # fmt: skip
    for name in best.settings:
        lines.append(f"  resolves: {name}: its {arms[name]} arm(s) compared pairwise on {best.seeds} seeds, "
                     f"{effect}")
    for name in whole.settings[len(best.settings):]:
        lines.append(f"  cannot resolve: {name}: left out (its runs do not fit)")
    return lines


def _figure(d: Design) -> str:
    return (f"{number(d.hours.expected)} {d.unit}-hours expected ({number(d.hours.low)}-{number(d.hours.high)}), "
            f"{d.days.expected:.1f} days of wall time expected ({d.days.low:.1f}-{d.days.high:.1f})")
