"""The CPU RL testbed: a tiny transformer learns two-digit addition with GRPO through pdmctl.masks."""

from pdmctl.backends.toy.config import ToyConfig
from pdmctl.backends.toy.model import MODEL_PRESETS
from pdmctl.backends.toy.trainer import train

__all__ = ["MODEL_PRESETS", "ToyConfig", "train"]
