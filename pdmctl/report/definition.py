"""Report definitions (`reports/NAME.yaml`): which metrics make which columns, which mask is the baseline."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

from pdmctl.resources import search_path
from pdmctl.yamlfiles import load_named

T_METHOD = "t"  # Student's t (Welch's for unpaired differences); the others are scipy.stats.bootstrap's
CI_METHODS = (T_METHOD, "percentile", "bca")
_LAST_N = re.compile(r"^last-([1-9][0-9]*)$")
MAX_LAST_N = 1_000_000  # evaluations averaged: more than any run logs
PANEL_KINDS = ("eval", "dynamics", "mismatch")  # the figures `--panels` chooses among


class ReportError(ValueError):
    """A report that cannot be made as asked; the message is one line."""


@dataclass(frozen=True)
class Column:
    """One table column: a label and the metrics that can fill it, the first a run logged wins."""

    label: str
    metrics: tuple[str, ...]


@dataclass(frozen=True)
class Panel:
    label: str
    metric: str


# The rollout/trainer mismatch panel: each a label and the metrics that can fill it, the first a
# run logged wins (VeRL 0.9.1's names where the rollout's log-probs are kept, then rollout correction's,
# then the testbed's own, which measures what VeRL's first does)
DEFAULT_MISMATCH = (
    Column("rollout/trainer gap", ("training/rollout_probs_diff_mean", "train/rollout_probs_diff_mean",
                                   "rollout_corr/log_ppl_abs_diff", "rollout_corr/kl")),
    Column("out-of-region fraction", ("train/out_of_region_frac", "actor/pdmctl/out_of_region_frac")),
    Column("disagreement count", ("train/disagreement_count", "actor/pdmctl/disagreement_count")),
)  # fmt: skip


@dataclass(frozen=True)
class Confidence:
    level: float = 0.95
    method: str = T_METHOD
    resamples: int = 10000
    seed: int = 0
    band_resamples: int = 2000  # per step of a learning curve's band (hundreds of steps per line)

    @property
    def for_bands(self) -> Confidence:
        return replace(self, resamples=min(self.resamples, self.band_resamples))


@dataclass(frozen=True)
class At:
    """Which evaluation of a run the table reads: the final one, the best one, or the mean of the last N."""

    kind: str  # final | best | last
    n: int = 1

    @classmethod
    def parse(cls, text: str) -> At:
        if text in ("final", "best"):
            return cls(text)
        match = _LAST_N.match(text)
        if match is None or len(match.group(1)) > len(str(MAX_LAST_N)) or int(match.group(1)) > MAX_LAST_N:
            raise ReportError(f"--at: {text[:40]!r} is not final, best or last-N (1 <= N <= {MAX_LAST_N:,})")
        return cls("last", int(match.group(1)))

    def __str__(self) -> str:
        return f"last-{self.n}" if self.kind == "last" else self.kind

    def describe(self) -> str:
        return {
            "final": "at each run's final evaluation",
            "best": "at each run's best evaluation step (by the mean of the columns; selected on the same data)",
            "last": f"averaged over each run's last {self.n} evaluations",
        }[self.kind]


@dataclass(frozen=True)
class Definition:
    name: str
    columns: tuple[Column, ...]
    average: str | None = "Average"
    baseline: str = "dppo_topk_kl"
    at: At = field(default_factory=lambda: At("final"))
    confidence: Confidence = field(default_factory=Confidence)
    dynamics: tuple[Panel, ...] = ()
    max_lines: int = 12
    description: str = ""
    mismatch: tuple[Column, ...] = DEFAULT_MISMATCH
    panels: tuple[str, ...] = PANEL_KINDS  # the figures drawn (--panels)

    @property
    def eval_metrics(self) -> tuple[str, ...]:
        return tuple(m for c in self.columns for m in c.metrics)

    def with_options(
        self, *, at: str | None = None, baseline: str | None = None, interval: str | None = None,
        panels: str | None = None,
    ) -> Definition:  # fmt: skip
        if interval is not None and interval not in CI_METHODS:
            raise ReportError(f"--interval: {interval!r} is not one of {', '.join(CI_METHODS)}")
        return replace(
            self,
            panels=parse_panels(panels) if panels is not None else self.panels,
            at=At.parse(at) if at is not None else self.at,
            baseline=baseline if baseline is not None else self.baseline,
            confidence=replace(self.confidence, method=interval) if interval is not None else self.confidence,
        )


def parse_panels(text: str) -> tuple[str, ...]:
    """`eval,mismatch` -> the figure kinds, checked; `none` draws no figure."""
    if text.strip() == "none":
        return ()
    chosen = [p.strip() for p in text.split(",")]
    unknown = [p for p in chosen if p not in PANEL_KINDS]
    if unknown or not chosen:
        raise ReportError(f"--panels: {(unknown or [text])[0]!r} is not one of {', '.join(PANEL_KINDS)} "
                          "(comma-separated), or none")  # fmt: skip
    return tuple(dict.fromkeys(chosen))


def load_definition(name_or_path: str = "default") -> Definition:
    """`reports/NAME.yaml`, a bare NAME found there, or any path."""
    path, data = load_named(name_or_path, search_path("reports"), "report definition", ReportError)
    try:
        return parse_definition(data, default_name=path.stem)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ReportError):
            raise ReportError(f"report definition {path}: {exc}") from exc
        raise ReportError(f"report definition {path}: malformed ({type(exc).__name__}: {exc})") from exc


def parse_definition(data: dict[str, Any], default_name: str = "default") -> Definition:
    known = {
        "name",
        "description",
        "columns",
        "average",
        "baseline",
        "at",
        "confidence",
        "dynamics",
        "max_lines",
        "mismatch",
    }
    unknown = set(data) - known
    if unknown:
        raise ReportError(f"unknown field(s) {', '.join(sorted(unknown))}")
    columns = tuple(
        Column(str(c["label"]), tuple(str(m) for m in c["metrics"])) for c in data.get("columns") or []
    )
    if not columns:
        raise ReportError("needs at least one column")
    conf = Confidence(**(data.get("confidence") or {}))
    if conf.method not in CI_METHODS:
        raise ReportError(f"confidence.method: {conf.method!r} is not one of {', '.join(CI_METHODS)}")
    if not 0 < conf.level < 1:
        raise ReportError(f"confidence.level: must be in (0, 1), got {conf.level}")
    if min(conf.resamples, conf.band_resamples) < 100:
        raise ReportError("confidence.resamples and band_resamples: must be >= 100")
    average = data.get("average", "Average")
    return Definition(
        name=str(data.get("name") or default_name),
        description=str(data.get("description") or ""),
        columns=columns,
        average=None if average is None else str(average),
        baseline=str(data.get("baseline") or "dppo_topk_kl"),
        at=At.parse(str(data.get("at") or "final")),
        confidence=conf,
        dynamics=tuple(Panel(str(p["label"]), str(p["metric"])) for p in data.get("dynamics") or []),
        max_lines=int(data.get("max_lines", 12)),
        mismatch=DEFAULT_MISMATCH if data.get("mismatch") is None else tuple(
            Column(str(c["label"]), tuple(str(m) for m in c["metrics"])) for c in data["mismatch"]),
    )  # fmt: skip
