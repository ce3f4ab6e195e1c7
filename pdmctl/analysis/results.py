"""What the direction analysis returns (`AnalysisResult`) and its parts; `AnalysisResult.to_json` is what
`pdmctl analyze --json` writes and `pdmctl.report` reads back."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from pdmctl.analysis.bands import BandStats

ESTIMATORS = ("agg", "uni", "exact")


@dataclass(frozen=True)
class CriterionStats:
    """One direction criterion on one estimator's disagreement tokens."""

    unsafe_keep_per_seed: list[float | None]  # None where the criterion kept no disagreement token
    unsafe_keep_mean: float | None  # None where no seed has a rate (and the s.e. where fewer than two)
    unsafe_keep_se: float | None
    corrective_pooled: float | None  # ΔD < 0 among the kept disagreement tokens of all seeds together
    kept_pooled: int
    corrective_per_seed: list[float | None]  # ΔD < 0 among each seed's kept disagreement tokens
    kept_per_seed: list[int] = dataclasses.field(default_factory=list)  # kept disagreement tokens


@dataclass(frozen=True)
class EstimatorDifference:
    """The predictive criterion with one estimator minus with another, paired by seed: the mean of the
    per-seed differences and its Student's t interval (report.stats.paired_difference)."""

    measure: str  # "unsafe-keep" or "corrective"
    first: str  # estimator
    second: str
    mean: float | None  # None where no seed has both rates
    low: float | None  # None below two seeds
    high: float | None
    seeds: int  # seeds where both rates exist


@dataclass(frozen=True)
class Comparison:
    """Ratio direction vs the predictive direction with one tail estimator, on their disagreement set."""

    estimator: str
    disagreement_per_seed: list[int]
    ratio: CriterionStats
    predictive: CriterionStats
    predictive_wins: int  # seeds where the predictive unsafe-keep rate is lower
    ratio_wins: int
    seeds_compared: int  # seeds where both rates exist


@dataclass(frozen=True)
class DecompositionRow:
    """ΔD of one criterion's update under one protocol, over the out-of-region tokens with A ≠ 0 that the
    criterion keeps (all seeds pooled): the first-order ΔD = own + others + momentum. A share is
    |piece| / (|own| + |others| + |momentum|), per token, then the median; a sign agreement is the share of
    tokens whose piece has the sign of the realized ΔD (None where the piece is zero: no momentum)."""

    protocol: str
    criterion: str  # "ratio" or "predictive/<estimator>"
    tokens: int
    own_share: float | None
    others_share: float | None
    momentum_share: float | None
    first_order_sign: float | None  # sign(first-order ΔD) = sign(realized ΔD)
    own_sign: float | None
    others_sign: float | None
    momentum_sign: float | None
    own_logit_sign: float | None  # the own effect as the criterion assumes it: along e_k − π in logit space
    own_last_layer_share: float | None  # median |head's part| / (|head's part| + |the rest's|) of own
    first_order_error: float | None  # median |realized − first order| / |realized|
    own_share_per_seed: list[float | None] = dataclasses.field(default_factory=list)
    others_share_per_seed: list[float | None] = dataclasses.field(default_factory=list)
    momentum_share_per_seed: list[float | None] = dataclasses.field(default_factory=list)


@dataclass(frozen=True)
class AssumptionRow:
    """One way of taking a token's own effect on its D, against the two criteria's predictions of its sign,
    over the out-of-region tokens with A ≠ 0 of all seeds (each token's own gradient as if kept)."""

    own_effect: str
    tokens: int
    agrees_exact: float | None  # share with sign(own effect) = sign(A·Ḋ_exact)
    agrees_ratio: float | None  # share with sign(own effect) = sign(A(r − 1))
    last_layer_share: float | None  # median |head's part| / (|head's part| + |the rest's|)


@dataclass(frozen=True)
class DisagreementTokens:
    """Every disagreement token of one estimator, seeds pooled (the figures' data: figures.py). Token i is
    at response position `position[i]` of seed `seeds[seed[i]]`; `predictive_keeps[i]`: the predictive
    criterion keeps it and the ratio one masks it (else the other way round); `delta_d[p][i]`: its ΔD
    after the update of the criterion that keeps it, under protocol p."""

    estimator: str
    seed: list[int]
    position: list[int]
    advantage: list[float]
    predictive_keeps: list[bool]
    delta_d: dict[str, list[float]]


@dataclass(frozen=True)
class CounterfactualCounts:
    """The `counterfactual` protocol on one set of tokens, per seed: for each token a carried update with it
    kept and one with it masked (counterfactual.py). `own_up`: keeping raised the token's own D (an unsafe
    keep where the criterion keeps it; where it masks it, `own_down` counts the needless masks); `region_up`:
    keeping raised the mean D over the batch's out-of-region tokens."""

    estimator: str  # the predictive criterion's (and so the disagreement set's)
    criterion: str  # "ratio" or "predictive"
    tokens: str  # "disagreement" (this estimator's) or "out-of-region" (all)
    decision: str  # "kept" or "masked": what the criterion decides on them
    n: list[int]
    own_up: list[int]
    own_down: list[int]
    region_up: list[int]
    region_down: list[int]
    # keeping raised the token's own D with the other member's gradient scaled by the criterion's own update's
    # clipping factor (the clip-held channel); |own| below the float32 sign floor (within rounding's reach)
    own_up_clip_held: list[int] = dataclasses.field(default_factory=list)
    below_floor: list[int] = dataclasses.field(default_factory=list)


