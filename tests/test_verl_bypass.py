"""VeRL's recompute of old log-probs is skipped for pdmctl's losses (`algorithm.rollout_correction.bypass_mode`):
VeRL's own bypass step takes `old_log_probs` from the rollout and the loss stays pdmctl's (verl==0.9.1 on CPU)."""

from __future__ import annotations

import pytest

pytest.importorskip("verl")

import torch
from omegaconf import OmegaConf
from tensordict import TensorDict
from verl import DataProto

from pdmctl.backends.verl import launch, patches

pytestmark = pytest.mark.verl


def _batch(rows: int = 3, length: int = 5) -> DataProto:
    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(rows, length, generator=g, dtype=torch.float32)
    return DataProto(batch=TensorDict({"rollout_log_probs": rollout, "responses": torch.zeros(rows, length)},
                                      batch_size=[rows]))  # fmt: skip


def test_every_paper_setting_skips_the_recompute_and_verl_composes_it() -> None:
    """Each of the four paper settings' commands carries bypass_mode=true, and VeRL's Hydra config takes it."""
    for model, precision in (("qwen3-4b-base", "bf16"), ("qwen3-8b-base", "bf16"),
                             ("qwen3-30b-a3b-base", "fp8_rollout"), ("qwen3-30b-a3b-base", "fp8_e2e")):  # fmt: skip
        run = {"checkpoint_dir": "/ckpt/run", "data_dir": "/data/verl", "seed": 1, "model": model,
               "precision": precision, "method": "pdm", "delta": 0.15, "k": 20}  # fmt: skip
        overrides = launch.verl_overrides(run, environ={})
        assert "algorithm.rollout_correction.bypass_mode=true" in overrides
        config = launch.compose(overrides + launch.ray_env_overrides(launch.job_env(run)))
        assert config.algorithm.rollout_correction.bypass_mode is True
        assert config.actor_rollout_ref.rollout.calculate_log_probs is True  # what the bypass reads


@pytest.mark.parametrize("method", ["grpo", "dppo", "pdm"])
def test_verls_bypass_step_keeps_pdmctls_loss_and_takes_old_log_probs_from_the_rollout(method: str) -> None:
    """VeRL's `apply_bypass_mode`, as its V0 trainer calls it each step, once the plugin's patches are in:
    `old_log_probs` is the rollout's tensor and the loss mode stays pdmctl's (unpatched, VeRL renames it to its
    own `bypass_mode` loss); a loss that is not pdmctl's is left to VeRL."""
    patches._patch_bypass()
    from verl.trainer.ppo import rollout_corr_helper

    batch = _batch()
    loss = OmegaConf.create({"loss_mode": f"pdmctl_{method}"})
    rollout_corr_helper.apply_bypass_mode(batch, OmegaConf.create({"bypass_mode": True}), loss)
    assert batch.batch["old_log_probs"] is batch.batch["rollout_log_probs"]
    assert loss.loss_mode == f"pdmctl_{method}"
    theirs = OmegaConf.create({"loss_mode": "vanilla"})
    rollout_corr_helper.apply_bypass_mode(_batch(), OmegaConf.create({"bypass_mode": True}), theirs)
    assert theirs.loss_mode == "bypass_mode"  # VeRL's own behaviour, untouched for its losses


def test_the_bypass_without_rollout_log_probs_is_one_clear_error() -> None:
    patches._patch_bypass()
    from verl.trainer.ppo import rollout_corr_helper

    empty = DataProto(batch=TensorDict({"responses": torch.zeros(2, 3)}, batch_size=[2]))
    with pytest.raises(ValueError, match=r"^bypass_mode: the batch holds no rollout_log_probs"):
        rollout_corr_helper.apply_bypass_mode(empty, None, OmegaConf.create({"loss_mode": "pdmctl_pdm"}))


