"""The report's tables as plain text grids, and their renderings: rich, Markdown, LaTeX (booktabs), HTML, CSV."""

from __future__ import annotations

import csv
import dataclasses
import html
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass

from pdmctl.report.build import PROVENANCE_FIELDS, family_sizes, pooling_notes
from pdmctl.report.collect import RowKey
from pdmctl.report.intervals import (
    SEQUENTIAL,
    UNPAIRED,
    comparison_interval,
    describe,
    describe_unpaired,
    sequential_label,
    short_name,
)
from pdmctl.report.model import ProvenanceRow, Report
from pdmctl.report.stats import Comparison, Estimate, format_p, pct, signed_pct

TWO_LEVEL_MARK = "‡"
STOPPED_MARK = "†"  # a row with a run its declared collapse rule stopped, counted at its last evaluation


@dataclass(frozen=True)
class TextTable:
    key: str  # html id and file stem: results, comparison, excluded, direction
    title: str
    headers: tuple[str, ...]
    rows: list[tuple[str, ...]]
    note: str
    numeric_from: int  # columns from here on are right-aligned
    # a header row above `headers`: (text, columns it spans), the spans adding up to the number of columns
    groups: tuple[tuple[str, int], ...] = ()
    metric: str = ""  # what a `mean` column holds (avg@16): an interval column's header names it

    @property
    def keys(self) -> int:
        """The first columns, naming the row: repeated in every part of a table split to fit a terminal, and
        kept on one line on the page."""
        if self.numeric_from < len(self.headers):
            return self.numeric_from
        return min(2, len(self.headers) - 1)  # setting, mask

    def flat_headers(self) -> tuple[str, ...]:
        """One header per column, a group's name before its columns' (Markdown, the terminal, CSV-like)."""
        if not self.groups:
            return self.headers
        prefixes = [name for name, span in self.groups for _ in range(span)]
        return tuple(f"{p} {h}".strip() if p else h for p, h in zip(prefixes, self.headers, strict=True))


def _row_cells(row: RowKey, dims: Sequence[str], previous: RowKey | None) -> tuple[str, ...]:
    setting = "" if previous is not None and previous.setting == row.setting else row.setting
    return (setting, row.mask, *(row.dim(d) for d in dims))


def _repeat_blank(row: RowKey, dims: Sequence[str], previous: RowKey | None) -> tuple[str, ...]:
    """The row's key cells, blank where the line above is the same row (long tables: a line per column)."""
    if previous == row:
        return ("",) * (2 + len(dims))
    return _row_cells(row, dims, previous)


def estimate_cells(e: Estimate, signed: bool = False) -> tuple[str, str, str]:
    """Mean, low, high in % (points): three cells; n/a where there is no value or no interval."""
    fmt = signed_pct if signed else pct
    if e.n == 0:
        return ("n/a", "", "")
    if e.interval is None:
        return (fmt(e.mean), "n/a", "n/a")
    return (fmt(e.mean), fmt(e.interval.low), fmt(e.interval.high))


def results_note(report: Report) -> str:
    d = report.definition
    parts = [f"avg@16 in %, mean over seeds {d.at.describe()}, with the interval's low and high ends "
             "(Methods). n/a: fewer than 2 seeds, no interval. n: seeds that count; runs left out are listed "
             "separately."]  # fmt: skip
    if d.average:
        columns = " and ".join(report.name(col.label) for col in d.columns)
        parts.append(f"{d.average}: each seed's mean of {columns}, then the same interval.")
    if report.two_level:
        parts.append(f"{TWO_LEVEL_MARK}: the two-level bootstrap over seeds and problems (Methods); cells without "
                     f"{TWO_LEVEL_MARK} lack per-problem scores.")  # fmt: skip
    stopped = [f"{r.row.label} {mark}" for r in report.rows for mark in r.stopped]
    if stopped:
        parts.append(f"{STOPPED_MARK}: n counts runs the declared collapse rule stopped, each at its last "
                     f"evaluation (Methods): {'; '.join(stopped)}.")  # fmt: skip
    return " ".join(parts)


