"""The names `pdmctl.masks` registers, without torch: what validating a run's config needs.

A grid's configs are checked and keyed before any run starts, in a process that may never train; these
tuples let that name the built-in methods, divergences, estimators and loss aggregations without loading
the masks themselves. A test holds them equal to the registries. A name registered at run time
(`masks.register_method`, ...) is not here: for a name it does not hold, each function asks the registry,
and for a method the registry does not hold either, an installed mask plugin of that name (pdmctl.plugins),
which loading registers.
"""

from __future__ import annotations

import sys

METHODS = ("grpo", "dppo", "pdm")
DIVERGENCES = ("topk_kl", "topk_tv", "binary_kl", "binary_tv")
ESTIMATORS = ("agg", "uni", "exact")
AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
USES_DDOT = ("pdm",)  # the methods whose mask reads Ḋ, and so the estimator (masks.MethodSpec.uses_ddot)


def is_known(registry: str, value: object) -> bool:
    """Whether `value` names an entry of `masks.<registry>` ("METHODS", "DIVERGENCES", "ESTIMATORS",
    "AGGREGATIONS")."""
    if value in getattr(sys.modules[__name__], registry):
        return True
    from pdmctl.masks import loss

    if value in getattr(loss, registry):
        return True
    return registry == "METHODS" and _plugin(value)


def known(registry: str) -> list[str]:
    """Every name of `masks.<registry>`, sorted (for the error that names an unknown one; loads the masks)."""
    from pdmctl.masks import loss

    return sorted(getattr(loss, registry))


def uses_ddot(method: str) -> bool:
    """Whether a method's mask reads Ḋ, and so a run's key keeps its estimator (pdmctl.spec). True for a method
    no registry holds and for a mask plugin's whatever it reads: its runs keep their keys where the plugin is
    not installed (`pdmctl status` and `pdmctl report` read them without it)."""
    if method in METHODS:
        return method in USES_DDOT
    from pdmctl import plugins
    from pdmctl.masks import loss

    spec = loss.METHODS.get(method)
    return spec is None or plugins.loaded("mask", method) or spec.uses_ddot


def _plugin(method: object) -> bool:
    """Whether an installed mask plugin is named `method` (loaded, and so registered, if so); PluginError where
    one is and cannot be used."""
    from pdmctl import plugins

    return plugins.load("mask", method) is not None
