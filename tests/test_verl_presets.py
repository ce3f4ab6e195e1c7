"""The paper's settings in one reviewed place: docs/CLUSTER.md's preset table, held against VeRL's own config.

Each of paper-main's four settings is composed as `main_ppo` composes it (VeRL 0.9.1's Hydra config) and its
actor, rollout and engine sections are built as VeRL builds them (its dataclasses); every row of the table
is read back from the result (or the job's environment) and compared with the table's value, every key is
checked against VeRL's config schema, and every key a preset sets must have a row.
"""

from __future__ import annotations

import math
import re
from functools import cache
from pathlib import Path

import pytest

pytest.importorskip("verl")

import yaml
from omegaconf import OmegaConf
from verl.utils.config import omega_conf_to_dataclass

from pdmctl.backends.verl import launch, schema

pytestmark = pytest.mark.verl

DOC = Path(__file__).resolve().parent.parent / "docs" / "CLUSTER.md"
SEED = 3
SETTINGS = {"4B": ("qwen3-4b-base", "bf16"), "8B": ("qwen3-8b-base", "bf16"),
            "30B-R": ("qwen3-30b-a3b-base", "fp8_rollout"), "30B-E2E": ("qwen3-30b-a3b-base", "fp8_e2e")}  # fmt: skip
GROUPS = {"all": list(SETTINGS), "30B": ["30B-R", "30B-E2E"]}
# keys a run's identity, paths, mask or cluster set, not its preset (the table is the presets' values)
NOT_PRESET = {"data.train_files", "data.val_files", "actor_rollout_ref.model.path", "actor_rollout_ref.model.external_lib",
              "actor_rollout_ref.actor.policy_loss._target_", "actor_rollout_ref.actor.policy_loss.loss_mode",
              "actor_rollout_ref.actor.policy_loss.delta_low", "actor_rollout_ref.actor.policy_loss.divergence",
              "actor_rollout_ref.actor.policy_loss.estimator", "trainer.logger", "trainer.project_name",
              "trainer.experiment_name", "trainer.default_local_dir", "trainer.resume_mode", "trainer.use_v1",
              "actor_rollout_ref.nccl_timeout"}  # fmt: skip
ROW = re.compile(r"^\| ([^|]+) \| `([^`]+)` \| `([^`]+)` \| (.+) \|$")


def table() -> list[tuple[list[str], str, object, str]]:
    """(settings, key, value, source) for each row of the preset table."""
    text = DOC.read_text()
    body = text.split("<!-- preset-table", 1)[1].split("<!-- end preset-table -->", 1)[0]
    rows = []
    for line in body.splitlines():
        found = ROW.match(line.strip())
        if not found:
            continue
        applies, key, value, source = found.groups()
        names = [n for part in applies.split(",") for n in GROUPS.get(part.strip(), [part.strip()])]
        assert set(names) <= set(SETTINGS), f"{line}: unknown setting"
        assert source.strip(), f"{line}: no source"
        rows.append((names, key, yaml.safe_load(value.replace("{seed}", str(SEED))), source))
    return rows


@cache
def composed(name: str):
    model, precision = SETTINGS[name]
    run = {"checkpoint_dir": "/ckpt/run", "data_dir": "/data/verl", "seed": SEED, "model": model,
           "precision": precision, "method": "pdm", "delta": 0.15, "k": 20}  # fmt: skip
    overrides = launch.verl_overrides(run, environ={})
    env = launch.job_env(run)
    config = launch.compose(overrides + launch.ray_env_overrides(env))
    return overrides, env, config


def test_the_table_covers_every_setting_and_has_a_source_for_each_row() -> None:
    rows = table()
    assert len(rows) > 60
    keys = [(name, key) for names, key, _, _ in rows for name in names]
    assert len(keys) == len(set(keys)), "a key twice for one setting"
    unsourced = [key for _, key, _, source in rows
                 if source.split()[0].strip("(,:") not in {"paper", "DPPO", "DAPO", "FP8", "VeRL", "pdmctl"}]
    assert not unsourced, f"rows whose source is none of paper, DPPO, DAPO, FP8, VeRL, pdmctl: {unsourced}"


@pytest.mark.parametrize("name", list(SETTINGS))
def test_each_preset_value_composes_against_verls_schema_and_reads_back(name: str) -> None:
    overrides, env, config = composed(name)
    engine = "megatron" if config.model_engine == "megatron" else "dp"
    # VeRL builds these as its dataclasses: a key they do not take, or a value of the wrong type, fails here
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
    rows = [(key, value) for names, key, value, _ in table() if name in names]
    for key, value in rows:
        if key.startswith("env:"):
            assert env.get(key.removeprefix("env:")) == value, (name, key)
            continue
        if key != "model_engine" and not key.startswith("actor_rollout_ref.actor.policy_loss."):  # pdmctl's loss
            schema.check(key, value, engine)  # the key is VeRL's (declared, or in a mapping it leaves open)
        got = OmegaConf.select(config, key, throw_on_missing=True)
        if isinstance(value, float) or isinstance(got, float):
            assert math.isclose(float(got), float(value)), (name, key, got, value)
        else:
            assert got == value, (name, key, got, value)
    set_keys = {o.split("=", 1)[0].lstrip("+") for o in overrides} - NOT_PRESET
    missing = sorted(set_keys - {key for key, _ in rows})
    assert not missing, f"{name}: the preset sets {missing} and the table has no row for them"
    if name.startswith("30B"):  # the engine both 30B settings train on, as VeRL instantiates it
        assert type(actor).__name__ == "McoreActorConfig" and actor.megatron.expert_tensor_parallel_size == 1
        assert actor.megatron.param_offload and actor.megatron.optimizer_offload and actor.megatron.seed == SEED


def test_fsdp_stays_selectable_for_the_fp8_rollout_setting() -> None:
    run = {"checkpoint_dir": "/ckpt/run", "data_dir": "/data/verl", "seed": SEED, "model": "qwen3-30b-a3b-base",
           "precision": "fp8_rollout", "strategy": "fsdp2"}  # fmt: skip
    config = launch.compose(launch.verl_overrides(run, environ={}))
    assert config.actor_rollout_ref.actor.strategy == "fsdp2" and config.actor_rollout_ref.rollout.seed == SEED
    assert launch.setting(run) == "qwen3-30b-a3b-base fp8_rollout on fsdp2"
    assert launch.setting({**run, "strategy": None}) == "qwen3-30b-a3b-base fp8_rollout on megatron"
    with pytest.raises(launch.LaunchConfigError, match="fp8_e2e needs strategy=megatron"):
        launch.verl_overrides({**run, "precision": "fp8_e2e"}, environ={})
