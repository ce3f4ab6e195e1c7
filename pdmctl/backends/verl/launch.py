"""A pdmctl run as a VeRL job: Hydra overrides, the multi-node SLURM job body, metric names.

`verl_overrides(run_config)` turns one run (a flat mapping, the resolved RunSpec)
into `main_ppo` overrides; `compose(overrides)` checks them against VeRL's own
Hydra config; `build_job_command(run_config)` is the command a SLURM job runs
(`bash -c <job body>`): Ray head on the first node of the allocation, workers on
the rest, wait for all GPUs, then the trainer (or, with `PDMCTL_VERL_PROBE=1`, a
probe task that proves the cluster works).

Training defaults and where each comes from (DPPO = arXiv 2602.04879 and VeRL's
`examples/dppo_trainer`; paper = the PDM paper in shared/papers):

    lr 1e-6 ............................ DPPO appendix, VeRL dppo example
    temperature 1.0 (rollout) .......... DPPO appendix (the masks divide logits by it)
    group size n: 8 dense, 16 MoE ...... DPPO appendix (Qwen3-4B/8B dense, 30B-A3B MoE)
    batch 128 prompts, mini-batch 32 ... DPPO appendix, dense (4 updates per batch)
    batch 256 prompts, mini-batch 32 ... DPPO appendix, MoE (8 updates per batch)
    response length 8192 dense, 16384 MoE   DPPO appendix
    prompt length 2048 ................. VeRL DAPO recipe (DAPO-Math prompts are short)
    K = 20 ............................. DPPO (vLLM's default max_logprobs)
    clip_ratio_c (ratio cap C) 10 ...... pdmctl default; DPPO uses a large C (truncation off) or 5
    ε_low 0.2 / ε_high 0.28 (GRPO) ..... DAPO clip-higher, as in the paper's GRPO baseline
    validation: AIME24 + AIME25, n=16, temperature 1.0, top_p 1.0   the paper's avg@16
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdmctl.backends.verl import offline
from pdmctl.backends.verl.quoting import quoted
from pdmctl.backends.verl.tiny import TRAIN_FILE as TINY_TRAIN_FILE

PROBE_ENV = "PDMCTL_VERL_PROBE"
PLUGIN_MODULE = "pdmctl.backends.verl.plugin"
PDM_CONFIG_TARGET = "pdmctl.backends.verl.plugin.PdmPolicyLossConfig"
TOPK_ENV = "PDMCTL_VERL_TOPK"  # same name as topk.TOPK_ENV (topk imports verl; this module must not)
DUMP_ENV = "PDMCTL_VERL_DUMP_DIR"  # topk.DUMP_ENV
FAIL_ENV = "PDMCTL_VERL_FAIL"  # topk.FAIL_ENV
HOLD_ENV, HOLD_S_ENV = "PDMCTL_VERL_HOLD_AT_STEP", "PDMCTL_VERL_HOLD_S"  # resume.HOLD_ENV (a test's hold)
PROFILE_ENV = "PDMCTL_VERL_PROFILE_DIR"  # topk.PROFILE_ENV
TRAIN_FILE = "dapo_math_17k.parquet"
VAL_FILES = ("aime24.parquet", "aime25.parquet")
CPU_MODULE = "pdmctl.backends.verl.cpu"


@dataclass(frozen=True)
class ModelPreset:
    hf_path: str | None  # None: built on this machine (`tiny.ensure`), never downloaded
    moe: bool
    group_size: int  # rollout.n
    train_batch_size: int  # prompts per step
    ppo_mini_batch_size: int
    max_response_length: int
    nnodes: int  # nodes a run of this preset trains on (the paper: 4 x 8 H20 for every model)
    tensor_parallel: int  # rollout TP (and Megatron TP)
    expert_parallel: int
    device: str = "cuda"  # "cpu": cpu.py's overrides and environment (VeRL + vLLM-CPU)
    max_prompt_length: int | None = None  # None: the run's max_prompt_length
    train_file: str = TRAIN_FILE
    micro_batch_size: int | None = None  # None: dynamic batch size by tokens (GPU presets)
    total_training_steps: int | None = None  # None: total_epochs over the train set
    lr: float = 1e-6  # the run's lr unless it sets one
    save_freq: int = 10  # VeRL checkpoints every this many steps (and at the last) unless the run says
    parameters: int = 0  # for the checkpoint size --dry-run prints


MODEL_PRESETS: dict[str, ModelPreset] = {
    "qwen3-4b-base": ModelPreset("Qwen/Qwen3-4B-Base", False, 8, 128, 32, 8192, 4, 1, 1, parameters=4_022_468_096),
    "qwen3-8b-base": ModelPreset("Qwen/Qwen3-8B-Base", False, 8, 128, 32, 8192, 4, 2, 1, parameters=8_190_735_360),
    "qwen3-30b-a3b-base": ModelPreset("Qwen/Qwen3-30B-A3B-Base", True, 16, 256, 32, 16384, 4, 4, 8,
                                      parameters=30_532_122_624),  # fmt: skip
    # tiny.py's 2-layer Qwen3 on CPU: 4 prompts x 4 samples per step in 4 mini-batches (each of two
    # micro-batches), at a learning rate high enough that the later mini-batches are off-policy: the
    # mask bites (a real train/rollout mismatch). A checkpoint every step: resume is tested on it.
    "qwen3-tiny": ModelPreset(
        hf_path=None,
        moe=False,
        group_size=4,
        train_batch_size=4,
        ppo_mini_batch_size=1,
        max_response_length=16,
        nnodes=1,
        tensor_parallel=1,
        expert_parallel=1,
        device="cpu",
        max_prompt_length=32,
        train_file=TINY_TRAIN_FILE,
        micro_batch_size=2,
        total_training_steps=3,
        lr=1e-2,
        save_freq=1,
        parameters=353_000,
    ),  # fmt: skip
}
# The same tiny model and data on a GPU with CUDA vLLM: the first check on a GPU machine
# (scripts/gpu-check.sh); PDMCTL_GPUS_PER_NODE says how many GPUs the machine has.
MODEL_PRESETS["qwen3-tiny-gpu"] = dataclasses.replace(MODEL_PRESETS["qwen3-tiny"], device="cuda")
GPUS_ENV = "PDMCTL_GPUS_PER_NODE"  # GPUs per node where it is not an 8-GPU H20 node (also the job body's)
TINY_DIR_ENV = "PDMCTL_TINY_DIR"  # where `model=qwen3-tiny` is built and cached
PRECISIONS = ("bf16", "fp8_rollout", "fp8_e2e")
STRATEGIES = ("fsdp2", "megatron")
GPUS_PER_NODE = 8  # H20 nodes

# Run-config keys with their defaults (see the module docstring for sources).
DEFAULTS: dict[str, Any] = {
    "precision": "bf16",
    "strategy": None,  # None: fsdp2, or megatron where the precision needs it (fp8_e2e)
    "method": "pdm",
    "divergence": "topk_kl",
    "estimator": "agg",
    "delta": 0.15,
    "delta_low": None,
    "k": 20,
    "eps_low": 0.2,
    "eps_high": 0.28,
    "ratio_cap": 10.0,
    "loss_agg_mode": "token-mean",
    "seed": 0,
    "lr": None,  # None: the model preset's (1e-6 for the Qwen3 presets)
    "temperature": 1.0,
    "val_n": 16,
    "save_freq": None,  # None: the model preset's (10 for the Qwen3 presets)
    "test_freq": 10,
    "total_epochs": 1,
    "max_prompt_length": 2048,
    "experiment": "pdmctl",
    "run_name": None,
    "model_path": None,  # a local directory (or hub id) in place of the preset's weights
    "nnodes": None,  # None: the preset's; the cluster profile's `nodes` must give exactly this many
    "max_ckpt_to_keep": 3,  # VeRL's trainer.max_actor_ckpt_to_keep (its recipes keep 3-5; VeRL: all)
    "total_training_steps": None,  # None: the preset's, else total_epochs over the train set
}


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
    if cfg["precision"] not in PRECISIONS:
        raise LaunchConfigError(f"precision: unknown {cfg['precision']!r}; choose from {list(PRECISIONS)}")
    if cfg["strategy"] is None:
        cfg["strategy"] = "megatron" if cfg["precision"] == "fp8_e2e" else "fsdp2"
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
    return cfg


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


def gpus_per_node(preset: ModelPreset) -> int:
    """H20 nodes have 8 GPUs (PDMCTL_GPUS_PER_NODE says otherwise); a CPU run is one logical GPU."""
    if preset.device != "cuda":
        return 1
    given = os.environ.get(GPUS_ENV, "").strip()
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
    prompt_length = preset.max_prompt_length or cfg["max_prompt_length"]
    token_budget = prompt_length + preset.max_response_length
    v1 = use_v1_trainer()
    nodes = nnodes or run_nodes(cfg)
    out = [
        # engine: model_engine picks the actor/ref/critic config groups (dp = fsdp/fsdp2)
        f"model_engine={'megatron' if megatron else 'dp'}",
        f"trainer.use_v1={str(v1).lower()}",  # V0 unless PDMCTL_VERL_TRAINER=v1
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=false",
        # data
        f"data.train_files={quoted(data_dir / preset.train_file)}",
        f"data.val_files=[{','.join(quoted(data_dir / f) for f in VAL_FILES)}]",
        f"data.train_batch_size={preset.train_batch_size}",
        f"data.max_prompt_length={prompt_length}",
        f"data.max_response_length={preset.max_response_length}",
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
        f"{actor}.clip_ratio_c={cfg['ratio_cap']}",
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
        "trainer.val_before_train=true",
        f"trainer.total_epochs={cfg['total_epochs']}",
        f"trainer.total_training_steps={cfg['total_training_steps'] or preset.total_training_steps or 'null'}",
        f"trainer.nnodes={nodes}",
        f"trainer.n_gpus_per_node={gpus_per_node(preset)}",
        "trainer.critic_warmup=0",
        f"trainer.max_actor_ckpt_to_keep={cfg['max_ckpt_to_keep']}",  # VeRL keeps every one unless told
    ]
    timeout = nccl_timeout(nodes, environ)
    if timeout is not None:
        out.append(f"actor_rollout_ref.nccl_timeout={timeout}")
    out += _precision_overrides(cfg["precision"], megatron)
    if preset.device == "cpu":
        from pdmctl.backends.verl import cpu

        out += cpu.overrides(max_model_len=token_budget)
        if v1:  # TransferQueue's default 8 storage actors (1 CPU, ~800 MB each) deadlock 2 cores
            out.append("transfer_queue.backend.SimpleStorage.num_data_storage_units=1")
    if megatron:
        out += [
            f"{actor}.megatron.tensor_model_parallel_size={preset.tensor_parallel}",
            f"{actor}.megatron.expert_model_parallel_size={preset.expert_parallel}",
            f"actor_rollout_ref.ref.megatron.tensor_model_parallel_size={preset.tensor_parallel}",
        ]
    else:
        out += [f"{actor}.strategy=fsdp2", "actor_rollout_ref.ref.strategy=fsdp2"]
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
        f"{tf}.fp8=e4m3",
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
    }
    for debug in (DUMP_ENV, FAIL_ENV, HOLD_ENV, HOLD_S_ENV, PROFILE_ENV, TRAINER_ENV, *OFFLINE_ENV):  # tests'; V1; an offline cluster
        if os.environ.get(debug):
            env[debug] = os.environ[debug]
    if cfg.get("tracking_uri"):
        env["MLFLOW_TRACKING_URI"] = str(cfg["tracking_uri"])
    if cfg.get("mlflow_run_id"):
        env["MLFLOW_RUN_ID"] = str(
            cfg["mlflow_run_id"]
        )  # VeRL attaches to the ledger's run; resume continues it
    if cfg["precision"] == "fp8_e2e":
        env["NVTE_FP8_BLOCK_SCALING_FP32_SCALES"] = "1"
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


# ---------------------------------------------------------------------------
# The job body: Ray on the SLURM allocation, then the trainer
# ---------------------------------------------------------------------------

JOB_BODY = r"""
set -euo pipefail
# One node name per element; quoting "$(...)" here would make one element of all names.
mapfile -t NODES < <(scontrol show hostnames "${SLURM_JOB_NODELIST:?not inside a SLURM allocation}")
N="${#NODES[@]}"
HEAD="${NODES[0]}"
JOB_STARTED="$(date +%s)"
# the `ray` beside the job's Python (a virtualenv need not be on the nodes' PATH)
RAY="$(dirname "$PDMCTL_PYTHON")/ray"
[ -x "$RAY" ] || RAY=ray
# Background steps write to the job's log (fd PDMCTL_LOG_FD, kept open by pdmctl) or nowhere, never to
# the trainer's output pipe: a step that outlived the trainer would hold that pipe open.
if [ -n "${PDMCTL_LOG_FD:-}" ]; then exec 3>&"$PDMCTL_LOG_FD"; else exec 3>/dev/null; fi
BACKGROUND=()
MAIN=""  # wait-ray, then the trainer: each the leader of a process group of its own (setsid), so
# that what it started ends with it and no stray child keeps the trainer's output pipe open
SETSID="$(command -v setsid || true)"
STATUS=0
# However the job ends (a failed start, the trainer's exit, a signal): end the trainer, end Ray on
# every node (this job's `ray start` steps, bounded), keep the job's status.
cleanup() {
  STATUS=$?
  trap - EXIT INT TERM
  set +e
  if [ -n "$MAIN" ] && kill -0 -- "-$MAIN" 2>/dev/null; then  # its whole process group
    kill -TERM -- "-$MAIN" 2>/dev/null
    for _ in $(seq 30); do kill -0 -- "-$MAIN" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$MAIN" 2>/dev/null
  fi
  # Each node's Ray is its `ray start --block` step: srun passes the TERM to it, and Ray's reaper ends
  # that node's raylet and workers. Not `ray stop`, which ends every Ray on the node, another job's too.
  for pid in "${BACKGROUND[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  for _ in $(seq "${PDMCTL_RAY_STOP_S:-60}"); do
    alive=0
    for pid in "${BACKGROUND[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 1
  done
  for pid in "${BACKGROUND[@]}"; do kill -KILL "$pid" 2>/dev/null; done
  # A CPU engine job's processes that Ray's teardown leaves behind (vLLM's engine cores, reparented to
  # the node's init) and its /dev/shm segments, on the other nodes: pdmctl ends the first node's itself
  # (cpu.cleanup). They carry the job's engine tag, which srun passed to the node's `ray start`.
  if [ -n "${PDMCTL_ENGINE_TAG:-}" ] && [ "$N" -gt 1 ]; then
    timeout "${PDMCTL_NODE_CLEANUP_S:-60}" srun --nodes=$((N - 1)) --ntasks=$((N - 1)) --ntasks-per-node=1 \
      -w "$(IFS=,; echo "${NODES[*]:1}")" --overlap env -u PDMCTL_ENGINE_TAG -u VERL_PLATFORM \
      "$PDMCTL_PYTHON" -m pdmctl.backends.verl.cpu cleanup "$PDMCTL_ENGINE_TAG" "$JOB_STARTED" >&3 2>&1
  fi
  exit "$STATUS"
}
trap cleanup EXIT
trap 'exit 143' TERM
trap 'exit 130' INT
# The head's IPv4 address: not the first word of `hostname --ip-address`, which may be 127.0.1.1 or an
# IPv6 address (PDMCTL_RAY_HEAD_IP overrides it; a one-node test cluster uses 127.0.0.1).
if [ -n "${PDMCTL_RAY_HEAD_IP:-}" ]; then
  HEAD_IP="$PDMCTL_RAY_HEAD_IP"
