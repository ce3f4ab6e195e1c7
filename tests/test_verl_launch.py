"""Run configs -> VeRL Hydra overrides that compose, the job command, metric names, the fail-fast check."""

from __future__ import annotations

import itertools
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("verl")

from omegaconf import OmegaConf
from verl.utils.config import omega_conf_to_dataclass

from pdmctl import masks
from pdmctl.backends.verl import jobbody, launch, metrics, patches, plugin, topk
from tests.conftest import pdmctl

pytestmark = pytest.mark.verl

BASE = {
    "checkpoint_dir": "/ckpt/run-1", "data_dir": "/data/verl", "tracking_uri": "sqlite:////tmp/ledger.db",
    "mlflow_run_id": "0123abcd", "experiment": "pdm-sweep", "seed": 3,
}  # fmt: skip


def test_every_model_precision_and_mask_composes() -> None:
    for model, precision, method in itertools.product(launch.MODEL_PRESETS, launch.PRECISIONS, masks.METHODS):
        run = {**BASE, "model": model, "precision": precision, "method": method}
        config = launch.compose(launch.verl_overrides(run) + launch.ray_env_overrides(launch.job_env(run)))
        actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
        assert isinstance(actor.policy_loss, plugin.PdmPolicyLossConfig), (model, precision, method)
        assert actor.policy_loss.loss_mode == f"pdmctl_{method}"
        assert config.actor_rollout_ref.rollout.val_kwargs.n == 16
        assert config.trainer.default_local_dir == "/ckpt/run-1"
        assert config.trainer.resume_mode == "auto"
        if precision != "bf16":
            assert config.actor_rollout_ref.rollout.quantization == "fp8"
        if precision == "fp8_e2e":
            assert config.actor_rollout_ref.actor.strategy == "megatron"
            tf = config.actor_rollout_ref.actor.megatron.override_transformer_config
            assert tf.fp8_recipe == "blockwise"