def results_table(report: Report) -> TextTable:
    rows, previous = [], None
    for r in report.rows:
        cells = []
        for label in report.labels:
            mean_, low, high = estimate_cells(r.cells[label])
            cells += [mean_ + (TWO_LEVEL_MARK if r.two_level.get(label) else ""), low, high]
        n = str(len(r.seeds)) + (STOPPED_MARK if r.stopped else "")
        rows.append((*_row_cells(r.row, report.dims, previous), *cells, n))
        previous = r.row
    keys = 2 + len(report.dims)
    headers = ("setting", "mask", *report.dims, *(("mean", "low", "high") * len(report.labels)), "n")
    groups = (("", keys), *((report.name(label), 3) for label in report.labels), ("", 1))
    title = f"avg@16 ({', '.join(report.sweeps)}), {short_name(report.definition.confidence)} intervals"
    return TextTable("results", title, headers, rows, results_note(report), keys, groups, "avg@16")


def comparison_note(report: Report) -> str:
    d = report.definition
    if not report.baseline_present:
        return f"The baseline mask {d.baseline} has no runs in {', '.join(report.sweeps)}: nothing to compare with."
    return (
        f"One line per row and column: the mask minus {d.baseline} (the row's own setting, and its δ, K "
        "wherever the baseline has them), in percentage points, with the interval's low and high ends; P, the "
        "probability of improvement; p, the t-test's; Holm, p adjusted (Methods). Paired rows list their "
        f"matched seeds. n/a: fewer than 2 (matched) seeds. {holm_note(report)}"
    )


def holm_note(report: Report) -> str:
    """Names the family Holm's procedure adjusts over."""
    sizes = family_sizes(report.comparisons, report.labels)
    counts = set(sizes.values())
    family = (f"the {counts.pop()} comparisons of each column" if len(counts) == 1
              else "each column's comparisons (" + ", ".join(f"{report.name(label)}: {m}" for label, m in sizes.items()) + ")")  # fmt: skip
    return (
        f"Holm's step-down procedure over {family}, every row against the baseline; a column's differences "
        "with Holm ≤ 0.05 are significant at 5% together (family-wise error rate ≤ 5%), a raw p ≤ 0.05 alone "
        "is not. A claim across columns makes a larger family."
    )


def _pairing(comp) -> str:
    first = next(iter(comp.cells.values()))
    return (f"paired {','.join(map(str, comp.seeds))}" if comp.seeds
            else f"unpaired {first.difference.n} vs {first.n_baseline}")  # fmt: skip


def comparison_table(report: Report) -> TextTable:
    rows, previous = [], None
    for comp in report.comparisons:
        for i, label in enumerate(report.labels):
            c = comp.cells[label]
            p = "n/a" if math.isnan(c.probability_of_improvement) else f"{c.probability_of_improvement:.2f}"
            rows.append((*_repeat_blank(comp.row, report.dims, previous),
                         comp.baseline.label if i == 0 else "", report.name(label),
                         *estimate_cells(c.difference, signed=True), p, format_p(c.p_value), format_p(c.p_holm),
                         _pairing(comp) if i == 0 else ""))  # fmt: skip
            previous = comp.row
    headers = ("setting", "mask", *report.dims, "baseline", "set", "Δ (pp)", "low", "high", "P", "p", "Holm",
               "seeds")  # fmt: skip
    return TextTable("comparison", comparison_title(report), headers, rows,
                     f"{comparison_note(report)} {interval_note(report)}".strip(), 4 + len(report.dims))  # fmt: skip


def comparison_title(report: Report) -> str:
    """`vs B, 95% t intervals over the matched seeds (fixed size)`, or group-sequential where seeds were added
    after looking (the stages' intersection: Methods); the unpaired comparisons' interval after it."""
    conf = report.definition.confidence
    kinds = [comparison_interval(comp, conf) for comp in report.comparisons]
    looks = [k["after_look"] for k in kinds if k["kind"] == SEQUENTIAL and k["after_look"]]
    if any(k["kind"] == SEQUENTIAL for k in kinds):
        title = (f"vs {report.definition.baseline}, {100 * conf.level:g}% group-sequential t intervals (seeds added "
                 f"after look {max(looks, default=0)}, the intervals pdmctl seeds gives)")  # fmt: skip
    else:
        title = f"vs {report.definition.baseline}, {short_name(conf)} intervals over the matched seeds (fixed size)"
    if any(k["kind"] == UNPAIRED for k in kinds):
        title += f"; unpaired: {describe_unpaired(conf)}"
    return title


