"""A pdmctl run as a VeRL job: Hydra overrides, the multi-node SLURM job body, metric names.

`verl_overrides(run_config)` turns one run (a flat mapping, the resolved RunSpec)
into `main_ppo` overrides; `compose(overrides)` checks them against VeRL's own
Hydra config; `build_job_command(run_config)` is the command a SLURM job runs
(`bash -c <job body>`): Ray head on the first node of the allocation, workers on
the rest, wait for all GPUs, then the trainer (or, with `PDMCTL_VERL_PROBE=1`, a
probe task that proves the cluster works).

The presets, every value with its source: `pdmctl.backends.verl.presets`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pdmctl.backends.verl import offline
from pdmctl.backends.verl.presets import (  # noqa: F401  (re-exported: launch.MODEL_PRESETS, ...)
    DEFAULTS,
    GPUS_ENV,
    GPUS_PER_NODE,
    HELD_OUT_PROBLEMS,
    HF_ATTENTION,
    MEGATRON_ATTENTION,
    MODEL_PRESETS,
    PAPER_EPOCHS,
    PAPER_STEPS,
    PRECISIONS,
    RECIPE_GPU_MEMORY,
    STRATEGIES,
    TINY_DIR_ENV,
    TRAIN_FILE,
    VAL_FILES,
    ModelPreset,
)
from pdmctl.backends.verl.quoting import quoted
from pdmctl.ledger.spool import SPOOL_DIR_ENV, spool_of
from pdmctl.ledger.spool import WAIT_ENV as TRACKING_WAIT_ENV

PROBE_ENV = "PDMCTL_VERL_PROBE"
PLUGIN_MODULE = "pdmctl.backends.verl.plugin"
PDM_CONFIG_TARGET = "pdmctl.backends.verl.plugin.PdmPolicyLossConfig"
TOPK_ENV = "PDMCTL_VERL_TOPK"  # same name as topk.TOPK_ENV (topk imports verl; this module must not)
DUMP_ENV = "PDMCTL_VERL_DUMP_DIR"  # topk.DUMP_ENV
FAIL_ENV = "PDMCTL_VERL_FAIL"  # topk.FAIL_ENV
HOLD_ENV, HOLD_S_ENV = "PDMCTL_VERL_HOLD_AT_STEP", "PDMCTL_VERL_HOLD_S"  # resume.HOLD_ENV (a test's hold)
PROFILE_ENV = "PDMCTL_VERL_PROFILE_DIR"  # topk.PROFILE_ENV
SNAPSHOT_ENVS = ("PDMCTL_VERL_SNAPSHOT_STEP", "PDMCTL_VERL_SNAPSHOT_DIR")  # snapshot.STEP_ENV, DIR_ENV
CPU_MODULE = "pdmctl.backends.verl.cpu"
CHECKPOINT_DIR_ENV = "PDMCTL_CHECKPOINT_DIR"  # checkpoints.DIR_ENV


class LaunchConfigError(ValueError):
    """A run config that cannot become a VeRL job."""


def _resolved(run_config: Mapping[str, Any]) -> dict[str, Any]:
    cfg = {**DEFAULTS, **{k: v for k, v in run_config.items() if v is not None or k not in DEFAULTS}}
    for key in ("model", "checkpoint_dir", "data_dir"):
        if not cfg.get(key):
            raise LaunchConfigError(f"{key}: required")
    if cfg["model"] not in MODEL_PRESETS:
        raise LaunchConfigError(
            f"model: unknown {cfg['model']!r}; choose from {sorted(MODEL_PRESETS)} "
            "(for other weights of one of these shapes, set model_path)"
        )
    preset = MODEL_PRESETS[cfg["model"]]
    cfg["lr"] = preset.lr if cfg["lr"] is None else cfg["lr"]
    cfg["save_freq"] = preset.save_freq if cfg["save_freq"] is None else cfg["save_freq"]
    cfg["total_epochs"] = preset.total_epochs if cfg["total_epochs"] is None else cfg["total_epochs"]
    if cfg["precision"] not in PRECISIONS:
        raise LaunchConfigError(f"precision: unknown {cfg['precision']!r}; choose from {list(PRECISIONS)}")
    if cfg["strategy"] is None:
        cfg["strategy"] = "megatron" if cfg["precision"] == "fp8_e2e" else preset.strategy
    if cfg["strategy"] not in STRATEGIES:
        raise LaunchConfigError(f"strategy: unknown {cfg['strategy']!r}; choose from {list(STRATEGIES)}")
    if cfg["precision"] == "fp8_e2e" and cfg["strategy"] != "megatron":
        raise LaunchConfigError("precision=fp8_e2e needs strategy=megatron (Transformer Engine fp8)")
    for key in ("checkpoint_dir", "data_dir"):
        if not Path(str(cfg[key])).is_absolute():
            raise LaunchConfigError(
                f"{key}: must be an absolute path (resume reads it on every node), got {cfg[key]!r}"
            )
    if int(cfg["k"]) < 1:
        raise LaunchConfigError(f"k: must be >= 1, got {cfg['k']}")
    keep = cfg["max_ckpt_to_keep"]
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        raise LaunchConfigError(f"max_ckpt_to_keep: must be a whole number >= 1, got {keep!r}")
    nnodes = cfg["nnodes"]
    if nnodes is not None and (not isinstance(nnodes, int) or isinstance(nnodes, bool) or nnodes < 1):
        raise LaunchConfigError(f"nnodes: must be a whole number >= 1, got {nnodes!r}")
    if not isinstance(cfg["skip_old_log_prob"], bool):
        raise LaunchConfigError(f"skip_old_log_prob: must be true or false, got {cfg['skip_old_log_prob']!r}")
    if not isinstance(cfg["val_before_train"], bool):
        raise LaunchConfigError(f"val_before_train: must be true or false, got {cfg['val_before_train']!r}")
    if not isinstance(cfg.get("verl") or {}, Mapping):
        raise LaunchConfigError(f"verl: VeRL keys are set one by one as verl.<key>=<value>, got {cfg['verl']!r}")
    return cfg


def setting(run_config: Mapping[str, Any]) -> str:
    """A run's engine path: model, precision and training strategy (the runs of one setting differ only in
    what the same code reads: the mask, δ, K, the seed, VeRL keys)."""
    cfg = _resolved(run_config)
    return f"{cfg['model']} {cfg['precision']} on {cfg['strategy']}"


def run_nodes(run_config: Mapping[str, Any]) -> int:
    """The nodes one run trains on: its `nnodes`, else its preset's."""
    cfg = _resolved(run_config)
    return int(cfg["nnodes"] or MODEL_PRESETS[cfg["model"]].nnodes)