def test_the_gpu_tiny_preset_is_the_tiny_model_on_cuda(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """What scripts/gpu-check.sh runs first: qwen3-tiny's model, data and batch shape, none of the CPU
    settings, and as many GPUs per node as PDMCTL_GPUS_PER_NODE says (8, an H20 node, by default)."""
    monkeypatch.setenv(launch.TINY_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(launch.GPUS_ENV, raising=False)
    cpu_run, gpu_run = ({**BASE, "model": m, "k": 5} for m in ("qwen3-tiny", "qwen3-tiny-gpu"))
    cpu_cfg, gpu_cfg = launch.compose(launch.verl_overrides(cpu_run)), launch.compose(launch.verl_overrides(gpu_run))
    assert cpu_cfg.trainer.device == "cpu" and gpu_cfg.trainer.device == "cuda"
    assert gpu_cfg.actor_rollout_ref.model.path == cpu_cfg.actor_rollout_ref.model.path
    assert gpu_cfg.data.train_files == cpu_cfg.data.train_files
    assert gpu_cfg.actor_rollout_ref.actor.optim.lr == cpu_cfg.actor_rollout_ref.actor.optim.lr == 1e-2
    assert (cpu_cfg.trainer.n_gpus_per_node, gpu_cfg.trainer.n_gpus_per_node) == (1, 8)
    modules = {run["model"]: launch.job_env(run)["VERL_USE_EXTERNAL_MODULES"] for run in (cpu_run, gpu_run)}
    assert launch.CPU_MODULE in modules["qwen3-tiny"] and launch.CPU_MODULE not in modules["qwen3-tiny-gpu"]
    monkeypatch.setenv(launch.GPUS_ENV, "1")
    assert launch.compose(launch.verl_overrides(gpu_run)).trainer.n_gpus_per_node == 1
    monkeypatch.setenv(launch.GPUS_ENV, "one")
    with pytest.raises(launch.LaunchConfigError, match="PDMCTL_GPUS_PER_NODE: must be a whole number"):
        launch.verl_overrides(gpu_run)


def test_the_v1_trainer_is_chosen_by_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """V0 (VeRL's DataProto trainer) unless PDMCTL_VERL_TRAINER=v1; on CPU V1 gets one TransferQueue
    storage unit (8 deadlock 2 cores); the choice reaches the job's environment; a bad value is one
    line naming the variable."""
    monkeypatch.setenv(launch.TINY_DIR_ENV, str(tmp_path))
    run = {**BASE, "model": "qwen3-tiny", "k": 5}
    monkeypatch.delenv(launch.TRAINER_ENV, raising=False)
    v0 = launch.compose(launch.verl_overrides(run))
    assert v0.trainer.use_v1 is False and v0.transfer_queue.backend.SimpleStorage.num_data_storage_units == 8
    monkeypatch.setenv(launch.TRAINER_ENV, "V1")
    v1 = launch.compose(launch.verl_overrides(run))
    assert v1.trainer.use_v1 is True and v1.transfer_queue.backend.SimpleStorage.num_data_storage_units == 1
    assert launch.job_env(run)[launch.TRAINER_ENV] == "V1"
    gpu = launch.compose(launch.verl_overrides({**run, "model": "qwen3-4b-base"}))
    assert gpu.trainer.use_v1 is True and gpu.transfer_queue.backend.SimpleStorage.num_data_storage_units == 8
    monkeypatch.setenv(launch.TRAINER_ENV, "v2")
    with pytest.raises(launch.LaunchConfigError, match=r"^PDMCTL_VERL_TRAINER: must be v0 or v1, got 'v2'$"):
        launch.verl_overrides(run)
    # at the command line: one line, exit 2, nothing written
    res = pdmctl("sweep", "backend=verl", "model=qwen3-tiny", cwd=tmp_path, env={launch.TRAINER_ENV: "v2"})
    assert res.returncode == 2 and res.stderr.strip() == "error: PDMCTL_VERL_TRAINER: must be v0 or v1, got 'v2'"
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "pdmctl-runs").exists()


def test_mask_values_reach_the_config() -> None:
    """...and the run's own VeRL keys: a declared one, one in a mapping VeRL leaves open (Hydra's
    `+`), one pdmctl also sets (the run's wins, the token budget follows), and val_before_train."""
    own = {"actor_rollout_ref.rollout.gpu_memory_utilization": 0.85,
           "actor_rollout_ref.rollout.engine_kwargs.vllm.enforce_eager": True, "data.max_response_length": 4096}  # fmt: skip
    run = {**BASE, "model": "qwen3-8b-base", "method": "pdm", "divergence": "topk_tv", "estimator": "exact",
           "delta": 0.2, "delta_low": 0.1, "k": 50, "eps_low": 0.2, "eps_high": 0.28, "ratio_cap": 5.0,
           "verl": own, "val_before_train": False}  # fmt: skip
    config = launch.compose(launch.verl_overrides(run))
    rollout = config.actor_rollout_ref.rollout
    assert rollout.gpu_memory_utilization == 0.85 and rollout.engine_kwargs.vllm.enforce_eager is True
    assert config.data.max_response_length == 4096 and config.actor_rollout_ref.actor.ppo_max_token_len_per_gpu == 2048 + 4096
    assert config.trainer.val_before_train is False
    loss = config.actor_rollout_ref.actor.policy_loss
    assert (loss.divergence, loss.estimator, loss.delta, loss.delta_low, loss.topk) == (
        "topk_tv",
        "exact",
        0.2,
        0.1,
        50,
    )
    assert config.actor_rollout_ref.actor.clip_ratio_c == 5.0
    assert config.actor_rollout_ref.rollout.engine_kwargs.vllm.max_logprobs == 50  # K > 20 raises vLLM's cap
    assert config.actor_rollout_ref.actor.optim.lr == 1e-6
    assert config.actor_rollout_ref.model.use_fused_kernels is False


def test_mlflow_run_identity_reaches_ray_workers() -> None:
    run = {**BASE, "model": "qwen3-4b-base"}
    config = launch.compose(launch.verl_overrides(run) + launch.ray_env_overrides(launch.job_env(run)))
    env = config.ray_kwargs.ray_init.runtime_env.env_vars
    assert env.MLFLOW_RUN_ID == "0123abcd" and env.MLFLOW_TRACKING_URI == "sqlite:////tmp/ledger.db"
    assert env.PDMCTL_VERL_TOPK == "20" and env.VERL_USE_EXTERNAL_MODULES == launch.PLUGIN_MODULE
    assert "mlflow" in config.trainer.logger
    # the TaskRunner logs through the run's spool, beside its checkpoints
    spool = env.PDMCTL_SPOOL_DIR
    assert spool == str(Path(run["checkpoint_dir"]).parent / "spool")


def test_bad_run_configs_fail_with_one_clear_line() -> None:
    with pytest.raises(launch.LaunchConfigError, match="model"):
        launch.verl_overrides({**BASE, "model": "llama"})
    with pytest.raises(launch.LaunchConfigError, match="absolute"):
        launch.verl_overrides({**BASE, "model": "qwen3-4b-base", "checkpoint_dir": "ckpt"})
    with pytest.raises(launch.LaunchConfigError, match="megatron"):
        launch.verl_overrides({**BASE, "model": "qwen3-4b-base", "precision": "fp8_e2e", "strategy": "fsdp2"})


def test_job_command_is_valid_bash_and_carries_the_overrides() -> None:
    cmd = jobbody.build_job_command({**BASE, "model": "qwen3-30b-a3b-base"}, python="/venv/bin/python")
    assert cmd[0] == "env" and "PDMCTL_PYTHON=/venv/bin/python" in cmd and "MLFLOW_RUN_ID=0123abcd" in cmd
    body = cmd[cmd.index("-c") + 1]
    subprocess.run(["bash", "-n", "-c", body], check=True)
    assert "mapfile -t NODES" in body and 'NODES=("$nodes")' not in body
    assert "trainer.nnodes=4" in cmd


def test_metric_mapping() -> None:
    assert metrics.pdmctl_metric_name("val-core/aime24/acc/mean@16") == "eval/aime24"
    assert metrics.pdmctl_metric_name("val-core/aime25/acc/mean_at_16") == "eval/aime25"
    assert metrics.pdmctl_metric_name("val-core/aime25/reward/mean@16") is None
    assert metrics.map_metrics({"actor/pdmctl/mask_frac": 0.1, "timing/gen": 3.0}) == {"train/mask_frac": 0.1}


def _config(precision: str = "bf16", strategy: str | None = None, **changes: object):
    run = {**BASE, "model": "qwen3-4b-base", "precision": precision, "strategy": strategy}
    config = launch.compose(launch.verl_overrides(run))
    for key, value in changes.items():
        OmegaConf.update(config, key, value, force_add=True)
    return config


def test_fail_fast_accepts_a_generated_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(topk.TOPK_ENV, "20")
    plugin.check_run_config(_config())


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"actor_rollout_ref.actor.policy_loss.loss_mode": "pdmctl_nope"}, "not registered"),
        (
            {"actor_rollout_ref.actor.policy_loss._target_": "verl.workers.config.PolicyLossConfig"},
            "_target_",
        ),
        ({"actor_rollout_ref.actor.policy_loss.divergence": "nope"}, "divergence"),
        ({"actor_rollout_ref.model.use_fused_kernels": True}, "fused"),
        ({"actor_rollout_ref.rollout.calculate_log_probs": False}, "calculate_log_probs"),
        ({"actor_rollout_ref.actor.strategy": "veomni"}, "FSDP and Megatron"),
        ({"actor_rollout_ref.actor.pad_to_length": True}, "pad_to_length"),
    ],
)
def test_fail_fast_rejects(monkeypatch: pytest.MonkeyPatch, changes: dict, message: str) -> None:
    monkeypatch.setenv(topk.TOPK_ENV, "20")
    with pytest.raises((plugin.PluginCheckError, ValueError), match=message):
        plugin.check_run_config(_config(strategy="fsdp2", **changes))


