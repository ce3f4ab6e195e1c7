"""Intervals that keep their coverage when seeds were added after looking at the results.

`pdmctl seeds` reads a sweep's comparisons and, where one is not resolved, adds seeds to both of its rows;
each addition is recorded on the new runs (provenance field `look`: the look after which they were added).
Choosing the number of seeds from the data changes the statistics: the plain t interval over the final
seeds covers less than its level (about 90% at a nominal 95% for the rule "add seeds while the interval
holds 0", seeds 3 -> 5 -> 8; tests/test_report_sequential.py measures it).

The interval used instead is a group-sequential Bonferroni interval (the union bound over looks; Jennison
& Turnbull, "Group Sequential Methods with Applications to Clinical Trials", 2000, §2; α spent over looks
as in Lan & DeMets, Biometrika 70, 1983): the comparison's seeds form stages (the seeds it had before any
addition, then each addition), stage j's t interval over all seeds up to it is taken at level 1 − α/2^j,
and the reported interval is the intersection of the stages' intervals. With probability at least
1 − Σ_j α/2^j ≥ 1 − α every stage's interval covers at once, whatever rule chose when to stop and however
many looks there were, so the intersection covers too. Its p-value, min_j 2^j · p_j (p_j the stage's
paired t-test), rejects at α exactly when the interval leaves out 0. The price is width: at stage 1 the
interval is the plain one at level 1 − α/2.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import stats as sps

# LOOK_FIELD: defined beside the journal of added seeds, which `pdmctl status` reads without scipy
from pdmctl.added_seeds import LOOK_FIELD
from pdmctl.report.stats import Interval, paired_p_value


def stage_alpha(stage: int, alpha: float) -> float:
    """The error stage `stage` (1, 2, ...) spends: α/2^stage, summing to at most α over any number of stages."""
    return alpha / 2**stage


def stage_half_widths(sd: np.ndarray, n: np.ndarray, stage: np.ndarray, alpha: float) -> np.ndarray:
    """Half widths of the stages' t intervals (broadcasts): t_{n−1, 1 − α_j/2} · s / √n."""
    return sps.t.ppf(1 - stage_alpha(stage, alpha) / 2, n - 1) * sd / np.sqrt(n)


def stages(looks: Sequence[int]) -> list[int]:
    """Each value's stage (1, 2, ...) from the look after which it was added (0: it was there before any)."""
    order = sorted(set(looks) | {0})
    return [order.index(look) + 1 for look in looks]


def sequential_interval(differences: Sequence[float], looks: Sequence[int], level: float
                        ) -> tuple[Interval | None, float, int]:  # fmt: skip
    """The intersection of the stages' t intervals, its p-value and the number of stages.

    `looks`: for each per-seed difference, the look after which its seed was added (0: before any).
    None (n/a) where no stage has two seeds."""
    d = np.asarray(differences, dtype=float)
    stage_of = np.asarray(stages(looks), dtype=int)
    alpha = 1 - level
    low, high, p = -math.inf, math.inf, 1.0
    count = int(stage_of.max()) if stage_of.size else 1
    for j in range(1, count + 1):
        x = d[stage_of <= j]
        if x.size < 2:
            continue
        centre, sd = float(x.mean()), float(x.std(ddof=1))
        half = float(stage_half_widths(np.array(sd), np.array(x.size), np.array(j), alpha))
        low, high = max(low, centre - half), min(high, centre + half)
        p = min(p, 2**j * paired_p_value(x))
    if not math.isfinite(low):
        return None, math.nan, count
    if low > high:  # the stages disagree (a miss happened): the last stage's interval stands
        x = d
        centre = float(x.mean())
        half = float(stage_half_widths(np.array(x.std(ddof=1)), np.array(x.size), np.array(count), alpha))
        low, high = centre - half, centre + half
    return Interval(low, high), min(p, 1.0), count