@dataclass(frozen=True)
class Regime:
    """The run's §4.2 regime beside the paper's (regime.py computes it from the run's own tokens): how much
    of the batch leaves the region, how much of that the criteria disagree on (the primary estimator's
    disagreement set) and how often the step training takes (`carried`) raises a kept token's D."""

    response_tokens: int  # all seeds
    out_of_region: int
    out_of_region_share: float | None  # of the response tokens (None: no token)
    estimator: str  # whose disagreement set
    disagreements: int
    disagreement_share: float | None  # of the out-of-region tokens
    disagreements_median_per_seed: float | None
    disagreements_mean_per_seed: float | None
    realized_protocol: str | None  # the update the realized rates are taken after (None: not run)
    # the realized unsafe-keep rate on the disagreement tokens each criterion keeps: the mean over seeds (the
    # paper's aggregation; seeds where it keeps none left out) and pooled over tokens (None: not measured)
    unsafe_keep_ratio: float | None
    unsafe_keep_predictive: float | None
    unsafe_keep_ratio_pooled: float | None
    unsafe_keep_predictive_pooled: float | None
    # the paper's figures (§4.2, MATH.md): per seed out of the region, disagreement tokens, unsafe keeps
    paper_out_of_region_per_seed: int = 1435
    paper_sequences_per_seed: int = 1024  # the rollout each seed's analysis takes
    paper_disagreements_per_seed: int = 82
    paper_unsafe_keep_ratio: float = 0.369
    paper_unsafe_keep_predictive: float = 0.342


@dataclass(frozen=True)
class AnalysisResult:
    seeds: list[int]
    delta: float
    k: int
    divergence: str
    precision: str
    tokens_per_seed: list[int]  # response tokens
    out_of_region_per_seed: list[int]
    comparisons: list[Comparison]  # under `protocol`
    estimator_differences: list[EstimatorDifference]
    level: float = 0.95
    protocol: str = "counterfactual"  # how the update that ΔD measures was taken (PROTOCOLS)
    # every protocol measured, the main one included: protocol -> one Comparison per estimator
    protocol_comparisons: dict[str, list[Comparison]] = dataclasses.field(default_factory=dict)
    # ΔD decomposed (decomposition.py): one row per update protocol and criterion
    decomposition: list[DecompositionRow] = dataclasses.field(default_factory=list)
    # the predictive criterion's logit-space assumption against the whole network's own effect
    logit_assumption: list[AssumptionRow] = dataclasses.field(default_factory=list)
    bands: list[BandStats] = dataclasses.field(default_factory=list)  # by top-K mass (bands.py)
    # "stale": the step's other mini-batch updates first (training's staleness); "mismatch-only": the
    # fresh rollout, D from the rollout weights' precision alone (the paper's §4.2 setting)
    setting: str = "stale"
    tokens_per_position: list[int] = dataclasses.field(default_factory=list)  # response tokens, seeds pooled
    out_of_region_per_position: list[int] = dataclasses.field(default_factory=list)
    disagreement_tokens: list[DisagreementTokens] = dataclasses.field(default_factory=list)  # per estimator
    counterfactual: list[CounterfactualCounts] = dataclasses.field(default_factory=list)  # its counts, per seed
    model: str = ""  # the preset (empty in results written before presets were recorded)
    # the counterfactual's region effect by first order against its exact value on a few variants per seed:
    # [first order, exact] each (empty: every variant taken exactly, or not measured)
    region_check: list[list[float]] = dataclasses.field(default_factory=list)
    regime: Regime | None = None  # beside the paper's (regime.py; None in results written before it)

    def to_json(self) -> str:
        """The whole result; one line per field, the token lists each on one line (they are most of it)."""
        data = dataclasses.asdict(self)
        lines = [f"  {json.dumps(k)}: {json.dumps(v, allow_nan=False, ensure_ascii=False)}" for k, v in data.items()]
        return "{\n" + ",\n".join(lines) + "\n}\n"

    @classmethod
    def from_dict(cls, data: dict) -> AnalysisResult:
        """A result from `to_json`'s JSON, older files too (a field written later is empty there)."""

        def criterion(values: dict) -> CriterionStats:  # written before per-seed corrective rates: none
            return CriterionStats(**{"corrective_per_seed": [], **values})

        def comparison(c: dict) -> Comparison:
            return Comparison(**{**c, "ratio": criterion(c["ratio"]), "predictive": criterion(c["predictive"])})

        comparisons = [comparison(c) for c in data["comparisons"]]
        differences = [EstimatorDifference(**d) for d in data.get("estimator_differences", [])]
        by_protocol = {p: [comparison(c) for c in cs] for p, cs in data.get("protocol_comparisons", {}).items()}
        decomposed = [DecompositionRow(**r) for r in data.get("decomposition", [])]
        assumption = [AssumptionRow(**r) for r in data.get("logit_assumption", [])]
        bands = [BandStats(**b) for b in data.get("bands", [])]  # results written before the bands: none
        tokens = [DisagreementTokens(**t) for t in data.get("disagreement_tokens", [])]  # written before: none
        counterfactual = [CounterfactualCounts(**c) for c in data.get("counterfactual", [])]
        regime = Regime(**data["regime"]) if data.get("regime") else None
        return cls(**{**data, "regime": regime, "comparisons": comparisons, "estimator_differences": differences,
                      "protocol_comparisons": by_protocol, "decomposition": decomposed,
                      "logit_assumption": assumption, "bands": bands,
                      "disagreement_tokens": tokens, "counterfactual": counterfactual,
                      "protocol": data.get("protocol", "carried")})  # fmt: skip