def test_fail_fast_takes_the_v1_trainer_only_where_transferqueue_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(topk.TOPK_ENV, "20")
    config = _config(**{"trainer.use_v1": True})
    if patches.v1_available():  # the engine environment installs TransferQueue
        plugin.check_run_config(config)
    else:
        with pytest.raises(plugin.PluginCheckError, match=r"V1 trainer needs TransferQueue==0\.1\.11"):
            plugin.check_run_config(config)


def test_fail_fast_accepts_megatron_fp8_e2e(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(topk.TOPK_ENV, "20")
    config = _config("fp8_e2e")
    assert config.actor_rollout_ref.actor.strategy == "megatron"
    plugin.check_run_config(config)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"actor_rollout_ref.actor.megatron.dynamic_context_parallel": True}, "dynamic context"),
        ({"actor_rollout_ref.actor.megatron.use_remove_padding": False}, "THD"),
        ({"actor_rollout_ref.actor.megatron.pad_to_length": True}, "pad_to_length"),
    ],
)
def test_fail_fast_rejects_megatron_layouts_the_mask_cannot_map(
    monkeypatch: pytest.MonkeyPatch, changes: dict, message: str
) -> None:
    monkeypatch.setenv(topk.TOPK_ENV, "20")
    with pytest.raises(plugin.PluginCheckError, match=message):
        plugin.check_run_config(_config("fp8_e2e", **changes))


