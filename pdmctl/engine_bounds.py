"""Bounds on an engine's own config values (`verl.<key>=<value>` in a grid): sizes and counts, fractions
and integers that fit 64 bits, checked before anything is submitted (the engine would refuse them on the
node, after the queue wait). `problem()` names the first value out of bounds in one line, else None."""

from __future__ import annotations

import math
import re
from typing import Any

ENGINE_COUNT_MAX = 10**9  # a size or a count beyond this is a typo (or an overflow on the node), never a plan
# keys of an engine's config that are sizes or counts (>= 1) and fractions in (0, 1]; a few that VeRL
# sets itself (-1) or where 0 means "none" (rollout.nnodes: colocated) take their sentinel too
_ENGINE_COUNT = re.compile(r"(batch_size|batch_size_per_gpu|_parallel_size|(^|\.)n|n_gpus_per_node|nnodes|"
                           r"max_prompt_length|max_response_length|ppo_epochs|max_token_len_per_gpu|"
                           r"total_training_steps|total_epochs|max_num_batched_tokens|max_model_len|max_num_seqs)$")
_ENGINE_FRACTION = re.compile(r"(gpu_memory_utilization|top_p)$")
_ENGINE_SENTINEL = {"optim.total_training_steps": -1, "nnodes": 0}


def problem(key: str, value: Any) -> str | None:
    """`verl.<key>` sizes and counts in [1, ENGINE_COUNT_MAX], fractions in (0, 1]: what the engine would
    refuse on the node after the queue wait, refused here. A mapping's values are checked under their
    own keys (`verl.critic={ppo_micro_batch_size_per_gpu: -1}` as `verl.critic.ppo_micro_batch_size_per_gpu`),
    a list's items under the list's key."""
    if isinstance(value, dict):
        for inner, item in value.items():
            if (found := problem(f"{key}.{inner}", item)) is not None:
                return found
        return None
    if isinstance(value, list | tuple):
        for item in value:
            if (found := problem(key, item)) is not None:
                return found
        return None
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    if _ENGINE_FRACTION.search(key):
        if not (math.isfinite(value) and 0 < value <= 1):
            return f"{key}: must be a fraction in (0, 1], got {value!r}"
    elif _ENGINE_COUNT.search(key):
        sentinel = next((v for end, v in _ENGINE_SENTINEL.items() if key.endswith(end) and key != "verl.trainer.nnodes"),
                        None)  # fmt: skip
        if value == sentinel:
            return None
        if not (isinstance(value, int) and 1 <= value <= ENGINE_COUNT_MAX):
            return f"{key}: must be a whole number from 1 to {ENGINE_COUNT_MAX:,}, got {value!r:.40}"
    elif isinstance(value, int) and abs(value) > 2**63 - 1:
        return f"{key}: {value!r:.40} does not fit a 64-bit integer"
    return None