NCCL_TIMEOUT_ENV = "PDMCTL_NCCL_TIMEOUT"  # the cluster profile's nccl_timeout, exported by the job's setup
MULTI_NODE_NCCL_TIMEOUT_S = 1800  # VeRL's DAPO multi-node recipe; VeRL's own default is 600


def nccl_timeout(nodes: int, environ: Mapping[str, str]) -> int | None:
    """Seconds for VeRL's process-group operations: the profile's, else 1800 across nodes, else VeRL's."""
    given = str(environ.get(NCCL_TIMEOUT_ENV, "")).strip()
    if given:
        if not given.isdigit() or int(given) < 1:
            raise LaunchConfigError(f"{NCCL_TIMEOUT_ENV}: must be a whole number of seconds, got {given!r}")
        return int(given)
    return MULTI_NODE_NCCL_TIMEOUT_S if nodes > 1 else None


def allocated_nodes() -> int | None:
    """Inside a SLURM job: the nodes of its allocation (`SLURM_NNODES`); None elsewhere."""
    given = os.environ.get("SLURM_NNODES") or os.environ.get("SLURM_JOB_NUM_NODES")
    return int(given) if given and given.isdigit() and int(given) > 0 else None


TRAINER_ENV = "PDMCTL_VERL_TRAINER"  # v0 (default: VeRL's DataProto trainer) or v1 (TransferQueue)


def use_v1_trainer() -> bool:
    """VeRL's V1 trainer where PDMCTL_VERL_TRAINER=v1; V0 by default, the path every test runs."""
    given = os.environ.get(TRAINER_ENV, "").strip().lower() or "v0"
    if given not in ("v0", "v1"):
        raise LaunchConfigError(f"{TRAINER_ENV}: must be v0 or v1, got {given!r}")
    return given == "v1"