def simulate(effect: float, sizes: Sequence[int], level: float, sims: int, rng: np.random.Generator
             ) -> tuple[float, float]:  # fmt: skip
    """Coverage (sequential interval, plain t interval) of the mean under the rule "add seeds while the
    comparison is not resolved": normal per-seed differences of mean `effect` and sd 1, looks at `sizes`
    seeds (3, 5, 8), stopping at the first look whose interval leaves out 0 (or the last). Each interval
    drives its own rule, as a user trusting it would."""
    d = rng.standard_normal((sims, max(sizes))) + effect
    alpha = 1 - level
    seq_low, seq_high = np.full(sims, -np.inf), np.full(sims, np.inf)
    seq_done, plain_done = np.zeros(sims, bool), np.zeros(sims, bool)
    seq_cover, plain_cover = np.zeros(sims, bool), np.zeros(sims, bool)
    for j, n in enumerate(sizes, 1):
        x = d[:, :n]
        centre, sd = x.mean(axis=1), x.std(axis=1, ddof=1)
        half = stage_half_widths(sd, np.asarray(n), np.asarray(j), alpha)
        seq_low, seq_high = np.maximum(seq_low, centre - half), np.minimum(seq_high, centre + half)
        plain_half = sps.t.ppf(0.5 + level / 2, n - 1) * sd / math.sqrt(n)
        last = j == len(sizes)
        seq_stop = ~seq_done & (last | (seq_low > 0) | (seq_high < 0))
        seq_cover[seq_stop] = (seq_low[seq_stop] <= effect) & (effect <= seq_high[seq_stop])
        seq_done |= seq_stop
        p_low, p_high = centre - plain_half, centre + plain_half
        plain_stop = ~plain_done & (last | (p_low > 0) | (p_high < 0))
        plain_cover[plain_stop] = (p_low[plain_stop] <= effect) & (effect <= p_high[plain_stop])
        plain_done |= plain_stop
    return float(seq_cover.mean()), float(plain_cover.mean())


def run_look(record) -> int:
    """The look after which a run's seed was added (0: the sweep had it before any)."""
    try:
        return int((record.provenance if record is not None else {}).get(LOOK_FIELD, 0))
    except (TypeError, ValueError):
        return 0


def apply(rows: list, data, definition, labels: Sequence[str]) -> tuple[list, dict]:
    """The comparisons with the sequential interval and p-value wherever the sweep had seeds added after a
    look (every paired comparison then, those that got none at stage 1), Holm's p redone over them; and
    row -> its number of stages for those. Unchanged where no run records a look."""
    import dataclasses

    from pdmctl.report.stats import Estimate, holm

    if not any(run_look(r) for r in data.records.values()):
        return rows, {}
    out, staged = [], {}
    for row in rows:
        if not row.seeds:
            out.append(row)
            continue
        mine = {p.seed: p for p in data.by_row[row.row]}
        theirs = {p.seed: p for p in data.by_row[row.baseline]}
        looks = [max(run_look(data.records.get(mine[s].run_id)), run_look(data.records.get(theirs[s].run_id)))
                 for s in row.seeds]  # fmt: skip
        cells = {}
        for label in labels:
            d = [_value(mine[s], labels, definition.average, label) - _value(theirs[s], labels, definition.average, label)
                 for s in row.seeds]  # fmt: skip
            interval, p, count = sequential_interval(d, looks, definition.confidence.level)
            old = row.cells[label]
            cells[label] = dataclasses.replace(old, difference=Estimate(old.difference.mean, old.difference.n, interval),
                                               p_value=p)  # fmt: skip
            staged[row.row] = count
        out.append(dataclasses.replace(row, cells=cells, stages=count, last_look=max(looks)))
    adjusted = {label: holm([r.cells[label].p_value for r in out]) for label in labels}  # as build.with_holm
    out = [dataclasses.replace(r, cells={label: dataclasses.replace(c, p_holm=adjusted[label][i])
                                         for label, c in r.cells.items()}) for i, r in enumerate(out)]  # fmt: skip
    return out, staged


def _value(point, labels: Sequence[str], average: str | None, label: str) -> float:
    """A run's value in one column, the average column being the mean of the others (as the report's)."""
    if label == average:
        others = [point.values[name] for name in labels if name != average]
        return sum(others) / len(others)
    return point.values[label]