def interval_note(report: Report) -> str:
    """Which interval each comparison's differences carry, grouped: one sentence where all carry the same."""
    conf = report.definition.confidence
    groups: dict[str, list[str]] = {}
    for comp in report.comparisons:
        k = comparison_interval(comp, conf)
        if k["kind"] == SEQUENTIAL:
            said = sequential_label(conf.level, 0, k["stage"], k["after_look"] or 0).replace(" over 0 seeds", "")
        elif k["kind"] == UNPAIRED:
            said = f"{describe_unpaired(conf)} (unpaired)"
        else:
            said = f"{short_name(conf)} interval over the matched seeds (fixed size: no seeds added after looking)"
        groups.setdefault(said, []).append(f"{comp.row.setting} {comp.row.label}")
    if not groups:
        return ""
    if len(groups) == 1:
        return f"Interval of every difference: the {next(iter(groups))}."
    return "Intervals: " + "; ".join(f"the {said} for {', '.join(rows)}" for said, rows in groups.items()) + "."


def _needed_cells(c: Comparison) -> tuple[str, str]:
    """(seeds needed, smallest resolvable |Δ| in pp)."""
    if not math.isfinite(c.spread):
        return ("n/a", "n/a")
    if c.spread == 0:
        return ("n/a: the seeds do not vary", "n/a")
    if c.seeds_needed is None:
        needed = "none (Δ = 0)" if c.difference.mean == 0 else "> 1000"
    else:
        needed = str(c.seeds_needed)
    return (needed, pct(c.resolvable))


def power_note(report: Report) -> str:
    return ("Seeds needed for 80% power at 5% at the observed difference and spread, and the smallest |Δ| the "
            "present seeds resolve (Methods). With few seeds the spread is itself uncertain: a guide to the next "
            "sweep's size, not a promise. Seeds added to this sweep after looking (`pdmctl seeds`) need more: "
            "each later look tests at a smaller share of the 5%. n/a: fewer than 2 seeds.")  # fmt: skip


def power_table(report: Report) -> TextTable:
    rows, previous = [], None
    for comp in report.comparisons:
        for i, label in enumerate(report.labels):
            c = comp.cells[label]
            rows.append((*_repeat_blank(comp.row, report.dims, previous), comp.baseline.label if i == 0 else "",
                         report.name(label), *_needed_cells(c), str(c.difference.n)))  # fmt: skip
            previous = comp.row
    headers = ("setting", "mask", *report.dims, "baseline", "set", "seeds needed", "resolves |Δ| ≥ (pp)", "has")
    return TextTable("power", f"Seeds for 80% power at 5% against {report.definition.baseline}", headers, rows,
                     power_note(report), 4 + len(report.dims))  # fmt: skip