def gpus_per_node(preset: ModelPreset, environ: Mapping[str, str] | None = None) -> int:
    """H20 nodes have 8 GPUs (PDMCTL_GPUS_PER_NODE says otherwise: in `environ`, the job's settings from the
    profile, else in this process's environment); a CPU run is one logical GPU."""
    if preset.device != "cuda":
        return 1
    given = str((environ or {}).get(GPUS_ENV) or os.environ.get(GPUS_ENV, "")).strip()
    if not given:
        return GPUS_PER_NODE
    if not given.isdigit() or int(given) < 1:
        raise LaunchConfigError(f"{GPUS_ENV}: must be a whole number >= 1, got {given!r}")
    return int(given)


def verl_overrides(
    run_config: Mapping[str, Any], nnodes: int | None = None, environ: Mapping[str, str] | None = None
) -> list[str]:
    """The `main_ppo` Hydra overrides of one run; `nnodes`: the job's allocation (None: the run's);
    `environ`: the job's environment, where the profile's settings are (None: this process's)."""
    environ = os.environ if environ is None else environ
    cfg = _resolved(run_config)
    preset = MODEL_PRESETS[cfg["model"]]
    megatron = cfg["strategy"] == "megatron"
    actor = "actor_rollout_ref.actor"
    rollout = "actor_rollout_ref.rollout"
    run_name = cfg["run_name"] or cfg.get("mlflow_run_id") or f"{cfg['model']}-{cfg['method']}-s{cfg['seed']}"
    data_dir = Path(str(cfg["data_dir"]))
    own = _own_overrides(cfg, "megatron" if megatron else "dp")
    prompt_length = preset.max_prompt_length or cfg["max_prompt_length"]
    response_length = int((cfg.get("verl") or {}).get("data.max_response_length", preset.max_response_length))
    token_budget = prompt_length + response_length
    v1 = use_v1_trainer()
    nodes = nnodes or run_nodes(cfg)
    out = [
        # engine: model_engine picks the actor/ref/critic config groups (dp = fsdp/fsdp2)
        f"model_engine={'megatron' if megatron else 'dp'}",
        f"trainer.use_v1={str(v1).lower()}",  # V0 unless PDMCTL_VERL_TRAINER=v1
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=false",
        # pdmctl's losses read the rollout's log-probs, never VeRL's recomputed old ones: no recompute forward
        # (backend.skip_old_log_prob=false keeps VeRL's recompute: the same loss, VeRL's metrics of that forward)
        f"algorithm.rollout_correction.bypass_mode={str(cfg['skip_old_log_prob']).lower()}",
        # data
        f"data.train_files={quoted(data_dir / preset.train_file)}",
        f"data.val_files=[{','.join(quoted(data_dir / f) for f in VAL_FILES)}]",
        f"data.train_batch_size={preset.train_batch_size}",
        f"data.max_prompt_length={prompt_length}",
        f"data.max_response_length={response_length}",
        "data.filter_overlong_prompts=true",
        f"data.seed={cfg['seed']}",
        # model
        f"actor_rollout_ref.model.path={quoted(model_location(cfg, environ.get(MODELS_DIR_ENV)))}",
        "actor_rollout_ref.model.use_remove_padding=true",
        "actor_rollout_ref.model.use_fused_kernels=false",  # the masks need the full logits
        f"actor_rollout_ref.model.external_lib={PLUGIN_MODULE}",  # import (and fail loudly) in every worker
        # actor and the mask
        f"{actor}.optim.lr={cfg['lr']}",
        f"{actor}.ppo_mini_batch_size={preset.ppo_mini_batch_size}",
        *_batch_overrides(preset, token_budget),
        f"{actor}.use_kl_loss=false",
        f"{actor}.entropy_coeff=0",
        f"{actor}.loss_agg_mode={cfg['loss_agg_mode']}",
        f"{actor}.clip_ratio_low={cfg['eps_low']}",
        f"{actor}.clip_ratio_high={cfg['eps_high']}",
        f"{actor}.clip_ratio_c={'inf' if cfg['ratio_cap'] is None else cfg['ratio_cap']}",  # inf: no cap (VeRL's is a float)
        f"{actor}.policy_loss._target_={PDM_CONFIG_TARGET}",
        f"{actor}.policy_loss.loss_mode=pdmctl_{cfg['method']}",
        f"+{actor}.policy_loss.topk={cfg['k']}",
        f"+{actor}.policy_loss.delta={cfg['delta']}",
        f"+{actor}.policy_loss.delta_low={'null' if cfg['delta_low'] is None else cfg['delta_low']}",
        f"+{actor}.policy_loss.divergence={cfg['divergence']}",
        f"+{actor}.policy_loss.estimator={cfg['estimator']}",
        # rollout
        f"{rollout}.name=vllm",
        f"{rollout}.n={preset.group_size}",
        f"{rollout}.temperature={cfg['temperature']}",
        f"{rollout}.tensor_model_parallel_size={preset.tensor_parallel}",
        f"{rollout}.seed={cfg['seed']}",  # VeRL's default is 42 for every run: the run's seed samples
        *([f"{rollout}.gpu_memory_utilization={preset.gpu_memory_utilization}"] if preset.gpu_memory_utilization else []),
        f"{rollout}.calculate_log_probs=true",
        f"+{rollout}.engine_kwargs.vllm.max_logprobs={max(int(cfg['k']), 20)}",
        f"{rollout}.val_kwargs.n={cfg['val_n']}",
        f"{rollout}.val_kwargs.temperature={cfg['temperature']}",
        f"{rollout}.val_kwargs.top_p=1.0",
        f"{rollout}.val_kwargs.do_sample=true",
        # trainer: tracking, checkpoints, cluster shape
        "trainer.logger=[console,mlflow]",
        f"trainer.project_name={quoted(cfg['experiment'])}",
        f"trainer.experiment_name={quoted(run_name)}",
        f"trainer.default_local_dir={quoted(cfg['checkpoint_dir'])}",
        f"trainer.save_freq={cfg['save_freq']}",
        "trainer.resume_mode=auto",
        f"trainer.test_freq={cfg['test_freq']}",
        f"trainer.val_before_train={str(cfg['val_before_train']).lower()}",
        f"trainer.total_epochs={cfg['total_epochs']}",
        f"trainer.total_training_steps={cfg['total_training_steps'] or preset.total_training_steps or 'null'}",
        f"trainer.nnodes={nodes}",
        f"trainer.n_gpus_per_node={gpus_per_node(preset, environ)}",
        "trainer.critic_warmup=0",
        f"trainer.max_actor_ckpt_to_keep={cfg['max_ckpt_to_keep']}",  # VeRL keeps every one unless told
    ]
    timeout = nccl_timeout(nodes, environ)
    if timeout is not None:
        out.append(f"actor_rollout_ref.nccl_timeout={timeout}")
    out += _precision_overrides(cfg["precision"], megatron)
    if preset.device == "cuda":  # cpu.overrides says it for CPU runs (VeRL's default needs flash-attn)
        out.append(f"+actor_rollout_ref.model.override_config.attn_implementation={HF_ATTENTION}")
    if preset.device == "cpu":
        from pdmctl.backends.verl import cpu

        out += cpu.overrides(max_model_len=token_budget)
        if v1:  # TransferQueue's default 8 storage actors (1 CPU, ~800 MB each) deadlock 2 cores
            out.append("transfer_queue.backend.SimpleStorage.num_data_storage_units=1")
    if megatron:
        out += _megatron_overrides(preset, int(cfg["seed"]))
    else:
        out += [f"{actor}.strategy=fsdp2", "actor_rollout_ref.ref.strategy=fsdp2"]
    return _with_own(out, own)