def test_fail_fast_rejects_a_worker_env_without_top_k(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(topk.TOPK_ENV, raising=False)
    with pytest.raises(plugin.PluginCheckError, match=topk.TOPK_ENV):
        plugin.check_run_config(_config())


def test_plugin_loads_through_the_entry_point_in_a_fresh_interpreter() -> None:
    code = (
        "import verl\nfrom verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R\n"
        "print(sorted(k for k in R if k.startswith('pdmctl_')))"
    )
    import sys

    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == str(sorted(f"pdmctl_{m}" for m in masks.METHODS))


HOSTILE_VALUES = [
    "/d/a,b",
    "/d/it's",
    "/d/x]y[z",
    "/d/$(touch /tmp/pwned)",
    "/d/${oc.env:HOME}",
    "/d/back\\slash\\",
]


@pytest.mark.parametrize("value", HOSTILE_VALUES)
def test_free_form_values_reach_verl_exactly(value: str) -> None:
    """Paths and names are quoted so that Hydra and OmegaConf read back exactly what the user gave."""
    run = {**BASE, "model": "qwen3-4b-base", "data_dir": value, "checkpoint_dir": value + "/ckpt",
           "experiment": value, "tracking_uri": "sqlite:///" + value}  # fmt: skip
    config = launch.compose(launch.verl_overrides(run) + launch.ray_env_overrides(launch.job_env(run)))
    assert config.data.train_files == f"{value}/{launch.TRAIN_FILE}"
    assert list(config.data.val_files) == [f"{value}/{name}" for name in launch.VAL_FILES]
    assert config.trainer.default_local_dir == value + "/ckpt" and config.trainer.project_name == value
    tracking_uri = config.ray_kwargs.ray_init.runtime_env.env_vars.MLFLOW_TRACKING_URI
    assert tracking_uri == f"sqlite:///{value}"


def test_quoted_round_trips_any_text() -> None:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from pdmctl.backends.verl.quoting import OverrideError, check_overrides, quoted

    parser = OverridesParser.create()

    @settings(max_examples=500, deadline=None)
    @given(st.text().filter(lambda text: text != "???"))
    def round_trip(text: str) -> None:
        parsed = parser.parse_override("key=" + quoted(text)).value()
        assert OmegaConf.create({"key": parsed}).key == text
        check_overrides(["key=" + quoted(text)])

    round_trip()
    # the one text no quoting carries: OmegaConf reads it as a missing mandatory value; refused at submit
    with pytest.raises(OverrideError, match="missing value"):
        check_overrides(["data.train_files=" + quoted("???")])


def test_a_value_hydra_would_read_as_a_sweep_is_refused_at_submit(tmp_path) -> None:
    """`backend.lr=1,2` reaches VeRL unquoted as a number field: refused by `pdmctl sweep`, exit 2."""
    import sys

    def sweep(*overrides: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pdmctl.cli", "sweep", "backend=verl", "model=qwen3-4b-base",
                               "backend.nnodes=1", *overrides, "--dry-run"], cwd=tmp_path, capture_output=True, text=True, timeout=300)  # fmt: skip

    accepted = sweep('backend.data_dir="/d/a,b"')
    assert accepted.returncode == 0, accepted.stderr
    refused = sweep('backend.lr="1e-6,2e-6"')
    # refused in one line naming the field: as a sweep value, or (VeRL installed) against VeRL's own schema
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "backend.lr" in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written


