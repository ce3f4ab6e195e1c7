"""The actor side of the top-K masks in VeRL 0.9.1: the logits processor and the loss.

`pdm_ppo_loss` is the actor's loss function for `pdmctl_*` loss modes, used twice per
micro-batch the way VeRL's own top-K distillation loss is
(`verl/trainer/distillation/losses.py`): called with `student_logits` it is the engine's
logits processor and runs `pdmctl.masks.token_diagnostics` on the full
(temperature-scaled) logits, FSDP's packed rows or Megatron's vocabulary-parallel
shards; called with `model_output` it hands those diagnostics to VeRL's unmodified
`ppo_loss`, which finds the registered `pdmctl_<method>` loss (plugin.py) and reads
them through `current_diagnostics`. The per-token inputs come from the carry
(`topk.carried_rows`); the patches that make VeRL call this live in patches.py.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import math
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdmctl import masks
from pdmctl.backends.verl.topk import (
    _OUTPUT_PREFIX,
    DIAGNOSTIC_KEYS,
    DUMP_ENV,
    PROFILE_ENV,
    TOPK_ENV,
    TOPK_IDS_KEY,
    TOPK_LOGPROBS_KEY,
    carried_rows,
    method_of_loss,
    sampled_slot,
)

_MASK_CHUNK_ROWS = 1024  # response tokens per token_diagnostics call: bounds the [rows, V] scratch

_DUMPED: set[str] = set()


def dump_once(kind: str, **tensors: Any) -> None:
    """With `PDMCTL_VERL_DUMP_DIR` set: save this process's first `kind` record (the engine tests read it).

    The logits processor and the loss run once per micro-batch in that order, so the first
    `logits` and the first `loss` record of a process describe the same micro-batch.
    """
    directory = os.environ.get(DUMP_ENV)
    if not directory or kind in _DUMPED:
        return
    _DUMPED.add(kind)
    path = Path(directory) / f"{kind}-{os.getpid()}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    values = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in tensors.items()}
    torch.save(values, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)  # a reader never sees half a file


def _profile(started: float, rows: int) -> None:
    """With `PDMCTL_VERL_PROFILE_DIR` set: one JSON line per mask computation (bench/engine.py sums them
    against VeRL's `timing_s/*` to give the share of the actor's step spent in the mask)."""
    ended = time.perf_counter()
    directory = os.environ[PROFILE_ENV]
    Path(directory).mkdir(parents=True, exist_ok=True)
    line = json.dumps({"pid": os.getpid(), "end": time.time(), "s": ended - started, "rows": rows})
    with open(Path(directory) / f"mask-{os.getpid()}.jsonl", "a") as fh:
        fh.write(line + "\n")


@dataclass(frozen=True)
class MaskSettings:
    """What `token_diagnostics` needs besides tensors, read off VeRL's ActorConfig."""

    method: str
    divergence: str
    estimator: str
    delta: float
    delta_low: float | None
    eps_low: float
    eps_high: float
    ratio_cap: float | None  # None: no cap

    @classmethod
    def from_actor_config(cls, config: Any) -> MaskSettings:
        policy_loss = config.policy_loss
        return cls(
            method=method_of_loss(policy_loss.loss_mode),
            divergence=policy_loss.get("divergence", "topk_kl"),
            estimator=policy_loss.get("estimator", "agg"),
            delta=float(policy_loss.get("delta", 0.15)),
            delta_low=policy_loss.get("delta_low", None),
            eps_low=float(config.clip_ratio_low),
            eps_high=float(config.clip_ratio_high),
            ratio_cap=None if config.clip_ratio_c is None else float(config.clip_ratio_c),
        )


# The padded [bsz, response_length] diagnostics of the micro-batch whose loss VeRL is computing.
_CURRENT: contextvars.ContextVar[masks.Diagnostics | None] = contextvars.ContextVar(
    "pdmctl_diagnostics", default=None
)


def current_diagnostics() -> masks.Diagnostics:
    """The diagnostics `pdm_ppo_loss` computed for this micro-batch (called by the registered losses)."""
    diagnostics = _CURRENT.get()
    if diagnostics is None:
        raise RuntimeError(
            "a pdmctl_* policy loss was called outside pdmctl's actor loss: the VeRL top-K patch is not "
            f"installed in this worker (set {TOPK_ENV} and load pdmctl.backends.verl.plugin in every Ray worker)"
        )
    return diagnostics


