"""A snapshot of the actor's updates at one training step, for the offline replay (pdmctl.analysis.engine).

With `PDMCTL_VERL_SNAPSHOT_STEP=N` in the job's environment, each of step N's mini-batch updates in
VeRL's actor (`TrainingWorker.train_batch`: zero the gradients, forward and backward of every
micro-batch, clip, AdamW step) is written to `<run dir>/snapshots/step-N/minibatch-I.pt`:

    weights_before   the full fp32 state dict the update starts from
    optimizer        the optimizer's full state dict (exp_avg, exp_avg_sq, step per parameter name)
                     and its param groups (lr, betas, eps, weight_decay ...), its class and VeRL's clip_grad
    grads            the raw gradients of the update, before clipping (what the replay's own must match)
    grad_norm        VeRL's norm before clipping
    weights_after    the weights after VeRL's own optimizer step
    batch            the mini-batch: per sample the input ids, response ids and mask, rollout log-probs,
                     advantages, the carried top-K (ids and log-probs, [T, K]); batch_num_tokens, dp_size
    settings         the mask's settings (actor_loss.MaskSettings), the loss mode and aggregation,
                     temperature, the model's path, the precision the actor computes in and how VeRL
                     takes log-probs from its logits (flash-attn's cross-entropy, or a log-softmax in
                     the logits' precision)
    micro_batches    the samples of each micro-batch's packed forward, in order (None where VeRL did not
                     run the update's forwards on packed rows), so that the replay runs the same forwards

Every value is a tensor, number, string, bool, None, or a list / tuple / dict of them: the file loads
with `torch.load(weights_only=True)`. The step is the trainer's global step: counted in this process
from the run's latest checkpoint (`latest_checkpointed_iteration.txt`, so a resumed attempt counts on).
One rank writes (rank 0); every rank takes part in gathering the full state dicts.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch

STEP_ENV = "PDMCTL_VERL_SNAPSHOT_STEP"
CHECKPOINT_DIR_ENV = "PDMCTL_CHECKPOINT_DIR"  # checkpoints.DIR_ENV: <run dir>/checkpoints
DIR_ENV = "PDMCTL_VERL_SNAPSHOT_DIR"  # where the snapshots go when the job has no checkpoint dir (tests)
FORMAT = 1

_STATE = {"step": None, "minibatch": 0}


def wanted_step() -> int | None:
    raw = os.environ.get(STEP_ENV, "").strip()
    if not raw:
        return None
    try:
        step = int(raw)
    except ValueError as err:
        raise ValueError(f"{STEP_ENV}: expected a training step (an integer >= 1), got {raw!r}") from err
    if step < 1:
        raise ValueError(f"{STEP_ENV}: expected a training step (an integer >= 1), got {raw!r}")
    return step


def snapshot_dir() -> Path | None:
    if os.environ.get(DIR_ENV):
        return Path(os.environ[DIR_ENV])
    checkpoints = os.environ.get(CHECKPOINT_DIR_ENV)
    return Path(checkpoints).parent / "snapshots" if checkpoints else None


def begin_step() -> None:
    """Called at each of the actor's `train_mini_batch` (one per training step): the step it trains."""
    if _STATE["step"] is None:
        done = 0
        checkpoints = os.environ.get(CHECKPOINT_DIR_ENV)
        tracker = Path(checkpoints) / "latest_checkpointed_iteration.txt" if checkpoints else None
        if tracker is not None and tracker.exists():
            with contextlib.suppress(ValueError):
                done = int(tracker.read_text().strip())
        _STATE["step"] = done
    _STATE["step"] += 1
    _STATE["minibatch"] = 0


def _full(t: torch.Tensor) -> torch.Tensor:
    full_tensor = getattr(t, "full_tensor", None)  # a DTensor (FSDP2): gathered from every rank
    return (full_tensor() if full_tensor is not None else t).detach().to("cpu", copy=True)


def _model_state(module: Any) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {name: value.detach().clone().float() for name, value in state.items()}


