"""Trust-region masks for LLM RL: GRPO clip-higher, DPPO and the predictive divergence mask.

`pdmctl.masks` is the import path of the masks' functions (`token_diagnostics`, `policy_loss`,
`register_method`, `METHODS`, ...). The package holds:

  loss.py     docs/MATH.md in code: the registries, divergences, estimators, methods, aggregations,
              `compute_mask`, `token_diagnostics`, `policy_loss`, `token_loss`; pure torch, no I/O
  rows.py     the row statistics over the vocabulary: one blocked torch pass, or the kernel
  kernel.py   the fused Triton row statistics (opt-in on CUDA: PDMCTL_MASK_KERNEL=auto)
  names.py    the built-in names, without torch: what checking a run's config needs

Importing the package imports no torch: `pdmctl.spec` and the commands that check, describe and report
a grid read `pdmctl.masks.names` alone. The names below come from `loss.py` the first time one is
read (PEP 562), so `pdmctl.masks.METHODS` is `pdmctl.masks.loss.METHODS`, the same dictionary.
"""

from __future__ import annotations

from typing import Any

# every public name of loss.py (rows.py's among them), read through the package; a test holds them equal
_FROM_LOSS = frozenset({
    "AGGREGATIONS", "DIVERGENCES", "ESTIMATORS", "FAMILIES", "METHODS", "EPS", "KERNEL_CHOICES", "KERNEL_ENV",
    "Diagnostics", "DivergenceFamily", "DivergenceSpec", "EstimatorSpec", "MaskInputs", "MaskResult",
    "MethodSpec", "Support", "VocabShard",
    "compute_mask", "ddot_from_gradient", "finite_cap", "fused_row_stats", "kernel_choice", "policy_loss",
    "register_aggregation", "register_divergence", "register_estimator", "register_family", "register_method",
    "token_diagnostics", "token_loss", "token_support", "update_metrics",
})  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _FROM_LOSS:
        from pdmctl.masks import loss

        return getattr(loss, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _FROM_LOSS)