DATA = Path(__file__).parent / "data"


def test_a_validation_line_verl_prints_gives_the_trial_its_evaluation() -> None:
    """The lines are VeRL 0.9.1's own console output from an engine job on the CI's SLURM:
    step 0's validation (val-core avg@16 of both held-out sets) and a training step (no validation)."""
    validation = (DATA / "verl_step0_validation_line.txt").read_text()
    training = (DATA / "verl_step1_training_line.txt").read_text()
    assert metrics.evaluation_from_line(validation) == (0, {"eval/aime24": 0.26171875, "eval/aime25": 0.14453125})
    assert metrics.evaluation_from_line(training) is None
    assert metrics.evaluation_from_line("step:3 - val-core/other/acc/mean@16:0.5") is None  # not a held-out set
    assert metrics.evaluation_from_line("val-core/aime24/acc/mean@16:0.5") is None  # no step
    assert launch.final_step({"model": "qwen3-tiny"}) == 3
    assert launch.final_step({"model": "qwen3-tiny", "total_training_steps": 5}) == 5
    assert launch.final_step({"model": "qwen3-4b-base"}) == launch.PAPER_STEPS  # fixed per model (DAPO: 300)
    assert launch.final_step({"model": "qwen3-tiny-gpu", "total_training_steps": None}) == 3


def test_an_exception_from_the_line_hook_ends_the_trainer_and_propagates(tmp_path) -> None:
    """How a pruned trial stops VeRL: the hook raises on a line, the trainer process is ended
    (not waited for), the exception reaches the job."""
    import sys
    import time

    script = tmp_path / "trainer.py"
    script.write_text("import time\nfor i in range(600):\n    print(f'step:{i} - x:1', flush=True)\n    time.sleep(0.1)\n")
    seen = []

    class Stop(Exception):
        pass

    def hook(line: str) -> None:
        seen.append(line)
        if line.startswith("step:3 "):
            raise Stop(line)

    started = time.monotonic()
    with pytest.raises(Stop):
        jobbody._run_trainer([sys.executable, str(script)], {}, hook)
    assert time.monotonic() - started < 30  # the 60 s script was ended, not waited for
    assert [line.split()[0] for line in seen] == ["step:0", "step:1", "step:2", "step:3"]


def test_a_trainer_that_prints_nothing_for_too_long_is_ended_as_hung(tmp_path, monkeypatch) -> None:
    """A worker that dies inside a collective (the weight sync) leaves the trainer waiting for ever:
    no progress past PDMCTL_ENGINE_STALL_S ends it, with the reason and the last error line it printed
    (tests/test_verl_watchdog.py: progress, not prints)."""
    import sys
    import time

    script = tmp_path / "hung.py"
    script.write_text("import time\nprint('RuntimeError: a worker died', flush=True)\ntime.sleep(600)\n")
    started = time.monotonic()
    with pytest.raises(jobbody.EngineJobError, match=r"made no progress for 2 s .*RuntimeError: a worker died"):
        jobbody._run_trainer([sys.executable, str(script)], {}, stall_s=2)
    assert time.monotonic() - started < 40
    failing = tmp_path / "failing.py"
    failing.write_text("print('step:0 - x:1')\nprint('ValueError: bad batch')\nraise SystemExit(3)\n")
    with pytest.raises(jobbody.EngineJobError, match=r"^ValueError: bad batch$"):
        jobbody._run_trainer([sys.executable, str(failing)], {}, stall_s=60)
    monkeypatch.setenv(jobbody.STALL_ENV, "soon")
    with pytest.raises(launch.LaunchConfigError, match="PDMCTL_ENGINE_STALL_S: must be a number of seconds > 0"):
        jobbody.stall_seconds()
    monkeypatch.setenv(jobbody.STALL_ENV, "90")
    assert jobbody.stall_seconds() == 90.0