def methods(report: Report) -> list[str]:
    """The page's Methods block: each interval, test and bound stated once (the tables' notes refer here)."""
    d, c = report.definition, report.definition.confidence
    out = [f"Values: avg@16 in %, read {d.at.describe()}; each row pools the seeds of one mask, setting, δ and "
           f"K. Interval of a mean: the {describe(c)}."]  # fmt: skip
    out.append(f"Differences against {d.baseline}, in percentage points: paired on matched seeds, the mean of "
               f"the per-seed differences with the same interval taken over the differences; unpaired (no seed "
               f"in common), the {describe_unpaired(c)}. P, the probability of improvement, is an estimate, not "
               "an interval: the share of matched seeds on which the mask scores higher (paired), or of all "
               "pairs of runs (unpaired), a tie counting half; with n seeds it moves in steps of 1/(2n). "
               "p: two-sided t-test of no difference (paired: one-sample t on the per-seed differences; "
               "unpaired: Welch's), whatever the interval. Holm: p adjusted by Holm's step-down procedure over "
               "each column's comparisons.")  # fmt: skip
    if report.comparisons:
        out.append("Seeds for 80% power: the fewest seeds (pairs of matched seeds; per mask where unpaired) at "
                   "which the two-sided t-test at 5% detects the observed difference with 80% power, taking the "
                   "seeds' observed standard deviation for the true one (exact power under a noncentral t, "
                   "scipy.stats.nct); resolves: the smallest |difference| the present seeds detect so.")  # fmt: skip
    if report.sequential:
        counts = sorted(set(report.sequential.values()))
        out.append(f"Seeds added sequentially: seeds were added after looking at the results (pdmctl seeds; each "
                   f"added run records the look as its provenance field look), so the paired differences are "
                   f"read under that design ({', '.join(map(str, counts))} stage(s) per comparison): stage j, the "
                   f"seeds up to its addition, gets the t interval at level 1 − α/2^j, the interval shown is the "
                   f"intersection of the stages' and p is min_j 2^j · p_j, which keeps coverage {100 * report.definition.confidence.level:g}% "
                   "whatever rule chose the seeds (group-sequential Bonferroni: Jennison & Turnbull, Group "
                   "Sequential Methods with Applications to Clinical Trials, 2000, §2; Lan & DeMets, Biometrika "
                   "70, 1983). pdmctl seeds prints this same interval; a plain t interval over the same seeds "
                   "would be narrower and cover less than its level under this design. Seeds for 80% power are the "
                   "fixed-design figures (a new sweep of fixed size); pdmctl seeds' counts are larger, each later "
                   "stage testing at a smaller share of α.")  # fmt: skip
    if report.two_level:
        out.append(f"{TWO_LEVEL_MARK}: two-level percentile bootstrap — seeds with replacement, then problems with "
                   f"replacement within each drawn seed ({c.resamples} resamples, seed {c.seed}).")  # fmt: skip
    clipped = (f" {report.clipped} interval(s) of the tables reached past that range and are shown clipped."
               if report.clipped else "")  # fmt: skip
    out.append("Bounds: avg@16, pass@k and maj@k lie in [0, 100] % and a difference of two in [−100, 100] pp; "
               "a t interval over few seeds can reach past them, so every interval and every band of a "
               "fraction is clipped to its range (bands of the training dynamics and the mismatch at 0 "
               f"where their values are never negative).{clipped}")  # fmt: skip
    out.append(f"Curves: the line is the mean over seeds at each step and the band the "
               f"{short_name(c.for_bands)} interval at that step (resamples {c.for_bands.resamples} where a "
               "bootstrap); no band with one seed." if c.method != "t" else
               "Curves: the line is the mean over seeds at each step and the band the same t interval at that "
               "step; no band with one seed.")  # fmt: skip
    if report.collapse_rules:
        stopped = sum(len(r.stopped) for r in report.rows)
        out.append(f"Collapse rule: declared in the run config before the sweep ({'; '.join(report.collapse_rules)}, "
                   f"stop.collapse), never a comparison between runs; it stopped {stopped} run(s), each counted "
                   f"in its row at its last evaluation ({STOPPED_MARK}); the curves draw the runs that trained to "
                   "their end.")  # fmt: skip
    if report.names:
        sets = ", ".join(report.name(label) for label in report.names)
        out.append(f"Held-out sets: each column is named by the set its runs evaluated on, as they logged it "
                   f"(eval/NAME): {sets}.")  # fmt: skip
    if report.constant_panels:
        flat = ", ".join(f"{label} ({value:.3g} throughout)" for label, value in report.constant_panels.items())
        out.append(f"Panels left out: {flat}; every run stayed within 1% of that value at every step, bands "
                   "included.")  # fmt: skip
    return out


def pass_k_label(report: Report) -> str:
    return report.definition.average or report.definition.columns[0].label


def pass_k_note(report: Report) -> str:
    return (
        f"{report.name(pass_k_label(report))}, in %: the mean over problems of each problem's unbiased estimate "
        "from its n samples at the evaluation the results table reads, then the mean over seeds with its "
        "interval (Methods). pass@k: 1 − C(n − c, k) / C(n, k) for c correct of n (Chen et al. 2021; "
        "scipy.stats.hypergeom): the chance that k of the n samples, drawn without replacement, hold a correct "
        "one. maj@k: the same expectation of a majority vote of k samples on their answers (samples without an "
        "answer do not vote): 1 if the correct answer has the most votes alone, 1/t if it ties with t − 1 other "
        "answers, else 0. pass@1 = maj@1 = avg@n. Per column in passk.csv; rows whose runs stored no "
        "per-sample correctness are left out."
    )