@contextlib.contextmanager
def diagnostics_scope(diagnostics: masks.Diagnostics) -> Iterator[None]:
    token = _CURRENT.set(diagnostics)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def response_rows(data: Any, total_rows: int) -> torch.Tensor:
    """[bsz, response_length] row index into the packed logits of each response token's logits.

    Built with VeRL's own `no_padding_2_padding` on an arange, so it is exactly the
    alignment VeRL uses to slice `log_probs` (logits at row p predict token p+1).
    """
    from verl.workers.utils.padding import no_padding_2_padding

    return no_padding_2_padding(torch.arange(total_rows), data).long()


def _dense(data: Any, key: str) -> torch.Tensor:
    """A field as one right-padded tensor. A nested field is padded from its samples' own lengths:
    `to_padded_tensor` pads to the jagged tensor's cached maximum, which a micro-batch sliced out of
    V1's batch keeps from the whole batch (a [2, 4, 6] top-K came out [2, 8, 6])."""
    value = data[key]
    if not value.is_nested:
        return value
    return torch.nn.utils.rnn.pad_sequence(list(value.unbind()), batch_first=True, padding_value=0)


@dataclass(frozen=True)
class ResponseTokens:
    """The mask's per-token inputs for every response token of a micro-batch ([M] or [M, K+1])."""

    sampled_ids: torch.Tensor
    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor
    sampled_logprobs: torch.Tensor
    advantages: torch.Tensor


def response_tokens(data: Any, total_rows: int, device: torch.device) -> tuple[torch.Tensor, ResponseTokens]:
    """`(rows, tokens)`: each response token's row in the packed, unpadded sequences, and its inputs."""
    if "rollout_log_probs" not in data.keys():  # noqa: SIM118  (TensorDict has no `in`)
        raise RuntimeError(
            "pdmctl losses need the rollout's sampled log-probs: set actor_rollout_ref.rollout.calculate_log_probs=true"
        )
    if TOPK_IDS_KEY not in data.keys():  # noqa: SIM118
        raise RuntimeError(
            f"pdmctl losses need {TOPK_IDS_KEY}/{TOPK_LOGPROBS_KEY} in the batch: the rollout top-K patch is not active"
        )
    valid = _dense(data, "response_mask").bool().to(device)
    rows = response_rows(data, total_rows).to(device)[valid]
    sampled_ids = _dense(data, "responses").to(device)[valid].long()
    sampled_logprobs = _dense(data, "rollout_log_probs").to(device)[valid].float()
    from verl.utils import tensordict_utils as tu

    # tu.get: a NonTensorStack as the list of its arrays, a tensor as it is
    top_ids, carried = carried_rows(tu.get(data, TOPK_IDS_KEY), valid)
    top_logprobs, _ = carried_rows(tu.get(data, TOPK_LOGPROBS_KEY), valid)
    top_ids, top_logprobs = top_ids.to(device).long(), top_logprobs.to(device).float()
    carried = carried.to(device)
    # rows the carry does not hold read as `extract_topk`'s padding (id 0, log-prob -inf), slot K included
    top_ids = top_ids.masked_fill(~carried[:, None], 0)
    top_logprobs = top_logprobs.masked_fill(~carried[:, None], -math.inf)
    slot_ids, slot_logprobs = sampled_slot(top_ids, top_logprobs, sampled_ids, sampled_logprobs)
    tokens = ResponseTokens(
        sampled_ids=sampled_ids,
        topk_ids=torch.cat([top_ids, slot_ids.masked_fill(~carried, 0)[:, None]], -1),
        topk_logprobs=torch.cat([top_logprobs, slot_logprobs.masked_fill(~carried, -math.inf)[:, None]], -1),
        sampled_logprobs=sampled_logprobs,
        advantages=_dense(data, "advantages").to(device)[valid].float(),
    )
    return rows, tokens


