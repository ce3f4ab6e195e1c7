"""The LLM-like task of `model=toy-llm`: a long, mostly deterministic response behind one free word.

A prompt is the addition prompt of `task` (`a₁ a₀ + b₁ b₀ =`, operands 0-49, the same held-out
pairs). The answer the grader reads is two digits, `a₀ b₀` (the operands' units digits), after an
ANSWER marker and followed by EOS. A response comes in one of two forms:

    long  (19 tokens): word WORK t₁…t₄ a₁ a₀ + b₁ b₀ t₅…t₈ ANSWER a₀ b₀ EOS
    short  (5 tokens): word ANSWER a₀ b₀ EOS

The word is free (Zipf over 448 words: the long-tailed fork); the choice between WORK and ANSWER
after it is the second fork; the "work" (a fixed template t₁…t₈ around a restatement of the
question) is deterministic, as most of an LLM's tokens are. In the demonstrations the work makes
the answer more reliable (each answer digit is replaced at random with probability 0.1 after the
work, 0.5 without), and a careful word (task.is_careful) makes the work likelier (0.85 vs 0.35):
so RL gains by choosing careful words, choosing the work, which lengthens the response (about 13
tokens at the base, up to 19), and sharpening the digits. The grader reads only the final answer.

What it models: most positions near-deterministic (top-20 mass ≈ 1), a few percent of forking
positions with a long tail over the vocabulary, a response of tens of tokens whose length RL can
move. What it does not: the answer is a copy, not a computation, so the base needs no sudden
transition to learn it (the addition's second digit) and its warm-up is short and lands
in the same place on any CPU; the vocabulary is 512 tokens (a run of the default length stays
within a minute of two cores).
"""

from __future__ import annotations

from functools import cache

import torch

from pdmctl.backends.toy import task as addition
from pdmctl.backends.toy.task import EOS, Problems

VOCAB_SIZE = 512
WORK, ANSWER = 13, 14
TEMPLATE = tuple(range(16, 24))  # t₁…t₈: the work's fixed wording
FIRST_WORD = 64  # tokens 64-511 are the words
N_WORDS = VOCAB_SIZE - FIRST_WORD
WORD_ZIPF_EXPONENT = 1.0  # the top 20 words hold about 54% of the mass
PROMPT_LEN = addition.PROMPT_LEN
ANSWER_LEN = 2
LONG_LEN = 1 + 1 + len(TEMPLATE) + 5 + 1 + ANSWER_LEN + 1  # 19
SHORT_LEN = 1 + 1 + ANSWER_LEN + 1  # 5
MAX_RESPONSE_LEN = LONG_LEN
ANSWER_OFFSET = {True: LONG_LEN - 1 - ANSWER_LEN, False: SHORT_LEN - 1 - ANSWER_LEN}  # by "has the work"


def _from_pairs(pairs: torch.Tensor) -> Problems:
    prompts = addition.encode(pairs).prompts
    answers = torch.stack([pairs[:, 0] % 10, pairs[:, 1] % 10], dim=1)
    return Problems(prompts, answers, torch.full((len(pairs),), ANSWER_LEN))


def sample_train(n: int, generator: torch.Generator) -> Problems:
    """n training problems drawn uniformly from the addition task's training pairs (same stream)."""
    pool = addition._train_pairs()
    return _from_pairs(pool[torch.randint(len(pool), (n,), generator=generator)])


def heldout(name: str) -> Problems:
    return _from_pairs(addition.heldout_pairs()[name])


@cache
def _word_law() -> torch.Tensor:
    ranks = torch.arange(1, N_WORDS + 1, dtype=torch.float64)
    weights = ranks.pow(-WORD_ZIPF_EXPONENT)
    return (weights / weights.sum()).float()


def sample_words(n: int, generator: torch.Generator) -> torch.Tensor:
    return FIRST_WORD + torch.multinomial(_word_law(), n, replacement=True, generator=generator)


def is_careful(words: torch.Tensor) -> torch.Tensor:
    """bool: the words of odd rank (54% of the Zipf mass), after which the work is likelier."""
    return (words - FIRST_WORD) % 2 == 0


def responses(
    prompts: torch.Tensor, words: torch.Tensor, work: torch.Tensor, answers: torch.Tensor
) -> torch.Tensor:
    """long [B, MAX_RESPONSE_LEN]: the responses of each form (`work`: bool [B]), EOS-padded."""
    n = len(prompts)
    template = torch.tensor(TEMPLATE).expand(n, -1)
    long = torch.cat(
        [
            words.unsqueeze(1),
            torch.full((n, 1), WORK),
            template[:, :4],
            prompts[:, :5],  # the restated question a₁ a₀ + b₁ b₀
            template[:, 4:],
            torch.full((n, 1), ANSWER),
            answers,
            torch.full((n, 1), EOS),
        ],
        dim=1,
    )
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


def _graded(sampled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bool [B]: the response has the answer's form, long [B, ANSWER_LEN]: the tokens in its place)."""
    lengths = addition.response_lengths(sampled)
    within = torch.arange(sampled.shape[1], device=sampled.device) < lengths.unsqueeze(1)
    start = (lengths - 1 - ANSWER_LEN).clamp_min(1)  # the position of the answer's first digit
    marker = sampled.gather(1, (start - 1).unsqueeze(1)).squeeze(1)
    digits = sampled.gather(1, start.unsqueeze(1) + torch.arange(ANSWER_LEN, device=sampled.device))
    one_marker = ((sampled == ANSWER) & within).sum(1) == 1
    ended = sampled.gather(1, (lengths - 1).unsqueeze(1)).squeeze(1) == EOS
    return ended & one_marker & (marker == ANSWER) & (lengths >= SHORT_LEN), digits


def answer_ids(sampled: torch.Tensor) -> torch.Tensor:
    """long [B]: the two tokens the grader reads as one number (first × VOCAB_SIZE + second), -1 where the
    response has no answer: `score` is 1 exactly where this is the problem's answer."""
    formed, digits = _graded(sampled)
    return torch.where(formed, digits[:, 0] * VOCAB_SIZE + digits[:, 1], -1)


def score(problems: Problems, sampled: torch.Tensor) -> torch.Tensor:
    """float [B]: 1 where the response, up to its first EOS, ends in ANSWER, the right two digits and
    EOS, with ANSWER nowhere else: the grader reads only the final answer, never the work."""
    formed, digits = _graded(sampled)
    return (formed & (digits == problems.answers).all(1)).float()
