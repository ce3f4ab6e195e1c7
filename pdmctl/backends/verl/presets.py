"""The VeRL backend's presets: models, precisions, strategies and the run-config defaults.

Every preset value has a source, and docs/CLUSTER.md ("The paper's settings") lists each with it; a test
(tests/test_verl_presets.py) composes every preset against VeRL's own config and reads each value back.
Sources: paper = the PDM paper (arXiv 2607.10848, §4.1 and §E.1: Megatron-LM training, vLLM rollouts, 4 x 8 H20, K = 20,
δ 0.15 / 0.05, GRPO clip-higher 0.2 / 0.28, avg@16; the batch sizes, learning rate and steps of its Table 1 are not used here); DPPO = the DPPO
paper's appendix (arXiv 2602.04879) and VeRL's `examples/dppo_trainer/run_qwen3_30b_a3b_megatron.sh`;
DAPO = VeRL's DAPO recipe (verl-recipe `dapo/test_dapo_qwen3_30b_math.sh`); FP8 = VeRL's FP8-E2E recipe
(verl-recipe `low_precision/run_dapo_qwen3_moe_30b_megatron_fp8e2e.sh`, docs/low_precision/fp8.md).

    lr 1e-6 ............................ DPPO, DAPO
    temperature 1.0 (rollout) .......... DPPO (the masks divide logits by it)
    group size n: 8 dense, 16 MoE ...... DPPO appendix
    batch 128 / mini 32 dense, 256 / 32 MoE   DPPO appendix
    response length 8192 dense, 16384 MoE     DPPO appendix
    prompt length 2048 ................. DAPO, DPPO
    total_training_steps 300, total_epochs 10   DAPO (its 30B recipe)
    gpu_memory_utilization 0.8 ......... DAPO, DPPO (VeRL's default 0.5)
    rollout.seed, megatron.seed ........ the run's seed (VeRL's default 42 for every run)
    Megatron for every model (paper), param and optimizer offload (DPPO, FP8; pdmctl for 4B and 8B)
    attention: sdpa (HF), Transformer Engine's cuDNN fused (Megatron): pdmctl (the engine lock has no flash-attn)
    30B-A3B: Megatron for both FP8 settings (paper), TP 4, EP 8, ETP 1 (DPPO, FP8), fp32 router (DPPO),
             param and optimizer offload, full uniform recompute of 1 layer (DPPO, FP8)
    fp8_e2e: fp8 hybrid, blockwise (FP8: "hybrid ... trains more stably" than e4m3)
    K = 20 ............................. paper, DPPO (vLLM's default max_logprobs)
    ratio cap C: none for PDM and DPPO (the paper's loss, its §2: no cap), 10 for GRPO clip-higher (DAPO);
                 the run's mask.ratio_cap, null = none (DPPO's own example: a large C, truncation off)
    ε_low 0.2 / ε_high 0.28 (GRPO) ..... paper (DAPO clip-higher)
    validation: AIME24 + AIME25, n=16, temperature 1.0, top_p 1.0   paper (avg@16)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pdmctl.backends.verl.tiny import TRAIN_FILE as TINY_TRAIN_FILE

TRAIN_FILE = "dapo_math_17k.parquet"
VAL_FILES = ("aime24.parquet", "aime25.parquet")
HELD_OUT_PROBLEMS = {"aime24.parquet": 30, "aime25.parquet": 30}  # AIME I + II of each year: 15 + 15 problems

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
    total_epochs: int = 1  # epochs VeRL may run (it stops at total_training_steps or at the last epoch)
    strategy: str = "fsdp2"  # the training engine unless the run or its precision says (fp8_e2e: megatron)
    # (the Qwen3 presets: megatron, as the paper; qwen3-tiny: fsdp2, the engine VeRL runs on CPU)
    gpu_memory_utilization: float | None = None  # vLLM's share of a GPU (None: VeRL's default, 0.5)
    # Megatron only: expert tensor parallel (None: VeRL's, = TP), param + optimizer offload, full recompute,
    # the MoE router in fp32
    expert_tensor_parallel: int | None = None
    megatron_offload: bool = False
    recompute: bool = False
    router_fp32: bool = False
    lr: float = 1e-6  # the run's lr unless it sets one
    save_freq: int = 10  # VeRL checkpoints every this many steps (and at the last) unless the run says
    parameters: int = 0  # for the checkpoint size --dry-run prints, and the staged weights' check
    architecture: str = ""  # transformers' class its config.json names (the staged weights' check; "": none)
    # seconds the trainer may make no progress (tokens generated, micro-batches trained, steps, a checkpoint's
    # bytes: progress.py) before the job ends it as hung; the profile's engine_stall_s overrides it. The longest
    # phase that reports nothing is a step's old-log-prob and reference forwards over the whole batch, then the
    # weight sync (and, in start-up, loading a resumed checkpoint): estimates, ~4x margin, never measured on a GPU
    stall_s: float = 1800.0


PAPER_STEPS = 300  # VeRL's DAPO recipe for Qwen3-30B-A3B (the paper's Table 1 body is not in our copy)
PAPER_EPOCHS = 10  # DAPO's: enough epochs that the steps end the run (300 steps of 256 need 7,680 rows)
RECIPE_GPU_MEMORY = 0.8  # vLLM's share in VeRL's DAPO recipe and its DPPO example
_GPU = dict(total_training_steps=PAPER_STEPS, total_epochs=PAPER_EPOCHS, gpu_memory_utilization=RECIPE_GPU_MEMORY)

MODEL_PRESETS: dict[str, ModelPreset] = {
    # stall_s: a step forwards 8.4 M response tokens (4B, 8B: 128 x 8 x 8k) or 67 M (30B: 256 x 16 x 16k) on 32 GPUs
    # Megatron as the paper trains every model (arXiv 2607.10848, §E.1; `backend.strategy=fsdp2`: FSDP2), param
    # and optimizer offload: Megatron keeps bf16 weights and fp32 gradient buffers unsharded across data
    # parallel ranks (24 GB a GPU at 4B TP 1 and 8B TP 2), which would not fit beside vLLM's 0.8 of the GPU
    "qwen3-4b-base": ModelPreset("Qwen/Qwen3-4B-Base", False, 8, 128, 32, 8192, 4, 1, 1, parameters=4_022_468_096,
                                 architecture="Qwen3ForCausalLM", strategy="megatron", megatron_offload=True, stall_s=1200.0, **_GPU),
    "qwen3-8b-base": ModelPreset("Qwen/Qwen3-8B-Base", False, 8, 128, 32, 8192, 4, 2, 1, parameters=8_190_735_360,
                                 architecture="Qwen3ForCausalLM", strategy="megatron", megatron_offload=True, stall_s=1200.0, **_GPU),
    # both 30B settings on one engine, Megatron as the paper, laid out as VeRL's DPPO example and FP8 recipe
    "qwen3-30b-a3b-base": ModelPreset("Qwen/Qwen3-30B-A3B-Base", True, 16, 256, 32, 16384, 4, 4, 8,
                                      parameters=30_532_122_624, architecture="Qwen3MoeForCausalLM", strategy="megatron", expert_tensor_parallel=1,
                                      megatron_offload=True, recompute=True, router_fp32=True, stall_s=2400.0, **_GPU),  # fmt: skip
    # Qwen3-0.6B on one GPU: a real LLM for the direction analysis (docs/ANALYSIS.md), at the paper's dense batch,
    # group and lengths; not a model of the paper. FSDP2, the engine the analysis's snapshot reads; no offload (its
    # weights, gradients and Adam state are 9.5 GB); VeRL's and vLLM's own defaults otherwise
    "qwen3-0.6b-base": ModelPreset("Qwen/Qwen3-0.6B-Base", False, 8, 128, 32, 8192, 1, 1, 1, parameters=596_049_920,
                                   architecture="Qwen3ForCausalLM", strategy="fsdp2", stall_s=1200.0, **_GPU),
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
        stall_s=600.0,  # a step takes seconds; start-up prints as it goes (its lines count until progress)
    ),  # fmt: skip
}
# The same tiny model and data on a GPU with CUDA vLLM: the first check on a GPU machine
# (scripts/gpu-check.sh); PDMCTL_GPUS_PER_NODE says how many GPUs the machine has.
MODEL_PRESETS["qwen3-tiny-gpu"] = dataclasses.replace(MODEL_PRESETS["qwen3-tiny"], device="cuda")
GPUS_ENV = "PDMCTL_GPUS_PER_NODE"  # GPUs per node where it is not an 8-GPU H20 node (also the job body's)
TINY_DIR_ENV = "PDMCTL_TINY_DIR"  # where `model=qwen3-tiny` is built and cached
PRECISIONS = ("bf16", "fp8_rollout", "fp8_e2e")
# Attention on every path, each from a package of the engine lock (scripts/engine-cuda.lock has no flash-attn,
# the default of both of VeRL 0.9.1's training engines): HF models (FSDP's actor and reference; every engine
# reads the model's HF config with it) use transformers' `sdpa` (torch's scaled_dot_product_attention);
# Megatron, Transformer Engine's cuDNN `fused` attention (megatron-core's AttnBackend.fused); the rollout,
# vLLM's own kernels (its wheel carries its FlashAttention build and FlashInfer). docs/CLUSTER.md, "Attention".
HF_ATTENTION = "sdpa"
MEGATRON_ATTENTION = "fused"
ATTENTION_PACKAGES: dict[str, tuple[str, ...]] = {  # the lock's packages each implementation runs from
    "sdpa": ("torch", "transformers"),
    "fused": ("transformer-engine-torch", "nvidia-cudnn-cu13", "megatron-core"),
    "vllm": ("vllm",),
}
STRATEGIES = ("fsdp2", "megatron")
GPUS_PER_NODE = 8  # H20 nodes

# Run-config keys with their defaults (see the module docstring for sources).
DEFAULTS: dict[str, Any] = {
    "precision": "bf16",
    "strategy": None,  # None: the preset's (30B-A3B: megatron), or megatron where the precision needs it (fp8_e2e)
    "method": "pdm",
    "divergence": "topk_kl",
    "estimator": "agg",
    "delta": 0.15,
    "delta_low": None,
    "k": 20,
    "eps_low": 0.2,
    "eps_high": 0.28,
    "ratio_cap": None,  # None: no cap (the paper's loss); a mask config sets its own (grpo_clip_higher: 10)
    "loss_agg_mode": "token-mean",
    "seed": 0,
    "lr": None,  # None: the model preset's (1e-6 for the Qwen3 presets)
    "temperature": 1.0,
    "val_n": 16,
    "save_freq": None,  # None: the model preset's (10 for the Qwen3 presets)
    "test_freq": 10,
    "val_before_train": True,  # validate before the first step too (the step-0 point of a curve)
    "total_epochs": None,  # None: the preset's (10 for the Qwen3 presets: the steps end the run)
    "max_prompt_length": 2048,
    "experiment": "pdmctl",
    "run_name": None,
    "model_path": None,  # a local directory (or hub id) in place of the preset's weights
    "nnodes": None,  # None: the preset's; the cluster profile's `nodes` must give exactly this many
    "max_ckpt_to_keep": 3,  # VeRL's trainer.max_actor_ckpt_to_keep (its recipes keep 3-5; VeRL: all)
    "total_training_steps": None,  # None: the preset's, else total_epochs over the train set
    "skip_old_log_prob": True,  # VeRL's bypass_mode: no loss of pdmctl's reads a recomputed old_log_prob
    "data_manifest": None,  # the digest of data_dir's manifest.json, pinned at submit (in the run key)
}