def diagnose_rows(
    settings: MaskSettings,
    logits: torch.Tensor,
    rows: torch.Tensor,
    tokens: ResponseTokens,
    shard: masks.VocabShard | None = None,
) -> dict[str, torch.Tensor]:
    """`token_diagnostics` on `logits[rows]` (in chunks), scattered into `(1, len(logits))` outputs.

    With a `shard`, every rank of its group must call this with the same rows and tokens.
    """
    started = time.perf_counter()
    outputs = {
        name: torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)
        for name in DIAGNOSTIC_KEYS
    }
    with torch.no_grad():
        for start in range(0, rows.numel(), _MASK_CHUNK_ROWS):
            chunk = slice(start, start + _MASK_CHUNK_ROWS)
            d = masks.token_diagnostics(
                logits[rows[chunk]].detach(), tokens.sampled_ids[chunk], tokens.topk_ids[chunk],
                tokens.topk_logprobs[chunk], tokens.sampled_logprobs[chunk], tokens.advantages[chunk],
                method=settings.method, divergence=settings.divergence, estimator=settings.estimator,
                delta=settings.delta, delta_low=settings.delta_low, eps_low=settings.eps_low,
                eps_high=settings.eps_high, ratio_cap=settings.ratio_cap, shard=shard,
            )  # fmt: skip
            for name in DIAGNOSTIC_KEYS:
                outputs[name][rows[chunk]] = getattr(d, name).float()
    if os.environ.get(PROFILE_ENV):
        if logits.device.type == "cuda":
            torch.cuda.synchronize(logits.device)  # time the work, not its launch (profiling only)
        _profile(started, rows.numel())
    return {_OUTPUT_PREFIX + name: value.unsqueeze(0) for name, value in outputs.items()}