def test_each_backend_names_the_final_step_a_tune_trial_never_prunes() -> None:
    from pdmctl.backends.registry import get_backend

    assert get_backend("verl").final_step({"model": "qwen3-tiny", "total_training_steps": None}) == 3
    assert get_backend("toy").final_step({"steps": 40}) == 40
    assert get_backend("synthetic").final_step({"steps": 9}) == 9


# --- every VeRL key settable from a grid, every unknown key refused --------------------------


def _overrides(spec) -> list[str]:
    from pdmctl.backends.registry import _verl_job_config, flat_config

    return launch.verl_overrides(_verl_job_config(flat_config(spec.config), Path("/runs/r")))


def test_a_verl_key_from_the_grid_reaches_the_command_and_the_run_key(tmp_path: Path) -> None:
    from pdmctl.grid import expand, load_sweep_file

    base = ["backend=verl", "model=qwen3-4b-base"]
    specs = expand([*base, "verl.actor_rollout_ref.rollout.gpu_memory_utilization=0.8,0.9"], None, "s")
    (plain,) = expand(base, None, "s")
    assert len({plain.key, *(s.key for s in specs)}) == 3
    for spec, value in zip(specs, (0.8, 0.9), strict=True):
        assert spec.config["backend"]["verl"] == {"actor_rollout_ref.rollout.gpu_memory_utilization": value}
        assert f"actor_rollout_ref.rollout.gpu_memory_utilization={value}" in _overrides(spec)
    (added,) = expand([*base, "+verl.actor_rollout_ref.rollout.gpu_memory_utilization=0.8"], None, "s")
    assert added.key == specs[0].key  # `+` or not, the same setting
    (fields,) = expand([*base, "verl.data.max_response_length=4096", "backend.val_before_train=false",
                        "verl.actor_rollout_ref.rollout.engine_kwargs.vllm.enforce_eager=true"], None, "s")  # fmt: skip
    overrides = _overrides(fields)
    assert "data.max_response_length=4096" in overrides and "data.max_response_length=8192" not in overrides
    assert "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=6144" in overrides  # the budget follows
    assert "trainer.val_before_train=false" in overrides
    assert "+actor_rollout_ref.rollout.engine_kwargs.vllm.enforce_eager=true" in overrides  # not in VeRL's yaml: +
    sweep = tmp_path / "s.yaml"  # a sweep file's settings, and `~` on the command line over them
    sweep.write_text("grid: {backend: verl, model: qwen3-4b-base}\n"
                     "settings: [{verl.actor_rollout_ref.rollout.gpu_memory_utilization: 0.8}]\n")  # fmt: skip
    assert [s.key for s in expand([], load_sweep_file(str(sweep)), "s")] == [specs[0].key]
    key = "verl.actor_rollout_ref.rollout.gpu_memory_utilization"
    assert [s.key for s in expand([f"~{key}"], load_sweep_file(str(sweep)), "s")] == [plain.key]


