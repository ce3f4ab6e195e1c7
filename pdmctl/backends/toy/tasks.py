"""The task each model preset is trained and evaluated on: what the trainer, the rollout engine and
the analysis ask of it. `toy-small` has the addition task (`task`), `toy-llm` the LLM-like one
(`llm_task`); both share the token ids of the digits, `+`, `=` and EOS, the prompts, the held-out
pairs and the EOS-based response mask."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdmctl.backends.toy import fork_task, llm_task
from pdmctl.backends.toy import task as addition
from pdmctl.backends.toy.task import Problems


@dataclass(frozen=True)
class Task:
    name: str
    max_response_len: int
    sample_train: Callable[[int, torch.Generator], Problems]
    heldout: Callable[[str], Problems]
    score: Callable[[Problems, torch.Tensor], torch.Tensor]
    kv_cache: bool = (
        False  # the rollout engine's (False keeps toy-small's rollouts as they were, bit for bit)
    )
    response_lengths: Callable[[torch.Tensor], torch.Tensor] = addition.response_lengths
    response_mask: Callable[[torch.Tensor], torch.Tensor] = addition.response_mask
    answer_ids: Callable[[torch.Tensor], torch.Tensor] = addition.answer_ids  # maj@k's votes (-1: none)
    eval_sets: tuple[str, ...] = ("toy24", "toy25")  # the held-out sets `heldout` answers, evaluated in this order


TASKS: dict[str, Task] = {
    "addition": Task(
        "addition", addition.MAX_RESPONSE_LEN, addition.sample_train, addition.heldout, addition.score
    ),
    "chain": Task(
        "chain", llm_task.MAX_RESPONSE_LEN, llm_task.sample_train, llm_task.heldout, llm_task.score, True,
        answer_ids=llm_task.answer_ids,
    ),
    # toy-fork's: the same prompts, lengths and grader as "chain" (fork_task only changes the demonstrations)
    "fork": Task(
        "fork", fork_task.MAX_RESPONSE_LEN, fork_task.sample_train, fork_task.heldout, fork_task.score, True,
        answer_ids=fork_task.answer_ids,
    ),
}


def task_of(preset_name: str) -> Task:
    from pdmctl.backends.toy.model import MODEL_PRESETS

    return TASKS[getattr(MODEL_PRESETS[preset_name], "task", "addition")]