def _megatron_overrides(preset: ModelPreset, seed: int) -> list[str]:
    """The Megatron layout of a preset (VeRL's DPPO example and FP8 recipe for the 30B MoE)."""
    mc = "actor_rollout_ref.actor.megatron"
    tf = f"{mc}.override_transformer_config"
    out = [
        f"{mc}.tensor_model_parallel_size={preset.tensor_parallel}",
        f"{mc}.expert_model_parallel_size={preset.expert_parallel}",
        f"actor_rollout_ref.ref.megatron.tensor_model_parallel_size={preset.tensor_parallel}",
        f"{mc}.seed={seed}",
        # VeRL 0.9.1 defaults to Megatron-Bridge (`from megatron.bridge import AutoBridge`), and no release
        # of it on the index resolves with vLLM 0.24.0 (docs/CLUSTER.md, "The engine environment"): the
        # legacy mbridge path, which scripts/engine-env.sh installs (the ref inherits it)
        f"{mc}.vanilla_mbridge=true",
        # VeRL's default `flash` needs flash-attn, which the engine lock does not have (the ref inherits it)
        f"{tf}.attention_backend={MEGATRON_ATTENTION}",
    ]
    if preset.expert_tensor_parallel is not None:
        out.append(f"{mc}.expert_tensor_parallel_size={preset.expert_tensor_parallel}")
    if preset.megatron_offload:  # VeRL 0.9.1's param_offload also frees the gradient buffers (no grad_offload)
        out += [f"{mc}.param_offload=true", f"{mc}.optimizer_offload=true"]
    if preset.recompute:
        out += [f"{tf}.recompute_method=uniform", f"{tf}.recompute_granularity=full", f"{tf}.recompute_num_layers=1"]
    if preset.router_fp32:
        out.append(f"+{tf}.moe_router_dtype=fp32")
    return out