@pytest.mark.parametrize(
    ("override", "message"),
    [("+backend.gpu_memory_utilization=0.8", r"^backend\.gpu_memory_utilization: not a field of backend verl "
      r"\(its fields: .*\); a VeRL config key is set as verl\.<key>, e\.g\. "
      r"verl\.actor_rollout_ref\.rollout\.gpu_memory_utilization=0\.8$"),
     ("verl.actor_rollout_ref.rollout.gpu_memory_utilisation=0.8", r"^verl\.actor_rollout_ref\.rollout\."
      r"gpu_memory_utilisation: not in VeRL's config \(RolloutConfig has no field 'gpu_memory_utilisation'; "
      r"did you mean 'gpu_memory_utilization'\?\)$"),
     ("verl.actor_rollout_ref.rollout.gpu_memory_utilization=most", r"'most' does not fit VeRL's "
      r"RolloutConfig\.gpu_memory_utilization \(Value 'most' of type 'str' could not be converted to Float\)"),
     ("verl.trainer.balance_batch=maybe", r"^verl\.trainer\.balance_batch: must be true or false \(VeRL's "
      r"default is True\), got 'maybe'$"),
     ("verl.trainer.blance_batch=true", r"VeRL's config has no trainer\.blance_batch; did you mean 'balance_batch'"),
     ("verl.actor_rollout_ref.actor.optim.lr=1e-5", r"^verl\.actor_rollout_ref\.actor\.optim\.lr: pdmctl sets "
      r"it from backend\.lr; set that instead$"),
     ("verl.trainer.val_before_train=false", r"pdmctl sets it from backend\.val_before_train"),
     ("verl.actor_rollout_ref.actor.policy_loss.loss_mode=vanilla", r"from mask, delta, delta_low and k"),
     ("verl.trainer={total_epochs:2}", r"^verl\.trainer: pdmctl sets trainer\.use_v1 from "),
     ("verl.actor_rollout_ref.actor.fsdp_config.param_offload=true", r"a key of VeRL's dp engine, "
      r"and this run trains on megatron \(backend\.strategy=fsdp2 changes it\)"),
     ("+backend.verl.trainer.balance_batch=false", r"set verl's own keys one by one, as verl\.<key>=<value>"),
     ("verl=5", r"^verl: give the key, as verl\.<key>=<value>$")],
)  # fmt: skip
def test_a_key_verl_would_not_take_is_refused_in_one_line(override: str, message: str) -> None:
    from pdmctl.grid import GridError, expand
    from pdmctl.spec import SpecError

    with pytest.raises((GridError, SpecError), match=message) as info:
        expand(["backend=verl", "model=qwen3-4b-base", override], None, "s")
    assert "\n" not in str(info.value)


def test_a_verl_key_on_another_backend_and_an_unknown_backend_key_at_the_cli(workdir: Path) -> None:
    from typer.testing import CliRunner

    from pdmctl.cli import app
    from pdmctl.grid import GridError, expand

    with pytest.raises(GridError, match=r"sets backend=verl's own config, and this run's backend is toy"):
        expand(["verl.trainer.balance_batch=false"], None, "s")
    result = CliRunner().invoke(app, ["sweep", "backend=verl", "model=qwen3-4b-base",
                                      "+backend.gpu_memory_utilization=0.8", "--dry-run"])  # fmt: skip
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1, result.output
    assert errors[0].startswith("error: backend.gpu_memory_utilization: not a field of backend verl")
    assert list(workdir.iterdir()) == []


def test_every_verl_key_pdmctl_sets_from_a_setting_of_its_own_is_refused_as_verl_key() -> None:
    """Changing any of pdmctl's own settings changes only VeRL keys of launch.PDMCTL_KEYS: none can be set
    twice (as verl.<key> and as the setting), so the run config says what ran. The token budget follows
    max_prompt_length but stays the run's to tune (throughput, not what is trained)."""
    tunable = {"actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
               "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"}  # fmt: skip
    base = {**BASE, "model": "qwen3-4b-base"}
    changes = {"seed": 7, "lr": 3e-6, "temperature": 0.7, "val_n": 4, "save_freq": 5, "test_freq": 5,
               "val_before_train": False, "total_epochs": 2, "total_training_steps": 9, "max_ckpt_to_keep": 1,
               "max_prompt_length": 1024, "k": 50, "delta": 0.3, "delta_low": 0.1, "method": "dppo",
               "divergence": "topk_tv", "estimator": "uni", "eps_low": 0.1, "eps_high": 0.2, "ratio_cap": 3.0,
               "loss_agg_mode": "seq-mean-token-mean", "precision": "fp8_e2e", "strategy": "fsdp2",
               "checkpoint_dir": "/elsewhere", "data_dir": "/d2", "model_path": "/m", "experiment": "e2",
               "run_name": "r2", "nnodes": 1, "skip_old_log_prob": False}  # fmt: skip

    def command(run: dict) -> dict[str, str]:
        return dict(o.lstrip("+").split("=", 1) for o in launch.verl_overrides(run))

    before = command(base)
    for field, value in changes.items():
        after = command({**base, field: value})
        changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)} - tunable
        assert changed, field  # the setting reaches the command
        owned = {k for k in changed if any(k == o or k.startswith(f"{o}.") for o in launch.PDMCTL_KEYS)}
        preset = {k for k in changed - owned if field in ("precision", "strategy") and "megatron" in k}
        assert changed - owned - preset == set(), field  # megatron's parallel sizes come from the preset


