"""RunSpec: the resolved config of one run, and its key.

The key is a stable hash of what changes the result. Paths, the cluster, the
attempt and output directories are not in the run config at all; fields that a
method ignores (δ for GRPO, ε for the divergence masks, the estimator outside
PDM) are dropped before hashing, so that a grid never trains the same thing
twice under two names. A declared collapse rule (`stop.collapse`, pdmctl.budget.collapse)
is in the key; without one (all null) `stop` is dropped, and keys stay as they were.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from pdmctl.budget import collapse
from pdmctl.masks import names as mask_names

KEY_LENGTH = 12
MASK_FIELDS = ("method", "divergence", "estimator", "eps_low", "eps_high", "ratio_cap", "loss_agg_mode")


class SpecError(ValueError):
    """A run config that cannot run; the message is one line naming the field."""


@dataclass(frozen=True)
class RunSpec:
    sweep: str
    config_json: str  # canonical JSON of the resolved run config (a frozen value)

    @classmethod
    def from_config(cls, sweep: str, config: Mapping[str, Any]) -> RunSpec:
        return cls(sweep=sweep, config_json=json.dumps(config, sort_keys=True, separators=(",", ":")))

    @cached_property
    def config(self) -> dict[str, Any]:
        return json.loads(self.config_json)

    @cached_property
    def key(self) -> str:
        return run_key(self.config)

    @property
    def backend(self) -> str:
        return self.config["backend"]["name"]

    @property
    def seed(self) -> int:
        return int(self.config["seed"])

    @property
    def summary(self) -> str:
        """One line a person reads in a table: mask, δ, K, precision, model, seed."""
        c = self.config
        parts = [c["mask"]["name"]]
        if c["mask"]["method"] != "grpo":
            parts.append(
                f"δ={c['delta']:g}" + (f"/{c['delta_low']:g}" if c.get("delta_low") is not None else "")
            )
        parts += [f"K={c['k']}", c["precision"]["name"], c["model"]["name"], f"seed={c['seed']}"]
        return " ".join(parts)

    @property
    def run_name(self) -> str:
        c = self.config
        return f"{c['mask']['name']}-d{c['delta']:g}-k{c['k']}-{c['precision']['name']}-{c['model']['name']}-s{c['seed']}"

    def to_json(self) -> str:
        return json.dumps({"sweep": self.sweep, "config": self.config}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        data = json.loads(text)
        return cls.from_config(data["sweep"], data["config"])


def result_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a run config that changes the result."""
    cfg = json.loads(json.dumps(config))  # a plain copy (faster than deepcopy on JSON data)
    mask = dict(cfg["mask"])
    mask.pop("name", None)  # two presets with the same fields train the same thing
    method = mask["method"]
    if method == "grpo":
        cfg.pop("delta", None)
        cfg.pop("delta_low", None)
        mask.pop("divergence", None)
    else:
        mask.pop("eps_low", None)
        mask.pop("eps_high", None)
    if not mask_names.uses_ddot(method):
        mask.pop("estimator", None)
    cfg["mask"] = mask
    if not collapse.declared(cfg):  # no collapse rule: the key of a config from before the field was there
        cfg.pop("stop", None)
    backend = cfg.get("backend")
    if isinstance(backend, dict) and backend.get("name") == "toy":  # the nodes its job holds: one process trains
        backend.pop("nnodes", None)
    if isinstance(backend, dict) and backend.get("skip_old_log_prob") is True:  # the default: the key from before
        backend.pop("skip_old_log_prob")  # the field was there (VeRL's recompute or not, the same loss)
    return cfg


def run_key(config: Mapping[str, Any]) -> str:
    canonical = json.dumps(result_config(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:KEY_LENGTH]


def validate(config: Mapping[str, Any]) -> None:
    """Values every backend needs; backends check their own fields on top (see backends.registry)."""
    _finite(config)
    mask = config.get("mask") or {}
    for field in ("method", "divergence", "estimator"):
        value, registry = mask.get(field), f"{field.upper()}S"  # masks.METHODS, DIVERGENCES, ESTIMATORS
        if not mask_names.is_known(registry, value):
            choices = ", ".join(mask_names.known(registry))
            raise SpecError(f"mask.{field}: unknown {value!r}; choose from {choices}")
    _positive(config, "delta")
    if config.get("delta_low") is not None:
        _positive(config, "delta_low")
    _whole(config, "k", 1)
    _whole(config, "seed", 0)
    for field in ("eps_low", "eps_high", "ratio_cap"):
        if field in mask and not (field == "ratio_cap" and mask[field] is None):  # ratio_cap null: no cap
            _positive(mask, field, prefix="mask.")
    try:
        collapse.collapse_rule(config)
    except collapse.RuleError as exc:
        raise SpecError(str(exc)) from None
    model_backend = (config.get("model") or {}).get("backend")
    backend = (config.get("backend") or {}).get("name")
    if model_backend and model_backend != backend:
        raise SpecError(
            f"model: {config['model']['name']!r} runs on backend={model_backend}, not backend={backend}"
        )


def _whole(config: Mapping[str, Any], field: str, least: int) -> None:
    """An integer field: a float (`k=1e12`, `k=20.5`) is named as one, whatever its size."""
    value = config.get(field)
    if isinstance(value, float):
        kind = "a whole number written as a float" if math.isfinite(value) and value == int(value) else "not whole"
        raise SpecError(f"{field}: must be an integer >= {least}, got {value:g} ({kind}; write it as an integer, "
                        f"e.g. {field}=20)")  # fmt: skip
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise SpecError(f"{field}: must be an integer >= {least}, got {value!r}")


def _positive(cfg: Mapping[str, Any], field: str, prefix: str = "") -> None:
    value = cfg.get(field)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise SpecError(f"{prefix}{field}: must be a number > 0, got {value!r}")


def _finite(node: Any, path: str = "") -> None:
    """inf and nan would be stored as non-standard JSON, under a key of their own: refused anywhere."""
    if isinstance(node, Mapping):
        for name, value in node.items():
            _finite(value, f"{path}{name}.")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _finite(value, f"{path}{i}.")
    elif isinstance(node, float) and not math.isfinite(node):
        raise SpecError(f"{path.rstrip('.')}: must be a finite number, got {node}")