def pass_k_table(report: Report) -> TextTable:
    label = pass_k_label(report)
    rows, previous = [], None
    for r in report.pass_k:
        for k in r.ks:
            cells = [cell for kind in ("pass", "maj")
                     for cell in (estimate_cells(r.cells[label, kind, k]) if (label, kind, k) in r.cells
                                  else ("", "", ""))]  # fmt: skip
            rows.append((*_repeat_blank(r.row, report.dims, previous), str(k), *cells, str(r.samples),
                         str(len(r.seeds))))  # fmt: skip
            previous = r.row
    keys = 3 + len(report.dims)
    headers = ("setting", "mask", *report.dims, "k", *(("mean", "low", "high") * 2), "n", "seeds")
    groups = (("", keys), ("pass@k", 3), ("maj@k", 3), ("", 2))
    title = f"pass@k and maj@k ({report.name(label)}), {short_name(report.definition.confidence)} intervals"
    return TextTable("passk", title, headers, rows, pass_k_note(report), keys - 1, groups)


_PROVENANCE_HEADERS = {"commit": "commit", "dirty": "dirty", "version.pdmctl": "pdmctl", "version.verl": "VeRL",
                       "version.vllm": "vLLM", "version.torch": "torch", "data": "data",
                       "eval_sampling": "eval sampling"}  # fmt: skip


def _short(field: str, value: str) -> str:
    return value[:10] if field == "commit" and len(value) == 40 else value


def provenance_table(report: Report) -> TextTable:
    rows, previous = [], None
    for p in report.provenance:
        cells = [", ".join(_short(f, v) for v in p.values[f]) + (" (!)" if f in p.mixed else "")
                 for f in PROVENANCE_FIELDS]  # fmt: skip
        rows.append((*_row_cells(p.row, report.dims, previous), *cells, str(p.runs), str(p.attempts),
                     " ".join(p.job_ids)))  # fmt: skip
        previous = p.row
    headers = ("setting", "mask", *report.dims, *(_PROVENANCE_HEADERS[f] for f in PROVENANCE_FIELDS), "runs",
               "attempts", "job ids")  # fmt: skip
    notes = pooling_notes(report)
    note = ("Where each row's numbers come from, as each attempt of its runs recorded it (pdmctl.provenance): the "
            "code's commit and whether its tracked files differed from it (dirty), the versions the job imported, "
            "the digest of the data it evaluated on, the evaluation's sampling; attempts counts every attempt of "
            "the row's runs (requeues and resumes add one each), with their job ids. A field with several values "
            "lists them all. (!): the row pools runs that differ there. "
            + (" ".join(n + "." for n in notes) if notes else "Every row's runs agree on code, versions and data."))  # fmt: skip
    return TextTable("provenance", "Provenance", headers, rows, note, len(headers))


def cost_table(report: Report) -> TextTable:
    """Per sweep and setting, the hours its started runs spent beside the prediction (pdmctl.budget.spent)."""
    from pdmctl.budget.cost import RESTS_ON
    from pdmctl.budget.spent import COLUMNS, left_text, table_rows

    costs = [c for c in report.cost if not isinstance(c, str)]
    rows = [(c.sweep, *cells[:1], c.unit, *cells[1:]) for c in costs for cells in table_rows(c)]
    sources = "; ".join(f"{c.sweep}: {c.source}" for c in costs)
    running = "".join(f" Sweep {c.sweep} still runs: {left_text(c.left, c.slots)}." for c in costs if c.left is not None)
    note = ("Hours spent by each setting's runs that started (" + sources + ") beside pdmctl.budget.cost's prediction "
            "for the same runs and for all of them: expected (low-high; the high end takes every stated assumption at "
            "its dear end, the testbed's a loaded machine's rate), and at cap: every VeRL response at its length "
            "cap. Neither is a bound: queue waits and a slower machine are not in them." + running
            + " The prediction rests on " + RESTS_ON + "." + "".join(f" {c}." for c in report.cost if isinstance(c, str)))  # fmt: skip
    headers = ("sweep", COLUMNS[0], "unit", *COLUMNS[1:])
    return TextTable("cost", "Cost: hours spent and predicted", headers, rows, note, 3)