# --- the cluster profile's network settings ---------------------------------------------------

NETWORK = {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "ib0", "NCCL_IB_HCA": "mlx5_0,mlx5_1",
           "NCCL_DEBUG": "INFO"}  # fmt: skip


def _network_profile(tmp_path: Path, **fields) -> Path:
    import yaml

    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"name": "t", "executor": "slurm", "workdir": str(tmp_path / "runs"),
                                    "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "nodes": 2,
                                    "offline": False, "data_dir": "/shared/data", **fields}))  # fmt: skip
    return path


def test_the_profiles_network_settings_are_in_the_jobs_environment_and_its_dry_run(tmp_path: Path) -> None:
    """`network:` is exported after the profile's setup lines (so it wins over a module's), in the batch
    shell whose environment every srun step, each node's Ray and the trainer inherit; the dry run's
    command shows each variable."""
    import os

    from pdmctl.executors import load_profile, make_executor
    from pdmctl.grid import expand
    from pdmctl.orchestrate import Context, describe_runs

    profile = load_profile(str(_network_profile(tmp_path, network=NETWORK, setup=["export NCCL_DEBUG=WARN"])))
    executor = make_executor(profile)
    script = "\n".join([*executor.sbatch_parameters(1)["setup"], "env"])
    env = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True,
                         env={"PATH": os.environ["PATH"]}).stdout.splitlines()  # fmt: skip
    for key, value in NETWORK.items():
        assert f"{key}={value}" in env, key
    specs = expand(["backend=verl", "model=qwen3-4b-base", "seed=0"], None, "s")
    text = "\n".join(describe_runs(specs, Context(profile, profile.tracking_uri), executor))
    command = text[text.index("  command 1.1"):text.index("    runs: ")]
    assert all(f"{key}={value}" in command for key, value in NETWORK.items()), command


@pytest.mark.parametrize(
    ("network", "message"),
    [({"LD_PRELOAD": "/x.so"}, r"network: 'LD_PRELOAD' is not one of GLOO_SOCKET_IFNAME, "),
     ({"NCCL_SOCKET_IFNAME": " ib0"}, r"network: NCCL_SOCKET_IFNAME: must be a plain value .* got ' ib0'"),
     ({"NCCL_SOCKET_IFNAME": ""}, r"network: NCCL_SOCKET_IFNAME: must be a plain value"),
     ({"NCCL_IB_HCA": ["mlx5_0"]}, r"network: NCCL_IB_HCA: must be a string or a whole number"),
     (["NCCL_DEBUG=INFO"], r"network: must be a mapping of NCCL/gloo variables to values")],
)  # fmt: skip
def test_a_bad_network_field_is_refused_in_one_line(tmp_path: Path, network, message: str) -> None:
    from pdmctl.executors import ExecutorError, load_profile, make_executor

    with pytest.raises(ExecutorError, match=message) as info:
        make_executor(load_profile(str(_network_profile(tmp_path, network=network))))
    assert "\n" not in str(info.value)


def test_a_network_variable_also_in_env_and_a_bad_one_at_the_cli_are_one_line_and_exit_2(tmp_path: Path) -> None:
    both = _network_profile(tmp_path, network={"NCCL_DEBUG": "INFO"}, env={"NCCL_DEBUG": "WARN"})
    result = pdmctl("sweep", "backend=verl", "model=qwen3-4b-base", "seed=0", "--cluster", str(both), "--dry-run",
                    cwd=tmp_path)  # fmt: skip
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "NCCL_DEBUG: set in both env: and network: (keep it in network:)" in lines[0]
    bad = _network_profile(tmp_path, network={"NCCL_SOCKETIFNAME": "ib0"})
    result = pdmctl("sweep", "backend=verl", "model=qwen3-4b-base", "seed=0", "--cluster", str(bad), "--dry-run",
                    cwd=tmp_path)  # fmt: skip
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "network: 'NCCL_SOCKETIFNAME' is not one of " in lines[0]
    assert not (tmp_path / "runs").exists()