def test_the_rollout_gap_the_loss_reports_is_verls_own_figure_on_the_same_log_probs() -> None:
    """With the recompute skipped, VeRL logs no `training/rollout_probs_diff_mean`; the plugin's loss reports
    the same number from its forward: on one batch, equal to VeRL's `calculate_debug_metrics` given that
    forward's log-probs as `old_log_probs` (padding excluded)."""
    from verl.utils.debug.metrics import calculate_debug_metrics

    from pdmctl.backends.verl.plugin import rollout_gap

    g = torch.Generator().manual_seed(3)
    rows, length = 6, 9
    trainer = -3 * torch.rand(rows, length, generator=g, dtype=torch.float64)
    rollout = trainer + 0.3 * torch.randn(rows, length, generator=g, dtype=torch.float64)
    mask = torch.rand(rows, length, generator=g) > 0.3
    theirs = calculate_debug_metrics(DataProto(batch=TensorDict(
        {"rollout_log_probs": rollout, "old_log_probs": trainer, "response_mask": mask.long(),
         "responses": torch.zeros(rows, length)}, batch_size=[rows])))  # fmt: skip
    ours = rollout_gap(trainer, trainer - rollout, mask)
    assert ours["actor/pdmctl/rollout_probs_diff_mean"] == pytest.approx(
        theirs["training/rollout_probs_diff_mean"], rel=1e-6)


def test_backend_skip_old_log_prob_false_keeps_verls_recompute_and_verl_composes_it() -> None:
    """`backend.skip_old_log_prob` (default true) writes VeRL's bypass_mode: false gives VeRL's recompute of the
    old log-probs back (VeRL's Hydra config takes it). The default keeps a run's key as it was before the field
    existed; false is another run (another key); the VeRL key itself is refused, naming the field."""
    from pdmctl.grid import GridError, expand
    from pdmctl.spec import SpecError, run_key

    base = ["backend=verl", "model=qwen3-4b-base", "mask=pdm_agg"]
    (default,) = expand(base, None, "s")
    (skip,) = expand([*base, "backend.skip_old_log_prob=true"], None, "s")
    (recompute,) = expand([*base, "backend.skip_old_log_prob=false"], None, "s")
    assert default.config["backend"]["skip_old_log_prob"] is True and skip.key == default.key
    before = {**default.config, "backend": {k: v for k, v in default.config["backend"].items()
                                            if k != "skip_old_log_prob"}}  # fmt: skip
    assert run_key(before) == default.key
    assert recompute.config["backend"]["skip_old_log_prob"] is False and recompute.key != default.key
    run = {"checkpoint_dir": "/ckpt/run", "data_dir": "/data/verl", "model": "qwen3-4b-base", "method": "pdm",
           "skip_old_log_prob": False}  # fmt: skip
    overrides = launch.verl_overrides(run, environ={})
    assert "algorithm.rollout_correction.bypass_mode=false" in overrides
    config = launch.compose(overrides + launch.ray_env_overrides(launch.job_env(run)))
    assert config.algorithm.rollout_correction.bypass_mode is False
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode == "pdmctl_pdm"
    with pytest.raises((GridError, SpecError), match=r"pdmctl sets it from backend\.skip_old_log_prob"):
        expand([*base, "verl.algorithm.rollout_correction.bypass_mode=false"], None, "s")
    with pytest.raises((GridError, SpecError), match=r"^backend\.skip_old_log_prob: must be true or false \(false: "
                       r"VeRL recomputes the old log-probs, which no loss of pdmctl's reads\), got 'maybe'$"):
        expand([*base, "backend.skip_old_log_prob=maybe"], None, "s")


def test_the_dry_run_counts_the_recompute_forward_only_with_skip_old_log_prob_false(tmp_path) -> None:
    """The same run's dry-run cost with the skip (the default) and without, in one grid: only the training part
    differs, by the model's stated share of the old-log-prob forward, and the cost line says which the command does."""
    import json

    from pdmctl.budget import cost
    from tests.conftest import pdmctl

    result = pdmctl("sweep", "backend=verl", "model=qwen3-30b-a3b-base", "precision=fp8_e2e",
                    "backend.skip_old_log_prob=true,false", "--dry-run", "--offline", "--json", "--cluster", "h20",
                    cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    plans = {r["config"]["backend"]["skip_old_log_prob"]: r["cost"] for r in json.loads(result.stdout)["runs"]}
    on, off = plans[True], plans[False]
    share = cost.ASSUMPTIONS["qwen3-30b-a3b-base"].log_prob_share
    assert off["parts_s"]["train"] == pytest.approx(on["parts_s"]["train"] * (1 + share), rel=1e-3)
    assert {k: v for k, v in on["parts_s"].items() if k != "train"} == {
        k: v for k, v in off["parts_s"].items() if k != "train"}  # fmt: skip
    assert off["expected"] > on["expected"]
    assert "no recompute forward" in on["assumptions"]
    assert "old log-probs recomputed by a forward each step" in off["assumptions"]
