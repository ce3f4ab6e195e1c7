"""`pdmctl analyze` on toy-fork's ablations that no shipped preset is: toy-llm's task (no phrasing slots) on
toy-fork's sharper model (its matrices start 4x larger, its logits are the head's x 32), named `toy-llm-sharp`.

    python docs/results/analysis/ablations.py --seeds 61 model=toy-llm-sharp precision=fp8_rollout backend.lr=2.5e-4
        toy-fork without its phrasing slots (toy-fork's precision and learning rate)
    python docs/results/analysis/ablations.py --seeds 61 model=toy-llm-sharp backend.lr=2.5e-4
        toy-llm with toy-fork's scales and learning rate (toy-llm's bf16)

Every argument is `pdmctl analyze`'s. The preset is defined here, in every process (the analysis's worker
processes import this file again), and its base model is built by the warm-up (`PDMCTL_TOY_BASE=warmup`,
cached under PDMCTL_CACHE): no shipped weights exist for it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass

from pdmctl.backends.toy.presets import MODEL_PRESETS, LLMPreset

os.environ["PDMCTL_TOY_BASE"] = "warmup"


@dataclass(frozen=True)
class SharpLLMPreset(LLMPreset):
    """toy-llm's task and recipe with toy-fork's model scales (model.build_model reads both fields)."""

    init_scale: float = 1.0
    logit_scale: float = 1.0


_FORK = MODEL_PRESETS["toy-fork"]
MODEL_PRESETS["toy-llm-sharp"] = SharpLLMPreset(
    **asdict(MODEL_PRESETS["toy-llm"]), init_scale=_FORK.init_scale, logit_scale=_FORK.logit_scale
)

if __name__ == "__main__":
    from pdmctl.cli import app

    sys.exit(app(["analyze", *sys.argv[1:]], prog_name="pdmctl", standalone_mode=True))
