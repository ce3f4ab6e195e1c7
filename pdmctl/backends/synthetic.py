"""synthetic: a backend whose avg@16 is a known function of δ and the learning rate; it trains nothing.

For tune's tests and benchmark, where the optimiser, not the training, is under test:

    f(δ, lr) = exp(−((δ − 0.12) / 0.06)² − ((log10 lr + 3.5) / 0.6)²)

is 1 at δ = 0.12, lr = 10^−3.5 and falls off smoothly. The evaluation at step s
of `steps` reads f·s/steps on both held-out sets (learning curves that rise to
f, so a pruner sees bad settings early); `seed_spread` adds seed·seed_spread to
f (seeds that disagree by a known amount); `step_s` seconds pass per step;
`fail=true` raises at step 1 (a run that fails every attempt).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pdmctl.backends.base import Tracker

OPTIMUM = {"delta": 0.12, "lr": 10**-3.5}
EVAL_SETS = ("toy24", "toy25")
_FIELDS = {"steps": 4, "eval_every": 1, "lr": 1e-3, "step_s": 0.0, "seed_spread": 0.0, "fail": False}


def defaults() -> dict[str, Any]:
    return dict(_FIELDS)


def objective(delta: float, lr: float) -> float:
    return math.exp(-(((delta - OPTIMUM["delta"]) / 0.06) ** 2) - ((math.log10(lr) + 3.5) / 0.6) ** 2)


def validate(flat: Mapping[str, Any]) -> None:
    for name in ("steps", "eval_every"):
        value = flat.get(name, _FIELDS[name])
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
    lr, step_s = flat.get("lr", _FIELDS["lr"]), flat.get("step_s", _FIELDS["step_s"])
    if not _number(lr) or not lr > 0:
        raise ValueError(f"lr: must be a number > 0, got {lr!r}")
    if not _number(step_s) or step_s < 0:
        raise ValueError(f"step_s: must be a number >= 0, got {step_s!r}")
    spread = flat.get("seed_spread", _FIELDS["seed_spread"])
    if not _number(spread) or not math.isfinite(spread):
        raise ValueError(f"seed_spread: must be a finite number, got {spread!r}")
    if not isinstance(flat.get("fail", False), bool):
        raise ValueError(f"fail: must be true or false, got {flat['fail']!r}")


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def run(flat: Mapping[str, Any], run_dir: Path, tracker: Tracker) -> Mapping[str, float]:
    del run_dir  # nothing to checkpoint: a rerun recomputes the same curve
    steps, every = int(flat["steps"]), int(flat["eval_every"])
    peak = objective(float(flat["delta"]), float(flat["lr"])) + float(flat["seed_spread"]) * int(
        flat.get("seed", 0)
    )
    final: dict[str, float] = {}
    for step in range(steps + 1):
        if step:
            if flat["fail"]:
                raise RuntimeError("synthetic: fail=true")
            time.sleep(float(flat["step_s"]))
            tracker.log_metrics({"train/reward": peak * step / steps}, step)
        if step % every == 0 or step == steps:
            final = {f"eval/{name}": peak * step / steps for name in EVAL_SETS}
            tracker.log_metrics(final, step)
    return final
