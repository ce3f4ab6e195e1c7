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


LOCK = Path(__file__).resolve().parent.parent / "scripts" / "engine-cuda.lock"
GPU_PRESETS = sorted(name for name, preset in launch.MODEL_PRESETS.items() if preset.device == "cuda")
PATHS = [(model, precision, strategy) for model in GPU_PRESETS for precision in launch.PRECISIONS
         for strategy in launch.STRATEGIES if precision != "fp8_e2e" or strategy == "megatron"]  # fmt: skip


def locked_packages() -> set[str]:
    return {line.split("==", 1)[0].strip().lower() for line in LOCK.read_text().splitlines() if "==" in line
            and not line.lstrip().startswith("#")}  # fmt: skip


@pytest.mark.parametrize(("model", "precision", "strategy"), PATHS)
def test_every_gpu_command_names_an_attention_whose_packages_the_engine_lock_has(model, precision, strategy) -> None:
    """Each GPU preset, precision and training engine states its attention (the HF config's, and Megatron's
    backend on Megatron), and every package that implementation runs from is pinned in the engine lock;
    flash-attn, VeRL's default for both engines, is not."""
    from pdmctl.backends.verl import presets

    run = {"checkpoint_dir": "/ckpt/run", "data_dir": "/data/verl", "seed": SEED, "model": model,
           "precision": precision, "strategy": strategy, "method": "pdm"}  # fmt: skip
    values = dict(o.lstrip("+").split("=", 1) for o in launch.verl_overrides(run, environ={}))
    used = [values["actor_rollout_ref.model.override_config.attn_implementation"], "vllm"]
    backend = values.get("actor_rollout_ref.actor.megatron.override_transformer_config.attention_backend")
    assert (backend is not None) == (strategy == "megatron"), values
    used += [backend] if backend else []
    locked = locked_packages()
    assert "flash-attn" not in locked and "flash_attn" not in locked
    for implementation in used:
        missing = set(presets.ATTENTION_PACKAGES[implementation]) - locked
        assert not missing, f"{model} {precision} {strategy}: {implementation} needs {missing}, not in the lock"


@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_the_hf_attention_the_presets_name_builds_qwen3_without_flash_attn(arch: str) -> None:
    """transformers builds a (few-layer) Qwen3 and Qwen3-MoE with the presets' `sdpa` here, where flash-attn
    is not installed, and refuses VeRL's default `flash_attention_2`: what every GPU run hit before."""
    import importlib.util

    import transformers

    from pdmctl.backends.verl import presets

    assert importlib.util.find_spec("flash_attn") is None
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8)  # fmt: skip
    config = (transformers.Qwen3Config(**shape) if arch == "dense" else
              transformers.Qwen3MoeConfig(**shape, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16))  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=presets.HF_ATTENTION)
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(ImportError, match=r"FlashAttention2 .* cannot be used"):
        transformers.AutoModelForCausalLM.from_config(config, attn_implementation="flash_attention_2")


def test_megatron_reads_the_presets_attention_backend_as_transformer_engines_fused_attention() -> None:
    """VeRL turns `attention_backend` into megatron-core's AttnBackend by name: `fused` is its cuDNN attention
    through Transformer Engine (megatron-core sets NVTE_FUSED_ATTN=1, NVTE_FLASH_ATTN=0 for it)."""
    from megatron.core.transformer.enums import AttnBackend

    from pdmctl.backends.verl import presets

    assert AttnBackend[presets.MEGATRON_ATTENTION] is AttnBackend.fused


@pytest.mark.parametrize("model", ["qwen3-4b-base", "qwen3-8b-base", "qwen3-30b-a3b-base"])
def test_every_qwen3_preset_trains_on_megatron_unless_the_run_names_fsdp2(model: str) -> None:
    """The paper trains every model with Megatron-LM: that is each Qwen3 preset's engine for bf16 and FP8
    rollout; `strategy: fsdp2` is the named alternative, with the HF attention and no Megatron keys."""
    run = {"checkpoint_dir": "/ckpt/run", "data_dir": "/data/verl", "seed": SEED, "model": model,
           "precision": "bf16"}  # fmt: skip
    assert launch.setting(run) == f"{model} bf16 on megatron"
    assert "model_engine=megatron" in launch.verl_overrides(run, environ={})
    fsdp = launch.verl_overrides({**run, "strategy": "fsdp2"}, environ={})
    assert launch.setting({**run, "strategy": "fsdp2"}) == f"{model} bf16 on fsdp2"
    assert "model_engine=dp" in fsdp and "actor_rollout_ref.actor.strategy=fsdp2" in fsdp
    assert "+actor_rollout_ref.model.override_config.attn_implementation=sdpa" in fsdp
    assert not any(".megatron." in o for o in fsdp)


def test_the_paper_sweeps_train_pdm_and_dppo_without_a_ratio_cap_and_grpo_with_dapos() -> None:
    """paper-main and paper-tight: every PDM and DPPO run has no ratio cap (the paper's loss; VeRL's
    clip_ratio_c=inf), every GRPO clip-higher run DAPO's 10; the cap is in the run key (an uncapped run and
    a capped one of the same mask are two runs)."""
    from pdmctl.backends.registry import _verl_job_config, flat_config
    from pdmctl.grid import expand, load_sweep_file
    from pdmctl.spec import run_key

    for name in ("paper-main", "paper-tight"):
        specs = expand([], load_sweep_file(name))
        assert len(specs) == 48
        for spec in specs:
            method, cap = spec.config["mask"]["method"], spec.config["mask"]["ratio_cap"]
            assert cap == (10.0 if method == "grpo" else None), (name, spec.summary)
            job = _verl_job_config(flat_config(spec.config), Path("/runs") / spec.key)
            want = "10.0" if method == "grpo" else "inf"
            assert f"actor_rollout_ref.actor.clip_ratio_c={want}" in launch.verl_overrides(job, environ={})
        pdm = next(spec for spec in specs if spec.config["mask"]["method"] == "pdm")
        capped = {**pdm.config, "mask": {**pdm.config["mask"], "ratio_cap": 10.0}}
        assert run_key(capped) != pdm.key


