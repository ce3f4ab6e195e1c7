"""The CPU RL testbed: a tiny transformer learns two-digit addition with GRPO through pdmctl.masks.

`ToyConfig` and `MODEL_PRESETS` are what expanding a grid needs; `train` (the trainer, its rollouts and
tasks) is imported when first asked for, so a dry run never loads the training code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdmctl.backends.toy.config import ToyConfig
from pdmctl.backends.toy.presets import MODEL_PRESETS

if TYPE_CHECKING:
    from pdmctl.backends.toy.trainer import train

__all__ = ["MODEL_PRESETS", "ToyConfig", "train"]


def __getattr__(name: str) -> Any:
    if name == "train":
        from pdmctl.backends.toy.trainer import train

        return train
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