def excluded_table(report: Report) -> TextTable:
    rows = []
    for e in sorted(
        report.excluded, key=lambda e: (e.row or RowKey("", ""), e.seed if e.seed is not None else -1)
    ):
        row = e.row or RowKey("?", "?", tuple((d, "") for d in report.dims))
        rows.append((row.setting, row.mask, *(row.dim(d) for d in report.dims),
                     "" if e.seed is None else str(e.seed), e.status.lower(), e.reason, (e.run_id or "")[:12]))  # fmt: skip
    note = ("Runs (and seeds) left out of every average above: not finished, partial, missing a metric, "
            "a non-finite value, or never registered." if rows else "Every run of the sweeps counts.")  # fmt: skip
    headers = ("setting", "mask", *report.dims, "seed", "status", "reason", "run")
    return TextTable("excluded", "Left out", headers, rows, note, len(headers))


def direction_table(analysis: dict) -> TextTable:
    """The direction analysis, through the toy backend's own row builder (imports torch: only when asked)."""
    from pdmctl.analysis.results import AnalysisResult
    from pdmctl.analysis.tables import ANALYSIS_COLUMNS, analysis_rows

    result = AnalysisResult.from_dict(analysis)
    n = max(len(result.seeds), 1)
    note = (f"{len(result.seeds)} seeds, {result.divergence} δ={result.delta} K={result.k} {result.precision}; "
            f"{sum(result.out_of_region_per_seed) / n:.0f} of {sum(result.tokens_per_seed) / n:.0f} response tokens "
            "per seed outside the region. Unsafe keep: a kept disagreement token whose divergence grew (ΔD > 0) "
            "after the criterion's update; mean ± s.e. over seeds.")  # fmt: skip
    return TextTable(
        "direction", "Direction analysis", tuple(ANALYSIS_COLUMNS), analysis_rows(result), note, 2
    )


# ---------------------------------------------------------------------------
# Renderings
# ---------------------------------------------------------------------------


def to_rich(table: TextTable):
    """The table at the console's width: split into stacked tables, each repeating the row's key columns,
    where its columns do not all fit (pdmctl.report.fit); never a column cropped."""
    from pdmctl.report.fit import FittedTable

    return FittedTable(table.title, table.flat_headers(), table.rows, table.note, table.numeric_from, table.keys,
                       table.groups)  # fmt: skip


def to_markdown(table: TextTable) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = [f"### {table.title}", "", "| " + " | ".join(map(cell, table.flat_headers())) + " |",
             "|" + "|".join("---:" if i >= table.numeric_from else "---" for i in range(len(table.headers))) + "|"]  # fmt: skip
    lines += ["| " + " | ".join(map(cell, row)) + " |" for row in table.rows]
    return "\n".join([*lines, "", f"*{table.note}*", ""])


_TEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{",
        "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "δ": r"$\delta$", "Δ": r"$\Delta$",
        "·": r"$\cdot$", "—": "--", "−": "-", "±": r"$\pm$", "‡": r"$^\ddagger$", "≤": r"$\le$", "≥": r"$\ge$",
        ">": r"$>$", "|": r"$|$"}  # fmt: skip


def tex(text: str) -> str:
    return "".join(_TEX.get(ch, ch) for ch in text)


def _tex_groups(table: TextTable) -> list[str]:
    """The group header row (\\multicolumn) and a \\cmidrule under each named group."""
    if not table.groups:
        return []
    cells, rules, first = [], [], 1
    for name, span in table.groups:
        cells.append(rf"\multicolumn{{{span}}}{{c}}{{{tex(name)}}}" if span > 1 else tex(name))
        if name:
            rules.append(rf"\cmidrule(lr){{{first}-{first + span - 1}}}")
        first += span
    return [" & ".join(cells) + r" \\", " ".join(rules)]


def _interval_cell(value: str, low: str, high: str) -> str:
    if not low and not high:
        return value
    return f"{value} [{low}]" if low == high == "n/a" else f"{value} [{low}, {high}]"