else
  HEAD_IP="$(srun --nodes=1 --ntasks=1 -w "$HEAD" --overlap sh -c 'hostname --ip-address; hostname -I 2>/dev/null || true' \
    | tr ' ' '\n' | grep -E '^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$' | grep -v '^127\.' | head -n 1 || true)"
  [ -n "$HEAD_IP" ] || { echo "RuntimeError: no IPv4 address other than 127.x for the Ray head $HEAD (set PDMCTL_RAY_HEAD_IP)"; exit 1; }
fi
# Ports of this job's own: a block of 10 from the job id in 20000-32759 (below Linux's ephemeral
# ports, above Ray's worker ports), so two jobs sharing a node do not meet on Ray's fixed defaults.
BASE="${PDMCTL_RAY_PORT:-$((20000 + (${SLURM_JOB_ID:-0} % 1276) * 10))}"
PORTS=(--node-manager-port=$((BASE + 1)) --object-manager-port=$((BASE + 2))
  --ray-client-server-port=$((BASE + 3)) --dashboard-agent-listen-port=$((BASE + 4))
  --dashboard-agent-grpc-port=$((BASE + 5)) --metrics-export-port=$((BASE + 6))
  --runtime-env-agent-port=$((BASE + 7)))
GPUS="${PDMCTL_GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-0}}"
# PDMCTL_RAY_CPUS: logical CPUs for Ray (a CPU engine job runs more workers than it has cores)
CPUS="${PDMCTL_RAY_CPUS:-${SLURM_CPUS_ON_NODE:-1}}"
RAY_TMP="${PDMCTL_RAY_TMP:-/tmp/ray-$SLURM_JOB_ID}"
export RAY_ADDRESS="$HEAD_IP:$BASE"
# The job's OMP_NUM_THREADS is its CPU count (for the job's own process): Ray gives each worker its
# own only where the variable is unset. One the profile's env sets on purpose is kept.
if [ "${OMP_NUM_THREADS:-}" = "${PDMCTL_NUM_THREADS:-}" ]; then unset OMP_NUM_THREADS; fi
# Token authentication with a token of this job's own, so the cluster neither depends on what the
# user's ~/.ray/auth_token holds (Ray >= 2.52 turns auth on when that file exists and
# RAY_AUTH_MODE is unset, and a driver without it is then refused) nor is open to others on the
# network. The environment carries it to every srun step, Ray node and the driver.
export RAY_AUTH_MODE=token
RAY_AUTH_TOKEN="$("$PDMCTL_PYTHON" -c "import secrets; print(secrets.token_hex(32))")"
export RAY_AUTH_TOKEN
# The package must import on every node before any Ray worker starts.
srun --nodes="$N" --ntasks="$N" --ntasks-per-node=1 --overlap \
  "$PDMCTL_PYTHON" -c "import pdmctl.backends.verl.launch"
