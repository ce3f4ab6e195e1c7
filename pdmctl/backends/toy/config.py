"""The run configuration of the toy backend: one frozen dataclass whose defaults are the default run."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdmctl.backends.toy.presets import MODEL_PRESETS, PRECISION_NAMES
from pdmctl.masks import names as mask_names


@dataclass(frozen=True)
class ToyConfig:
    seed: int = 0
    model: str = "toy-small"
    precision: str = "bf16"
    data: str = "toy"  # the model preset's own task, or a data plugin's (pdmctl.plugins)
    # the mask (pdmctl.masks): method, divergence, estimator, thresholds
    method: str = "pdm"
    divergence: str = "topk_kl"
    estimator: str = "agg"
    delta: float = 0.15  # the config tree's (configs/run.yaml): one default for every entry point
    delta_low: float | None = None
    k: int = 20
    eps_low: float = 0.2
    eps_high: float = 0.28
    ratio_cap: float = 10.0
    loss_agg_mode: str = "token-mean"
    # the RL loop
    steps: int = 40
    prompts_per_step: int = 128
    group_size: int = 8
    minibatches: int = 8  # updates per rollout batch: the source of staleness
    lr: float = 2e-3
    grad_clip: float = 1.0
    eval_every: int = 10
    eval_samples: int = 16
    checkpoint_every: int = 10
    # the nodes its job holds (null: the cluster profile's); it trains on the first. Where it runs, not what it
    # learns: not in the run key (pdmctl.spec)
    nnodes: int | None = None

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> ToyConfig:
        """A validated config from plain values (a RunSpec's, a YAML file's); unknown keys are errors."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown toy config field; known fields: {', '.join(fields)}")
        defaults = cls()
        coerced = {name: _coerce(name, value, getattr(defaults, name)) for name, value in values.items()}
        return cls(**coerced)

    def __post_init__(self) -> None:
        problems = _problems(self)
        if problems:
            raise ValueError(problems[0])


def _coerce(name: str, value: Any, default: Any) -> Any:
    """Plain values as the field's type: YAML gives 1 for 1.0 and may give "0.1" for 0.1."""
    if value is None:
        if name in ("delta_low", "nnodes"):
            return None
        raise ValueError(f"{name}: must be set, got None")
    target = int if name == "nnodes" else type(default) if default is not None else float
    if target is bool or isinstance(value, bool):
        raise ValueError(f"{name}: expected {target.__name__}, got {value!r}")
    try:
        if target is int:
            as_float = float(value)
            if not as_float.is_integer():
                raise ValueError
            return int(as_float)
        return target(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected {target.__name__}, got {value!r}") from None


def _choice(name: str, value: str, choices: Mapping[str, object] | tuple[str, ...]) -> list[str]:
    return (
        [] if value in choices else [f"{name}: unknown {value!r}; choose from {', '.join(sorted(choices))}"]
    )


def _mask_choice(name: str, value: str, registry: str) -> list[str]:
    """`_choice` among the names of `masks.<registry>` (the built-in ones need no torch)."""
    if mask_names.is_known(registry, value):
        return []
    return [f"{name}: unknown {value!r}; choose from {', '.join(mask_names.known(registry))}"]


def _plugin_choice(name: str, value: str, choices: Mapping[str, object]) -> list[str]:
    """`_choice`, where an installed plugin of that name (pdmctl.plugins) is a choice too (loading registers it)."""
    if value not in choices:
        from pdmctl import plugins

        plugins.load(name, value)
    return _choice(name, value, choices)


def _data_choice(cfg: ToyConfig) -> list[str]:
    """`toy` (the model preset's own task), or a data plugin's task in the layout of the model's."""
    if cfg.data == "toy":
        return []
    from pdmctl import plugins

    loaded = plugins.load("data", cfg.data)
    if loaded is None or loaded.plugin.task is None:
        what = "is not a data set" if loaded is None else f"({loaded.where}) has no task"
        return [f"data: {cfg.data!r} {what} the testbed can train on: toy (the model's own task) or a data "
                "plugin's task"]  # fmt: skip
    model_task = getattr(MODEL_PRESETS.get(cfg.model), "task", "addition")
    if loaded.plugin.base_task != model_task:
        return [f"data: {cfg.data!r} is in the layout of the {loaded.plugin.base_task!r} task, and model "
                f"{cfg.model!r} speaks {model_task!r}'s"]  # fmt: skip
    return []


def _problems(cfg: ToyConfig) -> list[str]:
    """Every invalid value, each as one line that names the field (the first is raised)."""
    found = [
        *_plugin_choice("model", cfg.model, MODEL_PRESETS),
        *_data_choice(cfg),
        *_choice("precision", cfg.precision, PRECISION_NAMES),
        *_mask_choice("method", cfg.method, "METHODS"),
        *_mask_choice("divergence", cfg.divergence, "DIVERGENCES"),
        *_mask_choice("estimator", cfg.estimator, "ESTIMATORS"),
        *_mask_choice("loss_agg_mode", cfg.loss_agg_mode, "AGGREGATIONS"),
    ]
    vocab = MODEL_PRESETS[cfg.model].vocab_size if cfg.model in MODEL_PRESETS else None
    if cfg.k < 1 or (vocab is not None and cfg.k > vocab):
        found.append(f"k: top-K must lie in [1, {vocab}] (the vocabulary), got {cfg.k}")
    positive = ("delta", "ratio_cap", "lr")
    found += [
        f"{name}: must be > 0, got {getattr(cfg, name)}" for name in positive if not getattr(cfg, name) > 0
    ]
    if cfg.delta_low is not None and not cfg.delta_low > 0:
        found.append(f"delta_low: must be > 0 or None, got {cfg.delta_low}")
    found += [
        f"{name}: must be >= 0, got {getattr(cfg, name)}"
        for name in ("eps_low", "eps_high", "grad_clip")
        if not getattr(cfg, name) >= 0
    ]
    at_least_one = (
        "steps",
        "prompts_per_step",
        "minibatches",
        "eval_every",
        "eval_samples",
        "checkpoint_every",
    )
    found += [
        f"{name}: must be >= 1, got {getattr(cfg, name)}" for name in at_least_one if getattr(cfg, name) < 1
    ]
    if cfg.nnodes is not None and not 1 <= cfg.nnodes <= 10**9:
        found.append(f"nnodes: must be an integer >= 1 or null (the profile's nodes), got {cfg.nnodes}")
    if cfg.group_size < 2:
        found.append(f"group_size: GRPO needs at least 2 samples per prompt, got {cfg.group_size}")
    elif cfg.minibatches > cfg.prompts_per_step * cfg.group_size:
        found.append(
            f"minibatches: {cfg.minibatches} exceeds the {cfg.prompts_per_step * cfg.group_size} rollouts per step"
        )
    return found
