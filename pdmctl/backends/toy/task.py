"""The task: two-digit addition with an exact-match reward.

A prompt is `a₁ a₀ + b₁ b₀ =` (operands zero-padded, so every prompt has the
same length and a batch needs no padding); the answer is the digits of `a + b`
followed by EOS. Everything that is not a digit, `+`, `=` or EOS is a
distractor token: the vocabulary is 256 wide, as an LLM's is wide, so that the
policy's tail beyond the top-K is made of real tokens.

The held-out sets `toy24` and `toy25` are fixed (their own seeds, independent
of any run) and never appear in the training stream.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cache

import torch

VOCAB_SIZE = 256
PLUS, EQUALS, EOS = 10, 11, 12  # 0-9 are the digits themselves
PROMPT_LEN = 6  # a₁ a₀ + b₁ b₀ =
MAX_RESPONSE_LEN = 4  # up to three answer digits (99 + 99 = 198) and EOS
MAX_OPERAND = 99
HELDOUT_SIZE = 40
HELDOUT_SEEDS = {"toy24": 2024, "toy25": 2025}


@dataclass(frozen=True)
class Problems:
    """A batch of problems: the prompt tokens and the exact answer token sequences."""

    prompts: torch.Tensor  # long [B, PROMPT_LEN]
    answers: torch.Tensor  # long [B, MAX_RESPONSE_LEN]: answer digits, EOS, then EOS padding
    answer_lens: torch.Tensor  # long [B]: digits + EOS

    def __len__(self) -> int:
        return self.prompts.shape[0]

    def repeat(self, n: int) -> Problems:
        """Each problem n times in a row (a GRPO group is n consecutive rows)."""
        return Problems(
            self.prompts.repeat_interleave(n, 0),
            self.answers.repeat_interleave(n, 0),
            self.answer_lens.repeat_interleave(n, 0),
        )


def encode(pairs: torch.Tensor) -> Problems:
    """Problems for operand pairs, long [B, 2]."""
    a, b = pairs[:, 0], pairs[:, 1]
    n = pairs.shape[0]
    prompts = torch.stack(
        [a // 10, a % 10, torch.full((n,), PLUS), b // 10, b % 10, torch.full((n,), EQUALS)],
        dim=1,
    )
    total = a + b
    n_digits = 1 + (total >= 10).long() + (total >= 100).long()
    answers = torch.full((n, MAX_RESPONSE_LEN), EOS, dtype=torch.long)
    for pos in range(3):  # digit `pos` from the left exists when pos < n_digits
        power = 10 ** (n_digits - 1 - pos).clamp_min(0)
        answers[:, pos] = torch.where(pos < n_digits, (total // power) % 10, EOS)
    return Problems(prompts, answers, n_digits + 1)


@cache
def heldout_pairs() -> dict[str, torch.Tensor]:
    """The fixed evaluation sets: HELDOUT_SIZE distinct pairs each, disjoint from each other."""
    taken: set[tuple[int, int]] = set()
    sets: dict[str, torch.Tensor] = {}
    for name, seed in HELDOUT_SEEDS.items():
        rng = random.Random(seed)
        pairs: list[tuple[int, int]] = []
        while len(pairs) < HELDOUT_SIZE:
            pair = (rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND))
            if pair not in taken:
                taken.add(pair)
                pairs.append(pair)
        sets[name] = torch.tensor(pairs, dtype=torch.long)
    return sets


def heldout(name: str) -> Problems:
    return encode(heldout_pairs()[name])


@cache
def _train_pairs() -> torch.Tensor:
    """Every operand pair that is not held out, long [P, 2]."""
    held = {tuple(p) for pairs in heldout_pairs().values() for p in pairs.tolist()}
    grid = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1) if (a, b) not in held]
    return torch.tensor(grid, dtype=torch.long)


def sample_train(n: int, generator: torch.Generator) -> Problems:
    """n training problems drawn uniformly (with replacement) from the training pairs."""
    pool = _train_pairs()
    return encode(pool[torch.randint(len(pool), (n,), generator=generator)])


def response_lengths(responses: torch.Tensor) -> torch.Tensor:
    """long [B]: generated tokens up to and including the first EOS (all of them without EOS)."""
    is_eos = responses == EOS
    return torch.where(is_eos.any(1), is_eos.long().argmax(1) + 1, responses.shape[1])


def response_mask(responses: torch.Tensor) -> torch.Tensor:
    """float [B, T]: 1 on the tokens that belong to the response (the rest were sampled past EOS)."""
    return (torch.arange(responses.shape[1]) < response_lengths(responses).unsqueeze(1)).float()


def score(problems: Problems, responses: torch.Tensor) -> torch.Tensor:
    """Exact-match reward, float [B]: the answer digits, then EOS, nothing else."""
    within = torch.arange(responses.shape[1]) < problems.answer_lens.unsqueeze(1)
    same = ((responses == problems.answers) | ~within).all(1)
    return (same & (response_lengths(responses) == problems.answer_lens)).float()
