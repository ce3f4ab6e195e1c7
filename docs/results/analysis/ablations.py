"""`pdmctl analyze` on toy-fork's ablations that no shipped preset is: toy-llm's task (no phrasing slots) on
toy-fork's sharper model (its matrices start 4x larger, its logits are the head's x 32), named `toy-llm-sharp`.

    python docs/results/analysis/ablations.py --seeds 61 model=toy-llm-sharp precision=fp8_rollout backend.lr=2.5e-4
        toy-fork without its phrasing slots (toy-fork's precision and learning rate)
    python docs/results/analysis/ablations.py --seeds 61 model=toy-llm-sharp backend.lr=2.5e-4
        toy-llm with toy-fork's scales and learning rate (toy-llm's bf16)

Every argument is `pdmctl analyze`'s. The preset is defined here, in every process (the analysis's worker
processes import this file again), and named in a copy of the config tree (PDMCTL_CONFIG_DIR, a temporary
folder with `model/toy-llm-sharp.yaml` added); its base model is built by the warm-up
(`PDMCTL_TOY_BASE=warmup`, cached under PDMCTL_CACHE): no shipped weights exist for it.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

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
    from pdmctl import resources

    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "configs"
        shutil.copytree(resources.config_dir(), tree)
        (tree / "model" / "toy-llm-sharp.yaml").write_text(
            "name: toy-llm-sharp\nbackend: toy       # toy-llm's task on toy-fork's sharper model (ablations.py)\n"
        )
        os.environ["PDMCTL_CONFIG_DIR"] = str(tree)
        from pdmctl.cli import app

        app(["analyze", *sys.argv[1:]], prog_name="pdmctl")