# Since Slurm 22.05 a step does not inherit --cpus-per-task: each Ray node step asks for the job's CPUs.
STEP_CPUS=(${SLURM_CPUS_PER_TASK:+--cpus-per-task="$SLURM_CPUS_PER_TASK"})
srun --nodes=1 --ntasks=1 -w "$HEAD" --overlap "${STEP_CPUS[@]}" \
  "$RAY" start --head --node-ip-address="$HEAD_IP" --port="$BASE" "${PORTS[@]}" --include-dashboard=false \
  --num-cpus="$CPUS" --num-gpus="$GPUS" --temp-dir="$RAY_TMP" --disable-usage-stats --block >&3 2>&1 &
BACKGROUND+=($!)
sleep "${PDMCTL_RAY_HEAD_WAIT:-5}"
for node in "${NODES[@]:1}"; do
  srun --nodes=1 --ntasks=1 -w "$node" --overlap "${STEP_CPUS[@]}" \
    "$RAY" start --address="$RAY_ADDRESS" "${PORTS[@]}" --num-cpus="$CPUS" --num-gpus="$GPUS" \
    --disable-usage-stats --block >&3 2>&1 &
  BACKGROUND+=($!)
done
# Wait for every node; a `ray start` step that ends meanwhile fails the start at once, not at the timeout.
$SETSID "$PDMCTL_PYTHON" -m pdmctl.backends.verl.launch wait-ray --nodes "$N" --timeout "${PDMCTL_RAY_WAIT_S:-120}" &
MAIN=$!
while kill -0 "$MAIN" 2>/dev/null; do
  for pid in "${BACKGROUND[@]}"; do
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "RuntimeError: a Ray node step ended while the cluster was starting (its output is in the job log)"
      exit 1
    fi
  done
  sleep 1
