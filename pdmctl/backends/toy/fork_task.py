"""The task of `model=toy-fork`: the LLM-like task (`llm_task`) with many-way forks inside the work.

The responses are `llm_task`'s two forms, of the same lengths, and the grader is the same (it reads
only the final answer):

    long  (19 tokens): word WORK t₁ s₁ t₂ s₂ a₁ a₀ + b₁ b₀ s₃ t₃ s₄ t₄ ANSWER a₀ b₀ EOS
    short  (5 tokens): word ANSWER a₀ b₀ EOS

Four of the work's eight template tokens are *phrasing slots* s₁…s₄: each is a fork over SLOT_OPTIONS
interchangeable tokens (its own synonyms), as an LLM's response forks between phrasings of the same
step. Which phrasing the demonstrations prefer depends on the context (the question's units digit a₀
and the slot): their law over a slot's options is SLOT_LAW rotated by (a₀ + slot) mod SLOT_OPTIONS,
so every option is plausible somewhere and the model must read the prompt to know which are likely
here. Three to four options hold most of a slot's mass (SLOT_LAW), so these are forks with three or
more plausible continuations: where the ratio and the KL's Ḋ can disagree (at a two-way fork Ḋ has
the sign of r − 1, docs/MATH.md), unlike `toy-llm`'s work/answer fork. The grader never reads the
phrasing, so RL has no reason to move it: the rollout's precision gap, not the policy's staleness,
is what moves those tokens out of the trust region.
"""

from __future__ import annotations

import torch

from pdmctl.backends.toy import llm_task
from pdmctl.backends.toy.llm_task import ANSWER, WORK
from pdmctl.backends.toy.task import EOS

SLOTS = 4
SLOT_OPTIONS = 6
FIRST_SLOT_TOKEN = 24  # slot j's options are tokens 24 + 6 j .. 29 + 6 j (24-47), below the words (64-)
SLOT_LAW = (0.34, 0.26, 0.18, 0.12, 0.06, 0.04)  # the demonstrations' law over a slot's options, rotated
TEMPLATE = llm_task.TEMPLATE[:4]  # t₁…t₄: the work's fixed wording around the slots
MAX_RESPONSE_LEN = llm_task.MAX_RESPONSE_LEN
LONG_LEN, SHORT_LEN = llm_task.LONG_LEN, llm_task.SHORT_LEN
SLOT_POSITIONS = (3, 5, 11, 13)  # the slots' positions in a long response
sample_train, heldout, answer_ids, score = (
    llm_task.sample_train,
    llm_task.heldout,
    llm_task.answer_ids,
    llm_task.score,
)


def slot_law(prompts: torch.Tensor) -> torch.Tensor:
    """float [B, SLOTS, SLOT_OPTIONS]: the demonstrations' law over each slot's options, given the prompt."""
    law = torch.tensor(SLOT_LAW)
    shift = (prompts[:, 1:2] + torch.arange(SLOTS)) % SLOT_OPTIONS  # [B, SLOTS]: a₀ + slot
    index = (torch.arange(SLOT_OPTIONS) - shift.unsqueeze(-1)) % SLOT_OPTIONS
    return law[index]


def slot_tokens(choices: torch.Tensor) -> torch.Tensor:
    """long [B, SLOTS]: the tokens of each slot's chosen option (choices long [B, SLOTS])."""
    return FIRST_SLOT_TOKEN + SLOT_OPTIONS * torch.arange(SLOTS) + choices


def sample_slots(prompts: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """long [B, SLOTS]: each slot's option, drawn from slot_law."""
    law = slot_law(prompts)
    return torch.multinomial(law.reshape(-1, SLOT_OPTIONS), 1, generator=generator).view(-1, SLOTS)


def responses(
    prompts: torch.Tensor, words: torch.Tensor, work: torch.Tensor, answers: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """long [B, MAX_RESPONSE_LEN]: the responses of each form (`work`: bool [B]; `slots`: the slots' tokens
    [B, SLOTS]), EOS-padded."""
    n = len(prompts)
    t = torch.tensor(TEMPLATE).expand(n, -1)
    long = torch.cat(
        [
            words.unsqueeze(1),
            torch.full((n, 1), WORK),
            t[:, :1], slots[:, :1], t[:, 1:2], slots[:, 1:2],
            prompts[:, :5],  # the restated question a₁ a₀ + b₁ b₀
            slots[:, 2:3], t[:, 2:3], slots[:, 3:4], t[:, 3:4],
            torch.full((n, 1), ANSWER),
            answers,
            torch.full((n, 1), EOS),
        ],
        dim=1,
    )  # fmt: skip
    short = torch.cat(
        [
            words.unsqueeze(1),
            torch.full((n, 1), ANSWER),
            answers,
            torch.full((n, MAX_RESPONSE_LEN - SHORT_LEN + 1), EOS),
        ],
        dim=1,
    )
    return torch.where(work.unsqueeze(1), long, short)