# VeRL keys pdmctl sets from a setting of its own, or that the job relies on: a run sets the setting, never
# the key (`verl.<key>` is refused, naming what sets it), so that the run config says what ran.
PDMCTL_KEYS: dict[str, str] = {
    "model_engine": "from backend.strategy; set that instead",
    "actor_rollout_ref.actor.strategy": "from backend.strategy; set that instead",
    "actor_rollout_ref.ref.strategy": "from backend.strategy; set that instead",
    "trainer.use_v1": f"from {TRAINER_ENV} (v0 or v1)",
    "data.train_files": "from backend.data_dir; set that instead",
    "data.val_files": "from backend.data_dir (AIME 2024 and 2025: the report's avg@16); set that instead",
    "data.max_prompt_length": "from backend.max_prompt_length; set that instead",
    "data.seed": "from seed; set that instead",
    "actor_rollout_ref.rollout.seed": "from seed; set that instead",
    "actor_rollout_ref.actor.megatron.seed": "from seed; set that instead",
    "actor_rollout_ref.model.path": "from the model and backend.model_path; set that instead",
    "actor_rollout_ref.model.use_fused_kernels": "off: the masks need the full logits",
    "actor_rollout_ref.model.external_lib": "to its plugin (every worker imports the masks)",
    "actor_rollout_ref.actor.optim.lr": "from backend.lr; set that instead",
    "actor_rollout_ref.actor.loss_agg_mode": "from mask.loss_agg_mode; set that instead",
    "actor_rollout_ref.actor.clip_ratio_low": "from mask.eps_low; set that instead",
    "actor_rollout_ref.actor.clip_ratio_high": "from mask.eps_high; set that instead",
    "actor_rollout_ref.actor.clip_ratio_c": "from mask.ratio_cap (null: no cap, inf here); set that instead",
    "actor_rollout_ref.model.override_config.attn_implementation":
        f"to {HF_ATTENTION}: the engine lock has no flash-attn (docs/CLUSTER.md, \"Attention\")",
    "actor_rollout_ref.actor.megatron.override_transformer_config.attention_backend":
        f"to {MEGATRON_ATTENTION}: the engine lock has no flash-attn (docs/CLUSTER.md, \"Attention\")",
    "actor_rollout_ref.actor.policy_loss": "from mask, delta, delta_low and k; set those instead",
    "actor_rollout_ref.rollout.name": "to vllm (the top-K log-probs come from vLLM)",
    "actor_rollout_ref.rollout.temperature": "from backend.temperature (the masks divide by it); set that instead",
    "actor_rollout_ref.rollout.calculate_log_probs": "on: the masks read the rollout's log-probs",
    "algorithm.rollout_correction.bypass_mode": "from backend.skip_old_log_prob (default true: the losses read the "
                                                "rollout's log-probs, not recomputed ones); set that instead",
    "actor_rollout_ref.rollout.engine_kwargs.vllm.max_logprobs": "from k; set that instead",
    "actor_rollout_ref.rollout.val_kwargs.n": "from backend.val_n; set that instead",
    "actor_rollout_ref.rollout.val_kwargs.temperature": "from backend.temperature; set that instead",
    "actor_rollout_ref.rollout.quantization": "from precision; set that instead",
    "actor_rollout_ref.actor.megatron.override_transformer_config.fp8": "from precision; set that instead",
    "actor_rollout_ref.actor.megatron.override_transformer_config.fp8_recipe": "from precision; set that instead",
    "actor_rollout_ref.actor.optim.override_optimizer_config.fp8_recipe": "from precision; set that instead",
    "actor_rollout_ref.nccl_timeout": "from the cluster profile's nccl_timeout",
    "trainer.logger": "to console and mlflow: the ledger reads the run's MLflow run",
    "trainer.project_name": "from the ledger (the sweep's experiment)",
    "trainer.experiment_name": "from the ledger (the run's MLflow run)",
    "trainer.default_local_dir": "to the run directory's checkpoints/ (pdmctl resume reads it)",
    "trainer.resume_mode": "to auto (a requeued job resumes from its checkpoint)",
    "trainer.save_freq": "from backend.save_freq; set that instead",
    "trainer.test_freq": "from backend.test_freq; set that instead",
    "trainer.val_before_train": "from backend.val_before_train; set that instead",
    "trainer.total_epochs": "from backend.total_epochs; set that instead",
    "trainer.total_training_steps": "from backend.total_training_steps; set that instead",
    "trainer.nnodes": "from the job's allocation (the profile's nodes, backend.nnodes)",
    "trainer.n_gpus_per_node": f"from the node's GPUs ({GPUS_ENV})",
    "trainer.max_actor_ckpt_to_keep": "from backend.max_ckpt_to_keep; set that instead",
    "ray_kwargs.ray_init.runtime_env.env_vars": "from the job's environment (the profile's env:)",
}


