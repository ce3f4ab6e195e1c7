"""VeRL's metric names and printed lines -> pdmctl's (backends/base.py)."""

from __future__ import annotations

import re
from collections.abc import Mapping

# ---------------------------------------------------------------------------
# Metrics: VeRL/MLflow names -> pdmctl's (backends/base.py)
# ---------------------------------------------------------------------------

VAL_DATA_SOURCES = {"aime24": "aime24", "aime25": "aime25"}  # data_source in the parquet -> report name
TRAIN_METRICS = {
    "critic/score/mean": "train/reward",
    "response_length/mean": "train/response_length",
    "actor/pdmctl/ppo_kl": "train/ppo_kl",
    "actor/pdmctl/mask_frac": "train/mask_frac",
    "actor/pdmctl/out_of_region_frac": "train/out_of_region_frac",
    "actor/pdmctl/mean_divergence": "train/mean_divergence",
    "actor/pdmctl/disagreement_count": "train/disagreement_count",
    "actor/pdmctl/rollout_probs_diff_mean": "train/rollout_probs_diff_mean",  # plugin.rollout_gap
}


def pdmctl_metric_name(verl_name: str) -> str | None:
    """`val-core/aime24/acc/mean@16` (or MLflow's `..._at_16`) -> `eval/aime24`; None if not reported."""
    name = verl_name.replace("_at_", "@")
    for source, report in VAL_DATA_SOURCES.items():
        if name == f"val-core/{source}/acc/mean@16":
            return f"eval/{report}"
    return TRAIN_METRICS.get(name)


_STEP_LINE = re.compile(r"\bstep:(\d+) - ")
_VAL_METRIC = re.compile(r"\bval-core/([\w.-]+)/acc/mean@16:(?:np\.float\d*\()?([-+0-9.eE]+|nan)")


def evaluation_from_line(line: str) -> tuple[int, dict[str, float]] | None:
    """(step, {eval/aime24: avg@16, ...}) from the metrics line VeRL's console logger prints after a
    validation (`step:N - ... - val-core/aime24/acc/mean@16:np.float64(0.26) - ...`); None otherwise."""
    if "val-core/" not in line or not (step := _STEP_LINE.search(line)):
        return None
    found = {f"eval/{VAL_DATA_SOURCES[src]}": float(v) for src, v in _VAL_METRIC.findall(line) if src in VAL_DATA_SOURCES}
    return (int(step.group(1)), found) if found else None


_REWARD = re.compile(r"\bcritic/score/mean:(?:np\.float\d*\()?([-+0-9.eE]+|nan)")


def step_metrics_from_line(line: str) -> tuple[int, dict[str, float]] | None:
    """(step, {train/reward: ..., eval/aime24: ..., ...}) from a metrics line VeRL's console logger prints
    (every step's; a validation's also has the held-out sets); None where it names neither."""
    found = dict(evaluation[1]) if (evaluation := evaluation_from_line(line)) is not None else {}
    if (reward := _REWARD.search(line)) is not None:
        found["train/reward"] = float(reward.group(1))
    step = _STEP_LINE.search(line)
    return (int(step.group(1)), found) if found and step else None


def map_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    return {new: value for name, value in metrics.items() if (new := pdmctl_metric_name(name)) is not None}


# ---------------------------------------------------------------------------
# `python -m pdmctl.backends.verl.jobbody {wait-ray,probe,train}`: the job body's steps
# ---------------------------------------------------------------------------


