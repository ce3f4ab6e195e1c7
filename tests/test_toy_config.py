"""ToyConfig: the defaults are a valid run, and every bad value is one clear error before any work."""

from __future__ import annotations

import dataclasses

import pytest

from pdmctl.backends.toy import MODEL_PRESETS, ToyConfig, train
from pdmctl.backends.toy.model import VOCAB_SIZE


def test_defaults_are_the_default_config() -> None:
    assert ToyConfig.from_mapping({}) == ToyConfig()
    assert ToyConfig().model in MODEL_PRESETS
    assert ToyConfig().eval_samples == 16


def test_the_testbed_default_is_the_config_tree_default() -> None:
    """One set of defaults: `pdmctl sweep` and `pdmctl analyze` (the config tree) and ToyConfig()
    (bench/testbed.py, the tests) describe the same run, δ included (it was 0.15 against 0.05)."""
    from pdmctl import grid
    from pdmctl.backends.registry import flat_config

    (spec,) = grid.expand([], sweep="defaults")
    assert ToyConfig.from_mapping(flat_config(spec.config)) == ToyConfig()


def test_from_mapping_coerces_plain_values() -> None:
    cfg = ToyConfig.from_mapping({"k": 50.0, "delta": 1, "lr": "3e-4", "delta_low": None, "method": "grpo"})
    assert (cfg.k, cfg.delta, cfg.lr, cfg.delta_low, cfg.method) == (50, 1.0, 3e-4, None, "grpo")
    assert isinstance(cfg.k, int) and isinstance(cfg.delta, float)


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"k": 0}, "k"),
        ({"k": VOCAB_SIZE + 1}, "k"),
        ({"precision": "fp4"}, "precision"),
        ({"method": "ppo2"}, "method"),
        ({"divergence": "js"}, "divergence"),
        ({"estimator": "median"}, "estimator"),
        ({"loss_agg_mode": "sum"}, "loss_agg_mode"),
        ({"model": "gpt-5"}, "model"),
        ({"group_size": 1}, "group_size"),
        ({"delta": 0.0}, "delta"),
        ({"delta_low": -0.1}, "delta_low"),
        ({"steps": 0}, "steps"),
        ({"minibatches": 0}, "minibatches"),
        ({"lr": -1.0}, "lr"),
        ({"k": 2.5}, "k"),
        ({"k": "many"}, "k"),
        ({"seed": True}, "seed"),
        ({"gamma": 0.99}, "gamma"),
    ],
)
def test_bad_values_name_the_field(values: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}: ") as caught:
        ToyConfig.from_mapping(values)
    assert "\n" not in str(caught.value)


def test_direct_construction_is_validated_too() -> None:
    with pytest.raises(ValueError, match=r"^k: "):
        ToyConfig(k=0)
    with pytest.raises(ValueError, match=r"^group_size: "):
        dataclasses.replace(ToyConfig(), group_size=1)


def test_bad_config_fails_before_any_work(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"^precision: "):
        train(ToyConfig.from_mapping({"precision": "int3"}), tmp_path / "run", tracker=None)
    assert not (tmp_path / "run").exists()