def _own_overrides(cfg: Mapping[str, Any], engine: str) -> dict[str, str]:
    """The run's own VeRL keys (`verl.<key>=<value>` in a grid) as overrides, each checked against VeRL's
    config schema (`schema.check`) and refused where pdmctl sets the key itself (PDMCTL_KEYS)."""
    settings = cfg.get("verl") or {}
    if not settings:
        return {}
    from pdmctl.backends.verl import schema

    out = {}
    for key, value in sorted(settings.items()):
        for owned, how in PDMCTL_KEYS.items():
            if key == owned or key.startswith(f"{owned}.") or owned.startswith(f"{key}."):
                raise LaunchConfigError(f"verl.{key}: pdmctl sets {'it' if key == owned else owned} {how}")
        try:
            declared = schema.check(key, value, engine)
            out[key] = f"{'' if declared else '+'}{key}={schema.hydra_value(value)}"
        except schema.SchemaError as exc:
            raise LaunchConfigError(str(exc)) from None
    return out


def _with_own(overrides: list[str], own: Mapping[str, str]) -> list[str]:
    """`overrides` with the run's own VeRL keys in place of pdmctl's value for the same key, or after them."""
    out = list(overrides)
    where = {o.split("=", 1)[0].lstrip("+"): i for i, o in enumerate(out)}
    for key, override in own.items():
        if key in where:
            out[where[key]] = override
        else:
            out.append(override)
    return out


def _batch_overrides(preset: ModelPreset, token_budget: int) -> list[str]:
    if preset.micro_batch_size is None:
        return [
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={token_budget}",
            f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={token_budget}",
        ]
    # fixed micro-batches: a dumped micro-batch is a known set of rows (the engine tests read one)
    return [
        "actor_rollout_ref.actor.use_dynamic_bsz=false",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={preset.micro_batch_size}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={preset.micro_batch_size}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={preset.micro_batch_size}",
    ]


def _precision_overrides(precision: str, megatron: bool) -> list[str]:
    if precision == "bf16":
        return []
    rollout_fp8 = ["actor_rollout_ref.rollout.quantization=fp8"]  # vLLM blockwise e4m3 rollout
    if precision == "fp8_rollout":
        return rollout_fp8
    tf = "+actor_rollout_ref.actor.megatron.override_transformer_config"
    return [
        *rollout_fp8,
        f"{tf}.fp8=hybrid",  # VeRL's FP8-E2E recipe: "hybrid recipe works better than e4m3 and trains more stably"
        f"{tf}.fp8_recipe=blockwise",
        "+actor_rollout_ref.actor.optim.override_optimizer_config.fp8_recipe=blockwise",
    ]