done
wait "$MAIN"
MAIN=""
# The trainer in the background, waited for: a TERM to this shell is then handled at once (the
# trap ends the trainer and Ray), not after the trainer exits.
if [ "${PDMCTL_VERL_PROBE:-0}" = "1" ]; then
  $SETSID "$PDMCTL_PYTHON" -m pdmctl.backends.verl.launch probe &
else
  $SETSID "$PDMCTL_PYTHON" -m pdmctl.backends.verl.launch train "$@" &
fi
MAIN=$!
wait "$MAIN"
"""


def build_job_command(run_config: Mapping[str, Any], python: str | None = None) -> list[str]:
    """`[env, K=V..., bash, -c, JOB_BODY, pdmctl-verl, override...]`: what the SLURM executor runs.

    The overrides travel as positional arguments (`"$@"`), so no value is ever
    re-parsed by a shell; the environment goes through `env` for the same reason.
    """
    env = {**job_env(run_config), "PDMCTL_PYTHON": python or "python3"}
    # the trainer spans the nodes the job has (VeRL's recipe: trainer.nnodes="${SLURM_NNODES}");
    # submission checked that the profile gives the run's count
    overrides = verl_overrides(run_config, nnodes=allocated_nodes()) + ray_env_overrides(job_env(run_config))
    return [
        "env",
        *(f"{k}={v}" for k, v in sorted(env.items())),
        "bash",
        "-c",
        JOB_BODY,
        "pdmctl-verl",
        *overrides,
    ]


def build_local_command(run_config: Mapping[str, Any], python: str | None = None) -> list[str]:
    """The trainer on this machine, outside SLURM: VeRL starts (and stops) its own Ray."""
    cfg = _resolved(run_config)
    env = job_env(cfg)
    overrides = verl_overrides(cfg) + ray_env_overrides(env)
    if MODEL_PRESETS[cfg["model"]].device == "cpu":
        from pdmctl.backends.verl import cpu

        overrides += cpu.local_ray_overrides()
    module = "pdmctl.backends.verl.launch"
    return ["env", *(f"{k}={v}" for k, v in sorted(env.items())), python or "python3", "-m", module, "train",
            *overrides]  # fmt: skip


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
    offline.check_model_dir(model, cfg["model"])  # whole files, not names: issue 28 item 3
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


def run(run_config: Mapping[str, Any], python: str, on_line: Callable[[str], None] | None = None) -> None:
    """Run one VeRL job to its end: on SLURM through the job body, elsewhere VeRL's own local Ray.

    `on_line` sees every line the trainer prints (a tune trial reads its evaluations there); an
    exception it raises ends the trainer as a cancel does, and propagates.

    A CPU engine job takes this machine's lock (one at a time) and, however it ends, leaves
    none of its processes or shared-memory segments behind (vLLM's outlive Ray's teardown).
    """
    import time

    cfg = resolve_local_model(run_config)
    on_slurm = "SLURM_JOB_ID" in os.environ
    command = build_job_command(cfg, python) if on_slurm else build_local_command(cfg, python)
    if MODEL_PRESETS[cfg["model"]].device != "cpu":
        _run_trainer(command, dict(os.environ), on_line)
        return
    from pdmctl.backends.verl import cpu

    tag = cpu.new_tag()
    with cpu.machine_lock():
        ended, segments = cpu.cleanup_orphans()  # of a job killed outright (kill -9, OOM)
        if ended or segments:
            print(f"pdmctl: ended {ended} engine process(es) and removed {len(segments)} /dev/shm "
                  "segment(s) left by an engine job that was killed", flush=True)  # fmt: skip
        started = time.time()
        try:
            _run_trainer(command, {**os.environ, cpu.ENGINE_TAG_ENV: tag}, on_line)
        finally:
            ended, segments = cpu.cleanup(tag, started)
            if ended or segments:
                print(f"pdmctl: ended {ended} leftover engine process(es), removed {len(segments)} "
                      "/dev/shm segment(s)", flush=True)  # fmt: skip


class EngineJobError(RuntimeError):
    """The VeRL trainer exited with an error; the message is its last exception line."""


_ERROR_LINE = re.compile(r"^(?:\w+\.)*\w*(?:Error|Exception|Interrupt)\b: .+")


STALL_ENV = "PDMCTL_ENGINE_STALL_S"  # seconds without a line from the trainer before it is ended as hung
DEFAULT_STALL_S = 1800.0  # VeRL and vLLM print at least a line a step; a GPU step of 8k tokens takes minutes


def stall_seconds() -> float:
    """How long the trainer may print nothing (PDMCTL_ENGINE_STALL_S, default 30 min)."""
    given = os.environ.get(STALL_ENV, "").strip()
    if not given:
        return DEFAULT_STALL_S
    try:
        value = float(given)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise LaunchConfigError(f"{STALL_ENV}: must be a number of seconds > 0, got {given!r}")
    return value


class _Stalled(Exception):
    pass


LOG_FD_ENV = "PDMCTL_LOG_FD"  # the job body's fd of the job log (for its background steps' output)


def _log_fd() -> int | None:
    """A duplicate of this process's stdout for the trainer's command (None where stdout has no fd)."""
    try:
        return os.dup(sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):
        return None


def _default_signals() -> None:
    """In the trainer's process before it runs: SIGTERM unblocked. A SLURM job blocks it for itself
    (`executors.slurm.PdmctlJob`) and a blocked mask is inherited, so `terminate()` (a cancel, a pruned
    trial, a hang) would otherwise not reach the trainer or the job body."""
    import signal

    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _run_trainer(
    command: list[str], env: dict[str, str], on_line: Callable[[str], None] | None = None,
    stall_s: float | None = None,
) -> None:  # fmt: skip
    """Run the trainer, its output passed through to the job log; a failure raises with its reason.

    The reason is the last `SomethingError: message` line the trainer printed (Ray prints the
    worker's exception last), so the ledger says what failed, not only an exit status. A trainer
    that prints nothing for `stall_s` seconds is ended as hung (a worker that died inside a
    collective, such as the weight sync, leaves the others waiting for ever).
    """
    import queue
    import subprocess
    import threading
    import time

    stall_s = stall_seconds() if stall_s is None else stall_s
    last_error = ""
    lines: queue.Queue[str | None] = queue.Queue()
    log_fd = _log_fd()
    if log_fd is not None:  # the job body's background steps write to the log itself, not to this pipe
        env = {**env, LOG_FD_ENV: str(log_fd)}
    try:
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", bufsize=1, pass_fds=() if log_fd is None else (log_fd,),
                                preexec_fn=_default_signals)  # fmt: skip
    finally:
        if log_fd is not None:
            os.close(log_fd)
    stream = proc.stdout
    assert stream is not None

    def pump() -> None:  # a thread, so that silence can be timed (a blocked read cannot)
        try:
            for line in stream:
                lines.put(line)
        except (OSError, ValueError):
            pass
        finally:
            lines.put(None)

    threading.Thread(target=pump, name="pdmctl-trainer-output", daemon=True).start()
    try:
        last = time.monotonic()
        while True:
            try:
                line = lines.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() - last > stall_s:
                    raise _Stalled from None
                continue
            if line is None:
                break
            last = time.monotonic()
            sys.stdout.write(line)
            if _ERROR_LINE.match(line.strip()):
                last_error = line.strip()
            if on_line is not None:
                on_line(line)
    except BaseException as exc:  # a cancel (SIGTERM -> job.Cancelled), a pruned trial, a hang: end it
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if isinstance(exc, _Stalled):
            after = f"; its last error line: {last_error}" if last_error else ""
            raise EngineJobError(f"the trainer printed nothing for {stall_s:.0f} s and was ended as hung{after}") from None
        raise
    proc.wait()
    stream.close()  # the pump has seen the end of it
    sys.stdout.flush()
    if proc.returncode != 0:
        raise EngineJobError(last_error or f"the VeRL trainer exited with status {proc.returncode}")


# ---------------------------------------------------------------------------
# Metrics: VeRL/MLflow names -> pdmctl's (backends/base.py)
# ---------------------------------------------------------------------------

VAL_DATA_SOURCES = {"aime24": "aime24", "aime25": "aime25"}  # data_source in the parquet -> report name
TRAIN_METRICS = {
    "critic/score/mean": "train/reward",
    "response_length/mean": "train/response_length",
    "actor/pdmctl/ppo_kl": "train/ppo_kl",
    "actor/pdmctl/mask_frac": "train/mask_frac",
    "actor/pdmctl/out_of_region_frac": "train/out_of_region_frac",
    "actor/pdmctl/mean_divergence": "train/mean_divergence",
    "actor/pdmctl/disagreement_count": "train/disagreement_count",
}


def pdmctl_metric_name(verl_name: str) -> str | None:
    """`val-core/aime24/acc/mean@16` (or MLflow's `..._at_16`) -> `eval/aime24`; None if not reported."""
    name = verl_name.replace("_at_", "@")
    for source, report in VAL_DATA_SOURCES.items():
        if name == f"val-core/{source}/acc/mean@16":
            return f"eval/{report}"
    return TRAIN_METRICS.get(name)


_STEP_LINE = re.compile(r"\bstep:(\d+) - ")
_VAL_METRIC = re.compile(r"\bval-core/([\w.-]+)/acc/mean@16:(?:np\.float\d*\()?([-+0-9.eE]+|nan)")


def evaluation_from_line(line: str) -> tuple[int, dict[str, float]] | None:
    """(step, {eval/aime24: avg@16, ...}) from the metrics line VeRL's console logger prints after a
    validation (`step:N - ... - val-core/aime24/acc/mean@16:np.float64(0.26) - ...`); None otherwise."""
    if "val-core/" not in line or not (step := _STEP_LINE.search(line)):
        return None
    found = {f"eval/{VAL_DATA_SOURCES[src]}": float(v) for src, v in _VAL_METRIC.findall(line) if src in VAL_DATA_SOURCES}
    return (int(step.group(1)), found) if found else None


BYTES_PER_PARAMETER_IN_A_CHECKPOINT = 12  # fp32 weights + Adam's two fp32 moments (VeRL saves all three)


def checkpoint_bytes(run_config: Mapping[str, Any]) -> tuple[int, int, int | None]:
    """(bytes of one checkpoint, checkpoints kept, checkpoints saved or None where the step count
    comes from the data): what a run leaves on disk at most."""
    cfg = _resolved(run_config)
    preset = MODEL_PRESETS[cfg["model"]]
    steps = final_step(cfg)
    saves = None if steps is None else -(-steps // int(cfg["save_freq"])) if int(cfg["save_freq"]) > 0 else 0
    kept = int(cfg["max_ckpt_to_keep"]) if saves is None else min(int(cfg["max_ckpt_to_keep"]), saves)
    return preset.parameters * BYTES_PER_PARAMETER_IN_A_CHECKPOINT, kept, saves


def describe_jobs(runs: list[tuple[str, dict[str, Any]]], nodes: int, environ: Mapping[str, str]) -> list[str]:
    """What `--dry-run` prints of VeRL jobs: the first run's command as its job will run it, what the
    other runs change in it, and the checkpoints they keep. `runs`: (summary, job config)."""
    import shlex

    shown = 20  # a paper-size sweep has dozens of runs: the first ones tell the pattern
    lines = []
    commands = [verl_overrides(cfg, nnodes=nodes, environ=environ) + ray_env_overrides(job_env(cfg))
                for _, cfg in runs[:shown]]  # fmt: skip
    first_env = {**job_env(runs[0][1]), **environ}
    lines.append(f"VeRL job of run 1 ({runs[0][0]}) on {nodes} node(s), after the job body has started Ray "
                 "(launch.JOB_BODY):")  # fmt: skip
    lines.append("  " + " \\\n    ".join(
        ["env " + " ".join(shlex.quote(f"{k}={v}") for k, v in sorted(first_env.items())),
         "python -m pdmctl.backends.verl.launch train", *(shlex.quote(o) for o in commands[0])]))  # fmt: skip
    first = dict(o.split("=", 1) for o in commands[0])
    for i, ((summary, _), overrides) in enumerate(zip(runs[1:shown], commands[1:], strict=True), 2):
        mine = dict(o.split("=", 1) for o in overrides)
        changed = [f"{k}={v}" for k, v in mine.items() if first.get(k) != v]
        dropped = [f"~{k}" for k in first if k not in mine]
        lines.append(f"run {i} ({summary}) differs in: {' '.join(changed + dropped) or 'nothing'}")
    if len(runs) > shown:
        lines.append(f"(and {len(runs) - shown} more run(s), not listed here)")
    total = sum(size * kept for size, kept, _ in (checkpoint_bytes(cfg) for _, cfg in runs))
    size, kept, saves = checkpoint_bytes(runs[0][1])
    preset = MODEL_PRESETS[runs[0][1]["model"]]
    lines.append(f"checkpoints: {_gb(size)} each ({preset.parameters / 1e9:.2f} B parameters x "
                 f"{BYTES_PER_PARAMETER_IN_A_CHECKPOINT} bytes: fp32 weights and Adam's two moments), "
                 f"{kept} kept (max_ckpt_to_keep{'' if saves is None else f'; {saves} saved'}): "
                 f"{_gb(size * kept)} for run 1; {_gb(total)} for the {len(runs)} run(s) of this submission")  # fmt: skip
    return lines


def _gb(n: float) -> str:
    return f"{n / 1e12:.2f} TB" if n >= 1e12 else f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def final_step(run_config: Mapping[str, Any]) -> int | None:
    """The run's last training step where it is fixed (its own or its preset's); None: by epochs."""
    steps = run_config.get("total_training_steps") or MODEL_PRESETS[run_config["model"]].total_training_steps
    return int(steps) if steps else None


def map_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    return {new: value for name, value in metrics.items() if (new := pdmctl_metric_name(name)) is not None}


# ---------------------------------------------------------------------------
# `python -m pdmctl.backends.verl.launch {wait-ray,probe,train}`: the job body's steps
# ---------------------------------------------------------------------------


def wait_for_ray(nodes: int, timeout_s: float) -> None:
    """Block until `nodes` Ray nodes are alive (the workers start asynchronously)."""
    import time

    import ray

    deadline = time.monotonic() + timeout_s
    address = os.environ.get("RAY_ADDRESS", "auto")
    if address != "auto":  # ray.init waits on an absent head without end: bound the wait ourselves
        _wait_for_port(address, deadline)
    ray.init(address=address, log_to_driver=False)
    try:
        while True:
            alive = sum(1 for node in ray.nodes() if node.get("Alive"))
            if alive >= nodes:
                print(f"pdmctl: {alive} Ray node(s) up", flush=True)
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {alive} of {nodes} Ray nodes came up within {timeout_s:.0f}s")
            time.sleep(1.0)
    finally:
        ray.shutdown()


def _wait_for_port(address: str, deadline: float) -> None:
    import socket
    import time

    host, _, port = address.rpartition(":")
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no Ray head answered at {address}: did `ray start --head` fail?"
                ) from None
            time.sleep(1.0)


def probe() -> None:
    """A task on the cluster in place of the trainer: the cluster starts, schedules, and sees the plugin env."""
    import socket

    import ray

    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=False)

    @ray.remote(num_cpus=1)
    def where() -> dict[str, str]:
        import pdmctl.backends.verl.launch  # noqa: F401  (the package imports on the worker)

        return {"host": socket.gethostname(), TOPK_ENV: os.environ.get(TOPK_ENV, "")}

    try:
        result = ray.get(where.remote(), timeout=120)
        nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
        print(f"PDMCTL_PROBE_OK host={result['host']} nodes={nodes}", flush=True)
    finally:
        ray.shutdown()


def train(overrides: list[str]) -> None:
    """VeRL's `main_ppo`, with pdmctl's fail-fast check before Ray starts the first rollout."""
    from verl.trainer.main_ppo import (
        TaskRunnerV1,
        auto_set_device,
        need_critic,
        need_reference_policy,
        run_ppo,
        validate_config,
    )

    from pdmctl.backends.verl.plugin import check_run_config

    config = compose(overrides)
    check_run_config(config)
    auto_set_device(config)
    validate_config(
        config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config)
    )
    if config.trainer.use_v1:  # as VeRL's own main_ppo chooses
        print("pdmctl: VeRL's V1 trainer (TransferQueue)", flush=True)
        run_ppo(config, task_runner_class=TaskRunnerV1)
    else:
        from verl.trainer.main_ppo_v0 import TaskRunner

        run_ppo(config, task_runner_class=TaskRunner)


def main(argv: list[str] | None = None) -> None:
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m pdmctl.backends.verl.launch")
    sub = parser.add_subparsers(dest="step", required=True)
    wait = sub.add_parser("wait-ray")
    wait.add_argument("--nodes", type=int, required=True)
    wait.add_argument("--timeout", type=float, default=300.0)
    sub.add_parser("probe")
    train_parser = sub.add_parser("train")
    train_parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.step == "wait-ray":
        wait_for_ray(args.nodes, args.timeout)
    elif args.step == "probe":
        probe()
    else:
        train(args.overrides)


if __name__ == "__main__":
    main()
