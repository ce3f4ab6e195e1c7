"""docs/MATH.md's table of VeRL 0.9.1's defaults that shape every method's update (gradient clip, weight
decay, optimizer, schedule, loss aggregation, clip ratios, epochs) holds VeRL's own values: each row is
read back from the config files of the installed VeRL."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.verl

DOC = Path(__file__).resolve().parent.parent / "docs" / "MATH.md"
HEADING = "### VeRL 0.9.1's defaults that shape every method's update"
# a row (by its first key) -> the VeRL config files and keys whose values its second column states
ROWS = {
    "optim.clip_grad": [("optim/fsdp.yaml", "clip_grad"), ("optim/megatron.yaml", "clip_grad"),
                        ("actor/dp_actor.yaml", "grad_clip")],
    "optim.weight_decay": [("optim/fsdp.yaml", "weight_decay"), ("optim/megatron.yaml", "weight_decay")],
    "optim.optimizer": [("optim/fsdp.yaml", "optimizer"), ("optim/megatron.yaml", "optimizer"),
                        ("optim/fsdp.yaml", "betas"), ("optim/megatron.yaml", "betas")],
    "optim.lr_scheduler_type": [("optim/fsdp.yaml", "lr_scheduler_type"), ("optim/fsdp.yaml", "lr_warmup_steps_ratio"),
                                ("optim/megatron.yaml", "lr_decay_style"),
                                ("optim/megatron.yaml", "lr_warmup_steps_ratio")],
    "loss_agg_mode": [("actor/actor.yaml", "loss_agg_mode")],
    "loss_scale_factor": [("actor/actor.yaml", "loss_scale_factor")],
    "clip_ratio_low": [("actor/actor.yaml", "clip_ratio_low"), ("actor/actor.yaml", "clip_ratio_high")],
    "clip_ratio_c": [("actor/actor.yaml", "clip_ratio_c")],
    "ppo_epochs": [("actor/actor.yaml", "ppo_epochs"), ("actor/actor.yaml", "shuffle")],
    "entropy_coeff": [("actor/actor.yaml", "entropy_coeff"), ("actor/actor.yaml", "use_kl_loss")],
}  # fmt: skip


def verl_config_dir() -> Path:
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("needs the [verl] extra")
    return Path(next(iter(spec.submodule_search_locations))) / "trainer" / "config"


def load(name: str) -> dict:
    return yaml.safe_load((verl_config_dir() / name).read_text(encoding="utf-8"))


def table() -> dict[str, str]:
    """The table's rows: first key of the first column -> the second column."""
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index(HEADING) :].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 3:
            rows[cells[0].split("`")[1]] = cells[1]
    return rows


def rendered(value: object) -> str:
    """A YAML value as the table writes it."""
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str) and value[:1].isupper():
        return value  # a name (AdamW): plain text
    return f"`{value}`"


def test_every_row_of_the_defaults_table_is_checked_and_every_checked_key_has_a_row() -> None:
    assert set(table()) == set(ROWS)


@pytest.mark.parametrize("row", sorted(ROWS))
def test_the_defaults_table_states_verls_own_value(row: str) -> None:
    cell = table()[row]
    for file, key in ROWS[row]:
        value = load(file)[key]
        assert rendered(value) in cell, (row, file, key, value, cell)


def test_the_gradient_clip_weight_decay_and_aggregation_are_verls_1_0_0_01_and_token_mean() -> None:
    assert load("actor/dp_actor.yaml")["grad_clip"] == 1.0
    assert load("optim/fsdp.yaml")["clip_grad"] == load("optim/megatron.yaml")["clip_grad"] == 1.0
    assert load("optim/fsdp.yaml")["weight_decay"] == load("optim/megatron.yaml")["weight_decay"] == 0.01
    assert load("actor/actor.yaml")["loss_agg_mode"] == "token-mean"
