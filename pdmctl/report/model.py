"""The report's data types: rows of the tables, comparisons, provenance, pass@k, curves, the report itself.

`pdmctl.report.build` fills them from the ledger; `tables`, `plots` and `write` read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pdmctl.report.collect import Exclusion, RowKey
from pdmctl.report.definition import Definition
from pdmctl.report.stats import Comparison, Estimate


@dataclass(frozen=True)
class TableRow:
    row: RowKey
    seeds: tuple[int, ...]
    cells: dict[str, Estimate]  # column label (and the average's) -> mean over seeds with its interval
    two_level: dict[str, bool] = field(default_factory=dict)  # column label -> seeds and problems resampled
    per_seed: dict[str, tuple[float, ...]] = field(default_factory=dict)  # column label -> the value of each seed
    stopped: tuple[str, ...] = ()  # "seed 2 stopped: collapse at step 12, avg@16 0.0%": counted at its last evaluation


@dataclass(frozen=True)
class ComparisonRow:
    row: RowKey
    baseline: RowKey
    seeds: tuple[int, ...]  # the matched seeds; empty when unpaired
    cells: dict[str, Comparison]
    stages: int = 0  # the group-sequential interval's stages (report.sequential); 0: a fixed-size interval
    last_look: int = 0  # the look after which its last seeds were added (0: none added to it)


@dataclass(frozen=True)
class ProvenanceRow:
    """Where a row's numbers come from: each field's distinct values over its runs (and their attempts)."""

    row: RowKey
    values: dict[str, tuple[str, ...]]  # field (commit, dirty, version.torch, data, ...) -> its values
    runs: int
    attempts: int  # recorded attempts over the row's runs (a requeue or a resume is one more)
    job_ids: tuple[str, ...]
    mixed: tuple[str, ...]  # the pooling fields that take more than one value among the row's runs


@dataclass(frozen=True)
class PassKRow:
    """pass@k and maj@k of a row's runs, for each column (and the average) and k: mean over seeds with the
    seed interval, from each run's per-sample correctness at the evaluation(s) the table reads."""

    row: RowKey
    seeds: tuple[int, ...]
    samples: int  # n: samples per problem
    ks: tuple[int, ...]
    cells: dict[tuple[str, str, int], Estimate]  # (column label, "pass" | "maj", k) -> estimate


@dataclass(frozen=True)
class Line:
    """One row's curve on one panel: mean over seeds and its band at every step."""

    row: RowKey
    steps: np.ndarray
    centre: np.ndarray
    low: np.ndarray  # NaN where there is no band (one seed)
    high: np.ndarray
    n_seeds: int


@dataclass(frozen=True)
class SettingCurves:
    setting: str
    rows: list[RowKey]
    chosen_by_best: bool  # more rows than a figure holds: each mask at its best row by the average
    eval_panels: dict[str, list[Line]]  # panel label -> lines
    dynamics_panels: dict[str, list[Line]]
    mismatch_panels: dict[str, list[Line]] = field(default_factory=dict)
    mismatch_metrics: dict[str, tuple[str, ...]] = field(default_factory=dict)  # panel -> the metrics drawn


@dataclass(frozen=True)
class Report:
    sweeps: tuple[str, ...]
    tracking_uri: str
    definition: Definition
    dims: tuple[str, ...]
    labels: tuple[str, ...]  # value columns: the definition's, then the average
    rows: list[TableRow]
    comparisons: list[ComparisonRow]
    excluded: list[Exclusion]
    curves: list[SettingCurves]
    two_level: bool
    baseline_present: bool
    analysis: dict | None = None  # the direction analysis (AnalysisResult as JSON), when given
    queries: int = 0  # statements the ledger sent to the store for this report
    provenance: list[ProvenanceRow] = field(default_factory=list)
    pass_k: list[PassKRow] = field(default_factory=list)
    names: dict[str, str] = field(default_factory=dict)  # column label -> the held-out set(s) shown for it
    clipped: int = 0  # intervals of the tables that reached past their quantity's range, drawn to its edge
    constant_panels: dict[str, float] = field(default_factory=dict)  # panel left out -> its one value
    sequential: dict[RowKey, int] = field(default_factory=dict)  # row -> its stages, where seeds were added after looking
    cost: list = field(default_factory=list)  # per sweep, hours spent beside the prediction (pdmctl.budget.spent.SweepCost)
    collapse_rules: tuple[str, ...] = ()  # the collapse rules the runs declared (pdmctl.budget.collapse), described

    def name(self, label: str) -> str:
        """What a table or figure calls a column: the held-out set its runs logged (`toy24` where the
        definition's label is AIME24 and the runs are the testbed's)."""
        return self.names.get(label, label)