def _optimizer_state(module: Any, optimizer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    state = get_optimizer_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    per_param = {
        str(name): {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in entry.items()}
        for name, entry in state["state"].items()
    }
    groups = []
    for group in state["param_groups"]:
        groups.append({k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()
                       if isinstance(v, int | float | str | bool | list | tuple) or v is None})  # fmt: skip
    return {"state": per_param, "param_groups": groups, "class": type(optimizer).__name__}


def _samples(data: Any, key: str) -> list[torch.Tensor] | None:
    from verl.utils import tensordict_utils as tu

    if key not in data.keys():  # noqa: SIM118  (TensorDict has no `in`)
        return None
    value = tu.get(data, key)
    if isinstance(value, torch.Tensor):
        rows = list(value.unbind()) if value.is_nested else list(value)
        return [r.detach().cpu().clone() for r in rows]
    return [torch.as_tensor(r).clone() for r in value]


def _batch(data: Any) -> dict[str, Any]:
    from pdmctl.backends.verl.topk import TOPK_IDS_KEY, TOPK_LOGPROBS_KEY

    batch: dict[str, Any] = {}
    for key in ("input_ids", "position_ids", "attention_mask", "responses", "response_mask", "rollout_log_probs",
                "advantages", "loss_mask"):  # fmt: skip
        rows = _samples(data, key)
        if rows is not None:
            batch[key] = rows
    batch["topk_ids"] = _samples(data, TOPK_IDS_KEY)
    batch["topk_logprobs"] = _samples(data, TOPK_LOGPROBS_KEY)
    return batch


def _settings(worker: Any, data: Any) -> dict[str, Any]:
    import dataclasses

    from verl.utils import tensordict_utils as tu

    from pdmctl.backends.verl.actor_loss import MaskSettings

    config = worker.loss_fn.keywords["config"]
    model_config = worker.model_config
    mixed = getattr(worker.engine_config, "mixed_precision", None) or {}
    return {
        "format": FORMAT,
        "mask": dataclasses.asdict(MaskSettings.from_actor_config(config)),
        "loss_mode": str(config.policy_loss.loss_mode),
        "loss_agg_mode": str(config.loss_agg_mode),
        "use_kl_loss": bool(config.use_kl_loss),
        "entropy_coeff": float(config.entropy_coeff),
        "temperature": float(tu.get(data, "temperature", default=1.0)),
        "model_path": str(getattr(model_config, "local_path", None) or model_config.path),
        "param_dtype": str(mixed.get("param_dtype", "bf16")) if hasattr(mixed, "get") else "bf16",
        "batch_num_tokens": int(tu.get(data, "batch_num_tokens")),
        "dp_size": int(tu.get(data, "dp_size", default=1)),
        "log_probs_from": _log_probs_from(),
    }


def _log_probs_from() -> str:
    """How VeRL's `logprobs_from_logits` takes the log-probs here: flash-attn's cross-entropy (float32 inside),
    or a log-softmax row by row in the logits' own precision (its path without flash-attn, as on CPU)."""
    from verl.utils import torch_functional

    flash = getattr(torch_functional, "FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE", False)  # VeRL's own spelling
    return "flash_attn" if flash and os.environ.get("VERL_DISABLE_FLASH_ATTN_CE", "0") != "1" else "log_softmax"


def micro_batches(forwards: list[tuple[torch.Tensor, torch.Tensor | None]],
                  samples: list[torch.Tensor]) -> list[list[int]] | None:
    """Which samples each of the update's forwards packed, in their order: VeRL's remove-padding forward takes a
    micro-batch as one row, its sequences end to end with their positions restarting at 0. None where a forward
    was not one packed row, a sequence matches no sample (padding, another layout) or a sample was in none."""
    left = list(range(len(samples)))
    found = []
    for ids, position in forwards:
        if ids.dim() != 2 or ids.shape[0] != 1 or position is None or position.shape[-1] != ids.shape[1]:
            return None
        starts = (position.reshape(-1, ids.shape[1])[0] == 0).nonzero().squeeze(1).tolist()  # mrope: 3-4 rows alike
        if not starts or starts[0] != 0:
            return None
        group = []
        for a, b in zip(starts, [*starts[1:], ids.shape[1]], strict=True):
            piece = ids[0, a:b].long()
            match = next((i for i in left if samples[i].shape == piece.shape and torch.equal(samples[i].long(), piece)),
                         None)  # fmt: skip
            if match is None:
                return None
            left.remove(match)
            group.append(match)
        found.append(group)
    return found if found and not left else None


def train_batch(worker: Any, data: Any, original: Any) -> Any:
    """`original(worker, data)` (VeRL's train_batch of one mini-batch), snapshotted when it is step N's."""
    step = wanted_step()
    if step is None or _STATE["step"] != step:
        return original(worker, data)
    engine = worker.engine
    if not isinstance(getattr(engine, "module", None), torch.nn.Module):
        raise RuntimeError(f"{STEP_ENV}: the snapshot is taken on VeRL's FSDP engine (backend.strategy=fsdp2); "
                           f"this actor runs {type(engine).__name__}")  # fmt: skip
    rank = int(os.environ.get("RANK", "0"))
    before = _model_state(engine.module)
    optimizer = _optimizer_state(engine.module, engine.optimizer)
    captured: dict[str, Any] = {}
    original_step = engine.optimizer_step

    def optimizer_step() -> Any:
        captured["grads"] = {name: _full(p.grad) for name, p in engine.module.named_parameters() if p.grad is not None}
        return original_step()

    engine.optimizer_step = optimizer_step
    forwards: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def note_forward(module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        position = kwargs.get("position_ids")
        if isinstance(ids, torch.Tensor):
            forwards.append((ids.detach().to("cpu", copy=True),
                             position.detach().to("cpu", copy=True) if isinstance(position, torch.Tensor) else None))  # fmt: skip

    hook = engine.module.register_forward_pre_hook(note_forward, with_kwargs=True)
    try:
        result = original(worker, data)
    finally:
        hook.remove()
        del engine.optimizer_step  # the class's method again
    after = _model_state(engine.module)
    index = _STATE["minibatch"]
    _STATE["minibatch"] += 1
    directory = snapshot_dir()
    if rank != 0 or directory is None:
        return result
    record = {
        "step": step, "minibatch": index, "weights_before": before, "weights_after": after,
        "optimizer": {**optimizer, "clip_grad": float(engine.optimizer_config.clip_grad)},
        "grads": captured.get("grads", {}), "batch": _batch(data), "settings": _settings(worker, data),
    }  # fmt: skip
    record["micro_batches"] = micro_batches(forwards, record["batch"].get("input_ids") or [])
    path = directory / f"step-{step}" / f"minibatch-{index}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(record, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)  # a reader never sees half a file
    print(f"pdmctl: snapshot of step {step}'s update {index} written to {path}", flush=True)
    return result