def mask_outputs_from_logits(config: Any, data: Any, student_logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """The logits-processor half for FSDP engines: rows are the packed, unpadded sequences.

    `student_logits` is `(1, total_rows, V)`, already divided by the temperature (the
    engine does that before it calls a logits processor). Returns one `(1, total_rows)`
    float tensor per diagnostic, zero on prompt rows, as VeRL's hook requires.
    """
    logits = student_logits.squeeze(0)
    rows, tokens = response_tokens(data, logits.shape[0], logits.device)
    settings = MaskSettings.from_actor_config(config)
    dump_once(
        "logits", logits=logits[rows], settings=dataclasses.asdict(settings), **dataclasses.asdict(tokens)
    )
    return diagnose_rows(settings, logits, rows, tokens)


def megatron_fp8_padding(config: Any) -> bool:
    """Whether Megatron pads the packed rows for fp8 (as `gptmodel_forward_model_engine` decides)."""
    megatron = getattr(config, "megatron", None)
    override = getattr(megatron, "override_transformer_config", None) or {}
    return override.get("fp8", None) in ("e4m3", "hybrid")


def megatron_mask_outputs(
    config: Any, data: Any, student_logits: torch.Tensor, data_format: str
) -> dict[str, torch.Tensor]:
    """The logits-processor half for Megatron: vocabulary-parallel logits in Megatron's packed layout.

    `student_logits` is `(1, local_rows, V / TP)`: this context-parallel rank's rows of the
    sequences packed with Megatron's alignment padding (TP x CP, and fp8's when the model
    trains in fp8), and this tensor-parallel rank's vocabulary columns. The per-token inputs
    are laid out on the unpadded sequences, packed by VeRL's own `preprocess_thd_engine` the
    way the engine packs the logits (zigzag CP, VeRL's default), and diagnosed with a
    `VocabShard` over the TP group; the engine unpacks the `(1, local_rows)` outputs.
    """
    if data_format != "thd":
        raise NotImplementedError(
            "pdmctl's Megatron logits processor needs the packed THD layout (use_remove_padding=true)"
        )
    from megatron.core import parallel_state as mpu
    from verl.models.mcore.util import preprocess_thd_engine

    logits = student_logits.squeeze(0)
    offsets = data["input_ids"].offsets().to(logits.device)
    total = int(offsets[-1])
    rows, t = response_tokens(data, total, logits.device)
    width = t.topk_ids.shape[-1]
    ints = torch.zeros(total, 1 + width, dtype=torch.long, device=logits.device)
    ints[rows] = torch.cat([t.sampled_ids[:, None], t.topk_ids], -1)
    floats = torch.zeros(total, width + 3, dtype=torch.float32, device=logits.device)
    ones = torch.ones_like(t.advantages)[:, None]  # the last column marks response tokens
    floats[rows] = torch.cat([t.topk_logprobs, t.sampled_logprobs[:, None], t.advantages[:, None], ones], -1)
    fp8 = megatron_fp8_padding(config)

    def packed(x: torch.Tensor) -> torch.Tensor:
        nested = torch.nested.nested_tensor_from_jagged(x, offsets)
        return preprocess_thd_engine(nested, pre_process=True, use_fp8_padding=fp8)[0].squeeze(0)

    ints, floats = packed(ints), packed(floats)
    if ints.shape[0] != logits.shape[0]:
        raise RuntimeError(
            f"pdmctl: Megatron packed {logits.shape[0]} rows of logits but the token inputs pack to "
            f"{ints.shape[0]} (fp8 padding {fp8}); the engine's layout is not the one this patch was written for"
        )
    local_rows = torch.nonzero(floats[:, -1] > 0.5).squeeze(-1)
    tokens = ResponseTokens(
        sampled_ids=ints[local_rows, 0], topk_ids=ints[local_rows, 1:],
        topk_logprobs=floats[local_rows, :width], sampled_logprobs=floats[local_rows, width],
        advantages=floats[local_rows, width + 1],
    )  # fmt: skip
    v_local = logits.shape[-1]
    shard = masks.VocabShard(
        start=mpu.get_tensor_model_parallel_rank() * v_local,
        vocab_size=mpu.get_tensor_model_parallel_world_size() * v_local,
        group=mpu.get_tensor_model_parallel_group(),
    )
    return diagnose_rows(MaskSettings.from_actor_config(config), logits, local_rows, tokens, shard)


def diagnostics_from_model_output(model_output: Mapping[str, torch.Tensor], data: Any) -> masks.Diagnostics:
    """The logits processor's per-row outputs -> `[bsz, response_length]` Diagnostics."""
    from verl.workers.utils.padding import no_padding_2_padding

    padded = {
        name: no_padding_2_padding(model_output[_OUTPUT_PREFIX + name], data) for name in DIAGNOSTIC_KEYS
    }
    as_bool = ("keep", "out_of_region", "disagree")
    return masks.Diagnostics(**{name: (v > 0.5) if name in as_bool else v for name, v in padded.items()})


def pdm_ppo_loss(
    config: Any,
    model_output: Mapping[str, torch.Tensor] | None = None,
    data: Any = None,
    dp_group: Any = None,
    student_logits: torch.Tensor | None = None,
    data_format: str = "thd",
) -> Any:
    """The actor loss for `pdmctl_*` loss modes; same two-call contract as VeRL's `distillation_ppo_loss`."""
    if student_logits is not None:
        if config.strategy == "megatron":
            return megatron_mask_outputs(config, data, student_logits, data_format)
        if data_format != "thd" or _sequence_parallel_size() > 1:
            raise NotImplementedError(
                "pdmctl's FSDP logits processor maps packed rows without Ulysses sequence parallelism only "
                "(ulysses_sequence_parallel_size=1)"
            )
        return mask_outputs_from_logits(config, data, student_logits)
    from verl.workers.utils.losses import ppo_loss

    from pdmctl.backends.verl import progress

    with diagnostics_scope(diagnostics_from_model_output(model_output, data)):
        result = ppo_loss(config, model_output, data, dp_group)
        if os.environ.get(DUMP_ENV):  # the engine tests' check, beside the dumps
            check_old_log_probs_unread(config, model_output, data, dp_group, result[0])
    progress.add("microbatches")  # the job's stall watchdog reads it (progress.py)
    return result


def check_old_log_probs_unread(config: Any, model_output: Any, data: Any, dp_group: Any, loss: torch.Tensor) -> None:
    """The engine tests' check that a run skipping VeRL's old-log-prob recompute trains as one that does not:
    VeRL's whole `ppo_loss` (policy, entropy and KL terms) again, with `old_log_probs` replaced by other
    values (the skip's rollout log-probs against a recompute's differ by the rollout/trainer gap; these by
    0.5 a token, a leaf that asks for its gradient). Appended to `old-log-probs-<pid>.jsonl` in the dump
    directory: both losses, and whether the loss reached the replacement at all (its gradient: None when
    the loss never read it). Any error is recorded, never raised: training goes on."""
    record: dict[str, Any] = {}
    try:
        replaced = (data["old_log_probs"].detach() - 0.5).requires_grad_(True)
        other = data.copy()
        other.set("old_log_probs", replaced)
        from verl.workers.utils.losses import ppo_loss

        again, _ = ppo_loss(config, model_output, other, dp_group)
        (grad,) = torch.autograd.grad(again, replaced, retain_graph=True, allow_unused=True)
        reached = grad is not None and bool((grad.values() if grad.is_nested else grad).abs().sum() > 0)
        record = {"loss": float(loss.detach()), "replaced": float(again.detach()), "gradient": grad is not None,
                  "reached": reached}  # fmt: skip
    except Exception as exc:  # a check, not training: say what failed
        record = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
    path = Path(os.environ[DUMP_ENV]) / f"old-log-probs-{os.getpid()}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as out:
        out.write(json.dumps(record) + "\n")


def _sequence_parallel_size() -> int:
    with contextlib.suppress(Exception):
        from verl.utils.ulysses import get_ulysses_sequence_parallel_world_size

        return int(get_ulysses_sequence_parallel_world_size())
    return 1
