"""Top-K-mass bands: where the response tokens lie, and how well each Ḋ estimator reads its sign there.

DPPO measured an LLM's top-20 holding 99.4% of the mass on average; the paper's premise that the
tail estimators nearly agree (`agg`, the tail as one token, and `uni`, the tail spread evenly) holds
where the tail is small, not at the forking positions. This module bins the analysis's response
tokens by the top-K mass of the rollout's distribution μ (the K the engine handed over, so what the
mask itself sees) and, per band, counts how often each criterion's sign of Ḋ equals the true one:
the `exact` estimator's, the directional derivative of the very D the mask thresholds along
e_k − π (MATH.md; `tests/test_masks.py` holds it equal to the jvp). `ratio` is the ratio criterion's
direction, sign(r − 1). Counted over the out-of-region tokens (D > δ, where the criteria decide)
and over all response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from rich.table import Table

BANDS = (
    (0.0, 0.9, "< 0.9"),
    (0.9, 0.99, "0.9-0.99"),
    (0.99, 0.994, "0.99-0.994"),
    (0.994, float("inf"), "≥ 0.994"),
)
DIRECTIONS = ("agg", "uni", "ratio")  # each read against the true Ḋ (exact)


@dataclass(frozen=True)
class BandStats:
    """One top-K-mass band, pooled over the analysis's seeds."""

    band: str
    low: float
    high: float | None  # None: no upper end
    tokens: int
    share: float  # of all response tokens
    out_of_region: int
    agree_out_of_region: dict[str, float | None]  # direction -> share with sign(Ḋ_exact); None: no token
    agree_all: dict[str, float | None]


def topk_mass(topk_logprobs: torch.Tensor) -> torch.Tensor:
    """The rollout distribution's mass on the top-K it handed over, float [...]."""
    return topk_logprobs.double().exp().sum(-1).float()


@dataclass
class BandCounter:
    """Counts, accumulated seed by seed (`add`), turned into BandStats by `stats`."""

    tokens: list[int]
    out: list[int]
    agree_out: dict[str, list[int]]
    agree_all: dict[str, list[int]]

    @classmethod
    def empty(cls) -> BandCounter:
        n = len(BANDS)
        return cls([0] * n, [0] * n, {d: [0] * n for d in DIRECTIONS}, {d: [0] * n for d in DIRECTIONS})

    def add(
        self,
        mass: torch.Tensor,
        response: torch.Tensor,
        out_of_region: torch.Tensor,
        ddot: dict[str, torch.Tensor],
        ratio: torch.Tensor,
    ) -> None:
        """One batch: top-K mass, the response and out-of-region masks (bool), Ḋ per estimator (agg, uni,
        exact) and r, all [B, T]."""
        truth = ddot["exact"] > 0
        same = {
            "agg": (ddot["agg"] > 0) == truth,
            "uni": (ddot["uni"] > 0) == truth,
            "ratio": (ratio > 1) == truth,
        }
        for i, (low, high, _) in enumerate(BANDS):
            in_band = response & (mass >= low) & (mass < high)
            out = in_band & out_of_region
            self.tokens[i] += int(in_band.sum())
            self.out[i] += int(out.sum())
            for d in DIRECTIONS:
                self.agree_all[d][i] += int((same[d] & in_band).sum())
                self.agree_out[d][i] += int((same[d] & out).sum())

    def merge(self, other: BandCounter) -> None:
        """Add another counter's counts (a seed analysed in another process)."""
        for mine, theirs in ((self.tokens, other.tokens), (self.out, other.out)):
            mine[:] = [a + b for a, b in zip(mine, theirs, strict=True)]
        for mine_d, theirs_d in ((self.agree_out, other.agree_out), (self.agree_all, other.agree_all)):
            for d in DIRECTIONS:
                mine_d[d] = [a + b for a, b in zip(mine_d[d], theirs_d[d], strict=True)]

    def stats(self) -> list[BandStats]:
        total = max(sum(self.tokens), 1)
        return [
            BandStats(
                band=label,
                low=low,
                high=None if high == float("inf") else high,
                tokens=self.tokens[i],
                share=self.tokens[i] / total,
                out_of_region=self.out[i],
                agree_out_of_region={d: _share(self.agree_out[d][i], self.out[i]) for d in DIRECTIONS},
                agree_all={d: _share(self.agree_all[d][i], self.tokens[i]) for d in DIRECTIONS},
            )
            for i, (low, high, label) in enumerate(BANDS)
        ]