def test_the_doctor_imports_the_presets_attention_and_never_flash_attn() -> None:
    """`pdmctl doctor --job` imports, on the node, what the presets' attention imports: transformers' SDPA
    integration (its own check, passing in this environment) and Transformer Engine's PyTorch package
    (Megatron's cuDNN attention); no check imports flash_attn."""
    from pdmctl import doctor
    from pdmctl.executors import ClusterProfile

    checks = dict(doctor.IMPORTS)
    assert "attention" in doctor.NODE_CHECKS and checks["transformer-engine"] == ("transformer_engine.pytorch",)
    assert not any("flash" in module for modules in checks.values() for module in modules)
    node = doctor.Doctor(ClusterProfile(name="here", executor="local", workdir="/tmp"), "sqlite:///unused.db")
    assert node.imports(checks["attention"]).startswith("transformers.integrations.sdpa_attention ")


def _distinct_commands(sweep: str) -> dict[tuple[str, str], list[str]]:
    """(setting, mask) -> the overrides its seed-0 run's job passes to `main_ppo` (as the dry run prints them)."""
    from pdmctl.backends.registry import _verl_job_config, flat_config
    from pdmctl.grid import expand, load_sweep_file

    out = {}
    for spec in expand([], load_sweep_file(sweep)):
        if spec.seed != 0:
            continue
        job = _verl_job_config(flat_config(spec.config), Path("/runs") / "KEY")
        key = (launch.setting(job), spec.config["mask"]["name"])
        out[key] = launch.verl_overrides(job, environ={}) + launch.ray_env_overrides(launch.job_env(job))
    return out


def test_every_distinct_command_of_the_paper_sweeps_composes_and_builds_verls_configs() -> None:
    """Each of paper-main's 16 distinct commands (4 settings x 4 masks) goes through VeRL's own Hydra
    composition and builds the actor (with its Megatron engine config) and rollout configs as VeRL's
    dataclasses (a key VeRL rejects or a value of the wrong type fails here), the reference inheriting the
    actor's attention; paper-tight's differ from them in δ alone.
    What this does not reach on CPU: loading the weights and the engines (Megatron, vLLM) on a GPU."""
    main, tight = _distinct_commands("paper-main"), _distinct_commands("paper-tight")
    assert len(main) == 16 and main.keys() == tight.keys()
    for key, overrides in main.items():
        config = launch.compose(overrides)
        actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
        omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
        assert config.actor_rollout_ref.ref.megatron.override_transformer_config.attention_backend == "fused", key
        assert config.model_engine == "megatron" and type(actor).__name__ == "McoreActorConfig", key
        assert actor.megatron.override_transformer_config["attention_backend"] == "fused", key
        assert config.actor_rollout_ref.model.override_config.attn_implementation == "sdpa", key
        assert actor.clip_ratio_c == (10.0 if key[1] == "grpo_clip_higher" else math.inf), key
        differ = sorted(set(tight[key]) ^ set(overrides))
        assert differ == ["+actor_rollout_ref.actor.policy_loss.delta=0.05",
                          "+actor_rollout_ref.actor.policy_loss.delta=0.15"], (key, differ)  # fmt: skip


def test_qwen3_0_6b_on_one_gpu_composes_and_passes_verls_own_validation() -> None:
    """The analysis's real LLM (docs/ANALYSIS.md): the one-GPU profile's setting composes through VeRL's
    Hydra config, builds the FSDP actor and rollout as VeRL's dataclasses, and passes VeRL's own
    `validate_config` with one node of one GPU (the profile's PDMCTL_GPUS_PER_NODE, not an H20 node's 8)."""
    from verl.trainer.main_ppo import need_critic, need_reference_policy, validate_config

    from pdmctl.executors.base import load_profile

    environ = load_profile("one-gpu").options["env"]
    run = {"checkpoint_dir": "/ckpt/run", "data_dir": "/data/verl", "seed": SEED, "model": "qwen3-0.6b-base",
           "precision": "bf16", "method": "pdm", "delta": 0.15, "k": 20, "total_training_steps": 1,
           "val_before_train": False}  # fmt: skip
    overrides = launch.verl_overrides(run, environ=environ)
    assert {"trainer.nnodes=1", "trainer.n_gpus_per_node=1", "actor_rollout_ref.actor.strategy=fsdp2",
            "data.train_batch_size=128", "actor_rollout_ref.rollout.n=8", "data.max_response_length=8192",
            "trainer.total_training_steps=1"} <= set(overrides), overrides  # fmt: skip
    assert "trainer.n_gpus_per_node=8" in launch.verl_overrides(run, environ={})  # an H20 node, by default
    config = launch.compose(overrides + launch.ray_env_overrides(launch.job_env(run)))
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
    assert type(actor).__name__ == "FSDPActorConfig" and actor.ppo_mini_batch_size == 32
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