def job_env(run_config: Mapping[str, Any]) -> dict[str, str]:
    """Environment of the job: what VeRL's MLflow logger and every Ray worker must see."""
    cfg = _resolved(run_config)
    cpu_env: dict[str, str] = {}
    required = [PLUGIN_MODULE]
    if MODEL_PRESETS[cfg["model"]].device == "cpu":
        from pdmctl.backends.verl import cpu

        cpu_env = cpu.env()
        required.insert(0, CPU_MODULE)  # VeRL resolves the platform when the plugin's imports run
    env = {
        **cpu_env,
        # every pdmctl loss runs through the logits processor, so the rollout always carries top-K
        TOPK_ENV: str(int(cfg["k"])),
        "VERL_USE_EXTERNAL_MODULES": external_modules(
            os.environ.get("VERL_USE_EXTERNAL_MODULES", ""), required
        ),
        "MLFLOW_ALLOW_FILE_STORE": "true",
        # VeRL's checkpoint rotation learns what earlier attempts kept there (checkpoints.install)
        CHECKPOINT_DIR_ENV: str(cfg["checkpoint_dir"]),
    }
    for debug in (DUMP_ENV, FAIL_ENV, HOLD_ENV, HOLD_S_ENV, PROFILE_ENV, TRAINER_ENV, *OFFLINE_ENV, *SNAPSHOT_ENVS):  # tests'; V1; an offline cluster
        if os.environ.get(debug):
            env[debug] = os.environ[debug]
    if cfg.get("tracking_uri"):
        env["MLFLOW_TRACKING_URI"] = str(cfg["tracking_uri"])
    if cfg.get("mlflow_run_id"):
        env["MLFLOW_RUN_ID"] = str(
            cfg["mlflow_run_id"]
        )  # VeRL attaches to the ledger's run; resume continues it
        # what the TaskRunner logs goes through the run's spool, beside its checkpoints (ledger.spool)
        env[SPOOL_DIR_ENV] = str(spool_of(Path(cfg["checkpoint_dir"]).parent))
        if os.environ.get(TRACKING_WAIT_ENV):
            env[TRACKING_WAIT_ENV] = os.environ[TRACKING_WAIT_ENV]
    if cfg["precision"] == "fp8_e2e":  # VeRL's FP8-E2E recipe: fp32 block scales in TE and in vLLM's DeepGEMM
        env["NVTE_FP8_BLOCK_SCALING_FP32_SCALES"] = "1"
        env["VLLM_USE_DEEP_GEMM_E8M0"] = "0"
    return env


def external_modules(existing: str, required: list[str]) -> str:
    """`VERL_USE_EXTERNAL_MODULES` with pdmctl's modules added to the ones already set (in order, once)."""
    modules = [m for m in (*required, *existing.split(",")) if m.strip()]
    return ",".join(dict.fromkeys(m.strip() for m in modules))


def ray_env_overrides(env: Mapping[str, str]) -> list[str]:
    """Forward `env` to every Ray actor (the TaskRunner holds the MLflow logger)."""
    return [
        f"+ray_kwargs.ray_init.runtime_env.env_vars.{key}={quoted(value)}" for key, value in sorted(env.items())
    ]