def with_intervals(table: TextTable, interval: str) -> TextTable:
    """The table with each value and its interval's low and high ends in one column, `35.0 [22.6, 47.4]`,
    headed by its set and `[interval]` (`toy24 avg@16 [95% CI]`): one column per set, as a paper prints it."""
    heads = table.headers
    starts = {i for i in range(table.numeric_from, len(heads) - 2) if heads[i + 1 : i + 3] == ("low", "high")}
    spans, first = [], 0  # each group's name, first column and span
    for name, span in table.groups:
        spans.append((name, first, span))
        first += span
    headers, columns, absorbed = [], [], set()
    i = 0
    while i < len(heads):
        if i not in starts:
            headers.append(heads[i])
            columns.append((i,))
            i += 1
            continue
        group = next((name for name, first, span in spans if name and first == i and span == 3), "")
        absorbed |= {group} if group else set()
        label = table.metric if heads[i] == "mean" else heads[i]
        headers.append(" ".join(part for part in (group, label, f"[{interval}]") if part))
        columns.append((i, i + 1, i + 2))
        i += 3
    rows = [tuple(row[c[0]] if len(c) == 1 else _interval_cell(*(row[j] for j in c)) for c in columns)
            for row in table.rows]  # fmt: skip
    groups = tuple((name if name not in absorbed else "", sum(first <= c[0] < first + span for c in columns))
                   for name, first, span in spans)  # fmt: skip
    note = table.note + (" Brackets: the interval's low and high ends." if starts else "")
    return dataclasses.replace(table, headers=tuple(headers), rows=rows, note=note,
                               groups=groups if any(name for name, _ in groups) else ())  # fmt: skip


def to_latex(table: TextTable, interval: str | None = None) -> str:
    """A booktabs table; with `interval` (`95% CI`), each value and its interval's ends in one column."""
    if interval is not None:
        table = with_intervals(table, interval)
    spec = "".join("r" if i >= table.numeric_from else "l" for i in range(len(table.headers)))
    body = [" & ".join(tex(c) for c in row) + r" \\" for row in table.rows]
    return "\n".join([
        r"\begin{table}[t]", r"\centering", rf"\caption{{{tex(table.title)}}}", rf"\label{{tab:{table.key}}}",
        r"\small", rf"\begin{{tabular}}{{{spec}}}", r"\toprule", *_tex_groups(table),
        " & ".join(tex(h) for h in table.headers) + r" \\", r"\midrule", *body, r"\bottomrule", r"\end{tabular}",
        rf"\par\smallskip\parbox{{\linewidth}}{{\footnotesize {tex(table.note)}}}", r"\end{table}", "",
    ])  # fmt: skip


def to_html(table: TextTable) -> str:
    """The table alone (the page's template places it) in a box of its own that scrolls sideways where the
    table is wider than the page: a group header row where the table has one; numbers and the row's key
    cells on one line each."""
    from markupsafe import Markup

    kinds = [" class=num" if i >= table.numeric_from else " class=key" if i < table.keys else ""
             for i in range(len(table.headers))]  # fmt: skip

    def cells(row: Sequence[str], tag: str) -> str:
        return "".join(f"<{tag}{kind}>{html.escape(c)}</{tag}>" for kind, c in zip(kinds, row, strict=True))

    head = "".join(f'<th colspan="{span}" class="group">{html.escape(name)}</th>' if span > 1
                   else f'<th class="group">{html.escape(name)}</th>' for name, span in table.groups)  # fmt: skip
    heads = (f"<tr>{head}</tr>" if head else "") + f"<tr>{cells(table.headers, 'th')}</tr>"
    rows = "\n".join(f"<tr>{cells(r, 'td')}</tr>" for r in table.rows)
    return Markup(f'<div class="scroll"><table id="{table.key}"><caption>{html.escape(table.title)}</caption>\n'
                  f"<thead>{heads}</thead>\n<tbody>\n{rows}\n</tbody></table></div>\n"
                  f'<p class="note">{html.escape(table.note)}</p>')  # fmt: skip


# ---------------------------------------------------------------------------
# CSV: numbers, not text (percentages, empty where there is none)
# ---------------------------------------------------------------------------


def _num(value: float | None) -> str:
    return "" if value is None or not math.isfinite(value) else f"{100 * value:.4f}"