def _share(count: int, n: int) -> float | None:
    return count / n if n else None


def band_analysis(cfg, seeds: list[int]) -> list[BandStats]:
    """The bands on the analysis's stale batches (probe.stale_batch, in the testbed), the same tokens as its tables."""
    import dataclasses

    from pdmctl.backends.toy.probe import diagnostics, stale_batch

    counter = BandCounter.empty()
    for seed in seeds:
        run = dataclasses.replace(cfg, seed=seed)
        learner, batch, advantages = stale_batch(run)
        d = {e: diagnostics(learner, batch, advantages, run, e) for e in ("agg", "uni", "exact")}
        response = learner.task.response_mask(batch.sampled_ids).bool()
        counter.add(
            topk_mass(batch.topk_logprobs),
            response,
            d["agg"].out_of_region,
            {e: v.ddot for e, v in d.items()},
            d["agg"].ratio,
        )
    return counter.stats()


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


BAND_COLUMNS = (
    "top-K mass of μ",
    "tokens",
    "share",
    "out of region",
    *(f"{d} = sign Ḋ, out" for d in DIRECTIONS),
    *(f"{d} = sign Ḋ, all" for d in DIRECTIONS),
)


def band_rows(bands: list[BandStats]) -> list[tuple[str, ...]]:
    return [
        (
            b.band,
            str(b.tokens),
            _pct(b.share),
            str(b.out_of_region),
            *(_pct(b.agree_out_of_region[d]) for d in DIRECTIONS),
            *(_pct(b.agree_all[d]) for d in DIRECTIONS),
        )
        for b in bands
    ]


def render_band_table(bands: list[BandStats], k: int) -> Table:
    table = Table(
        title=f"Response tokens by the rollout's top-{k} mass, and each direction's sign agreement with the true Ḋ "
        "(exact: the derivative of D along e_k − π), over the out-of-region tokens and over all"
    )
    for i, column in enumerate(BAND_COLUMNS):
        table.add_column(column, justify="left" if i == 0 else "right")
    for row in band_rows(bands):
        table.add_row(*row)
    return table


def base_band_profile(preset: str = "toy-llm", prompts: int = 1024, seed: int = 7) -> dict[str, float]:
    """The base model's band shares of the rollout's top-20 mass on `prompts` training prompts sampled at
    temperature 1 from the bf16 rollout weights, with its mean response length and score: the figures
    docs/TESTBED.md ("The LLM-like preset") records under each kernel setting."""
    from pdmctl.backends.toy.basemodel import load_base_model
    from pdmctl.backends.toy.model import PRECISIONS
    from pdmctl.backends.toy.rollout import RolloutEngine
    from pdmctl.backends.toy.tasks import task_of

    model, task = load_base_model(preset), task_of(preset)
    engine = RolloutEngine(model, PRECISIONS["bf16"].rollout, 20, task.max_response_len, task.kv_cache)
    engine.sync(model)
    generator = torch.Generator().manual_seed(seed)
    problems = task.sample_train(prompts, generator)
    batch = engine.generate(problems.prompts, generator)
    response = task.response_mask(batch.sampled_ids).bool()
    mass = topk_mass(batch.topk_logprobs)[response]
    lengths = task.response_lengths(batch.sampled_ids).float()
    return {
        **{label: float(((mass >= low) & (mass < high)).float().mean()) for low, high, label in BANDS},
        "mean top-20 mass": float(mass.mean()),
        "mean length": float(lengths.mean()),
        "longest-form share": float((lengths == task.max_response_len).float().mean()),
        "score": float(task.score(problems, batch.sampled_ids).mean()),
    }


if __name__ == "__main__":  # python -m pdmctl.analysis.bands [preset]
    import sys

    print(torch.backends.cpu.get_cpu_capability(), base_band_profile(*sys.argv[1:2]))