def compose(overrides: list[str]) -> Any:
    """Compose `overrides` against VeRL's own `ppo_trainer` config (raises on any error)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return hydra_compose(config_name="ppo_trainer", overrides=overrides)


MODELS_DIR_ENV = "PDMCTL_MODELS_DIR"  # the cluster profile's models_dir, exported by the job's setup
DATA_DIR_ENV = "PDMCTL_DATA_DIR"  # the cluster profile's data_dir
OFFLINE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")  # set to 1 on an offline cluster


def model_location(run_config: Mapping[str, Any], models_dir: str | None) -> str:
    """Where a run's weights are read: its model_path; else `<models_dir>/<the hub id's last part>`
    (the profile's shared copy, `$PDMCTL_MODELS_DIR` inside the job); else the hub id; a preset built
    on this machine, its build directory."""
    preset = MODEL_PRESETS[run_config["model"]]
    if run_config.get("model_path"):
        return str(run_config["model_path"])
    if preset.hf_path is None:
        return str(local_model_dir(run_config["model"]) / "model")
    return str(Path(models_dir) / preset.hf_path.rsplit("/", 1)[-1]) if models_dir else preset.hf_path


def check_local_files(run_config: Mapping[str, Any], models_dir: str | None, data_dir: str | None) -> None:
    """On an offline cluster, before submitting (raise LaunchConfigError, one line): the weights are a
    local directory with a config, a tokenizer and weights, and every data file the run reads exists.
    Presets built on the machine itself (qwen3-tiny) are built by the job and not checked."""
    cfg = {**run_config, "data_dir": run_config.get("data_dir") or data_dir}
    preset = MODEL_PRESETS[cfg["model"]]
    if preset.hf_path is None and not cfg.get("model_path"):
        return
    where = model_location(cfg, models_dir)
    model = Path(where)
    if not model.is_absolute():
        raise LaunchConfigError(
            f"model {cfg['model']}: the cluster is offline (HF_HUB_OFFLINE=1) and {where!r} is not a local "
            "directory: set models_dir in the cluster profile or backend.model_path=/shared/dir (docs/CLUSTER.md)"
        )
    if not model.is_dir():
        raise LaunchConfigError(f"model {cfg['model']}: {model} is not a directory (stage the weights there: docs/CLUSTER.md)")
    shape = offline.ModelShape(preset.architecture, preset.parameters) if preset.architecture else None
    offline.check_model_dir(model, cfg["model"], shape)  # whole files, not names; the preset's model
    if preset.hf_path is None:
        return
    if not cfg["data_dir"]:
        raise LaunchConfigError("data_dir: set data_dir in the cluster profile or backend.data_dir=/shared/dir")
    data = Path(str(cfg["data_dir"]))
    for name in (preset.train_file, *VAL_FILES):
        offline.check_parquet(data / name)


def local_model_dir(model: str) -> Path:
    """Where a preset built on this machine lives: $PDMCTL_TINY_DIR, else ~/.cache/pdmctl/<model>."""
    return Path(os.environ.get(TINY_DIR_ENV) or Path.home() / ".cache" / "pdmctl" / model).resolve()


def resolve_local_model(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """A preset built on this machine (`qwen3-tiny`) gets its model_path and data_dir, built if absent."""
    cfg = dict(run_config)
    if MODEL_PRESETS[cfg["model"]].hf_path is not None or cfg.get("model_path"):
        return cfg
    from pdmctl.backends.verl import tiny

    root = tiny.ensure(local_model_dir(cfg["model"]))
    return {**cfg, "model_path": str(root / "model"), "data_dir": str(root / "data")}



# Bytes one checkpoint holds per model parameter, by training strategy, and the basis (VeRL 0.9.1 saves
# checkpoint.save_contents = model, optimizer, extra; the dataloader's data.pt and the RNG states are small):
CHECKPOINT_BYTES_PER_PARAMETER: dict[str, tuple[int, str]] = {
    # verl/utils/checkpoint/fsdp_checkpoint_manager.py: each rank's shard of the model's state dict (FSDP keeps
    # the parameters in fp32 and computes in bf16) and of the AdamW state (exp_avg, exp_avg_sq, fp32)
    "fsdp2": (12, "FSDP: fp32 weights 4 + Adam's two fp32 moments 8"),
    # megatron_checkpoint_manager.py: model/dist_ckpt holds the bf16 weights, optimizer/dist_ckpt the
    # distributed optimizer's fp32 main weights and its two fp32 moments
    "megatron": (14, "Megatron distributed: bf16 weights 2 + the distributed optimizer's fp32 main weights 4 "
                     "+ Adam's two fp32 moments 8"),
}
BYTES_PER_PARAMETER_IN_A_CHECKPOINT = CHECKPOINT_BYTES_PER_PARAMETER["fsdp2"][0]  # the default strategy's


def checkpoint_basis(run_config: Mapping[str, Any]) -> tuple[int, str]:
    """(bytes per parameter of one checkpoint, what they are) for the run's training strategy."""
    return CHECKPOINT_BYTES_PER_PARAMETER[_resolved(run_config)["strategy"]]


def checkpoint_bytes(run_config: Mapping[str, Any], steps: int | None = None) -> tuple[int, int, int | None]:
    """(bytes of one checkpoint, checkpoints kept, checkpoints saved or None where the step count
    comes from the data and `steps` does not say it): what a run leaves on disk at most. pdmctl holds a
    run to `max_ckpt_to_keep` across its attempts (`checkpoints.Keeper`)."""
    cfg = _resolved(run_config)
    preset = MODEL_PRESETS[cfg["model"]]
    steps = final_step(cfg) or steps
    saves = None if steps is None else -(-steps // int(cfg["save_freq"])) if int(cfg["save_freq"]) > 0 else 0
    kept = int(cfg["max_ckpt_to_keep"]) if saves is None else min(int(cfg["max_ckpt_to_keep"]), saves)
    return preset.parameters * checkpoint_basis(cfg)[0], kept, saves


def final_step(run_config: Mapping[str, Any]) -> int | None:
    """The run's last training step where it is fixed (its own or its preset's); None: by epochs."""
    steps = run_config.get("total_training_steps") or MODEL_PRESETS[run_config["model"]].total_training_steps
    return int(steps) if steps else None