def _estimate_fields(e: Estimate) -> list[str]:
    iv = e.interval
    return [_num(e.mean), _num(iv.low if iv else None), _num(iv.high if iv else None)]


def results_csv(report: Report) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["setting", "mask", *report.dims,
                     *(f"{report.name(label)} {part} (%)" for label in report.labels for part in ("mean", "low", "high")),
                     "n", "seeds", "interval", *(_PROVENANCE_HEADERS[f] for f in PROVENANCE_FIELDS), "attempts",
                     "job ids", "pools"])  # fmt: skip
    c = report.definition.confidence
    provenance = {p.row: p for p in report.provenance}
    for r in report.rows:
        method = f"{short_name(c)} over seeds" + (
            "; two-level percentile bootstrap over seeds and problems where per-problem scores exist"
            if any(r.two_level.values())
            else ""
        )
        writer.writerow([r.row.setting, r.row.mask, *(r.row.dim(d) for d in report.dims),
                         *(f for label in report.labels for f in _estimate_fields(r.cells[label])),
                         len(r.seeds), " ".join(map(str, r.seeds)), method, *_provenance_fields(provenance.get(r.row))])  # fmt: skip
    return buf.getvalue()


def _provenance_fields(p: ProvenanceRow | None) -> list[str]:
    if p is None:
        return [""] * (len(PROVENANCE_FIELDS) + 3)
    return [*(" ".join(p.values[f]) for f in PROVENANCE_FIELDS), str(p.attempts), " ".join(p.job_ids),
            " ".join(f.removeprefix("version.") for f in p.mixed)]  # fmt: skip


def pass_k_csv(report: Report) -> str:
    """Every row, column, metric and k: mean, interval, samples per problem, seeds."""
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["setting", "mask", *report.dims, "column", "metric", "k", "mean (%)", "low (%)", "high (%)",
                     "n samples", "seeds", "interval"])  # fmt: skip
    name = f"{short_name(report.definition.confidence)} over seeds"
    for r in report.pass_k:
        for (label, kind, k), e in r.cells.items():
            writer.writerow([r.row.setting, r.row.mask, *(r.row.dim(d) for d in report.dims), report.name(label), f"{kind}@k", k,
                             *_estimate_fields(e), r.samples, " ".join(map(str, r.seeds)), name])  # fmt: skip
    return buf.getvalue()


def seeds_csv(report: Report) -> str:
    """The value behind every mean of the table: one line per row and seed (what a reader needs to
    check the table, or to compare a re-run seed by seed)."""
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["setting", "mask", *report.dims, "seed", *(f"{report.name(label)} (%)" for label in report.labels)])
    for r in report.rows:
        for i, seed in enumerate(r.seeds):
            values = [r.per_seed[label][i] for label in report.labels] if r.per_seed else []
            writer.writerow([r.row.setting, r.row.mask, *(r.row.dim(d) for d in report.dims), seed,
                             *(f"{100 * v:.4f}" for v in values)])  # fmt: skip
    return buf.getvalue()


def comparison_csv(report: Report) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["setting", "mask", *report.dims, "baseline",
                     *(f"{report.name(label)} {part}" for label in report.labels
                       for part in ("diff (pp)", "low (pp)", "high (pp)", "P(improve)", "p", "p Holm",
                                    "seeds for 80% power", "resolvable (pp)")),
                     "paired", "seeds", "interval"])  # fmt: skip
    conf = report.definition.confidence
    for comp in report.comparisons:
        fields = []
        for label in report.labels:
            c = comp.cells[label]
            p = c.probability_of_improvement
            fields += [*_estimate_fields(c.difference), "" if math.isnan(p) else f"{p:.4f}",
                       *("" if math.isnan(v) else f"{v:.6g}" for v in (c.p_value, c.p_holm)),
                       "" if c.seeds_needed is None else str(c.seeds_needed), _num(c.resolvable)]  # fmt: skip
        writer.writerow([comp.row.setting, comp.row.mask, *(comp.row.dim(d) for d in report.dims),
                         comp.baseline.label, *fields, bool(comp.seeds), " ".join(map(str, comp.seeds)),
                         f"{short_name(conf)} over the per-seed differences" if comp.seeds
                         else describe_unpaired(conf)])  # fmt: skip
    return buf.getvalue()
