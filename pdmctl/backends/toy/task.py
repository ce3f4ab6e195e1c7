"""The task: addition with an exact-match reward, behind a free word and in many surface forms.

A prompt is `a₁ a₀ + b₁ b₀ =` (operands 0-49, zero-padded, so every prompt has
the same length and a batch needs no padding). A response is a free *word*,
then the two digits of `a + b` (zero-padded) and EOS. The first digit may be
written in any of VARIANTS surface forms (the plain digit is the first of
them), as an LLM may open an answer in countless phrasings that a grader reads
alike: the reward reads the digit a form stands for, never which form, and
never the word.

The word and the first digit are the forking positions (docs/TESTBED.md): the
demonstrations draw words and forms from Zipf laws, so after the warm-up they
have high entropy and a long tail over the 4,096-token vocabulary, while the
second digit and EOS are near-deterministic. The reward depends on the first
digit, so RL moves that position's mass between digits, tail included: top-K
truncation, the tail bucket and the tail estimators act there, as they do on
an LLM's forking tokens.

The held-out sets `toy24` and `toy25` are fixed (their own seeds, independent
of any run) and never appear in the training stream.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cache

import torch

VOCAB_SIZE = 4096
PLUS, EQUALS, EOS = 10, 11, 12  # 0-9 are the digits themselves
FIRST_FORM = 16  # tokens 16.. are the other surface forms of the digits, VARIANTS - 1 per digit
VARIANTS = 64  # forms per digit, the plain digit included
FORM_ZIPF_EXPONENT = 1.0  # p(form of rank r) ∝ 1/r: the top 10 forms hold 62%, the top 50 95%
FIRST_WORD = FIRST_FORM + 10 * (VARIANTS - 1)  # tokens FIRST_WORD.. (646-4095) are the words
N_WORDS = VOCAB_SIZE - FIRST_WORD
WORD_ZIPF_EXPONENT = 1.0  # the top 20 words hold 41% of the mass
FREE_LEN = 1  # the free-form opening: one word
PROMPT_LEN = 6  # a₁ a₀ + b₁ b₀ =
ANSWER_LEN = 3  # two answer digits, zero-padded (49 + 49 = 98; 3 + 4 = 07), and EOS
MAX_RESPONSE_LEN = FREE_LEN + ANSWER_LEN
MAX_OPERAND = 49
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

    def to(self, device: torch.device | str) -> Problems:
        """The same problems on `device` (the trainer's: CPU, or a GPU)."""
        return Problems(self.prompts.to(device), self.answers.to(device), self.answer_lens.to(device))

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
    total = a + b  # at most 98: two digits, the tens digit (where the carry lands) first
    answers = torch.stack([total // 10, total % 10, torch.full((n,), EOS)], dim=1)
    return Problems(prompts, answers, torch.full((n,), ANSWER_LEN))


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


@cache
def _zipf(n: int, exponent: float) -> torch.Tensor:
    ranks = torch.arange(1, n + 1, dtype=torch.float64)
    weights = ranks.pow(-exponent)
    return (weights / weights.sum()).float()


def sample_words(n: int, generator: torch.Generator) -> torch.Tensor:
    """long [n]: opening words, Zipf-drawn: most are rare tokens."""
    return FIRST_WORD + torch.multinomial(
        _zipf(N_WORDS, WORD_ZIPF_EXPONENT), n, replacement=True, generator=generator
    )


@cache
def form_distribution() -> torch.Tensor:
    """float [VARIANTS]: the demonstrations' Zipf law over a digit's forms (form 0, the plain digit, is
    the most frequent)."""
    return _zipf(VARIANTS, FORM_ZIPF_EXPONENT)


def form(digits: torch.Tensor, variants: torch.Tensor) -> torch.Tensor:
    """The token of each digit's form `variant` (0: the plain digit)."""
    return torch.where(variants == 0, digits, FIRST_FORM + digits * (VARIANTS - 1) + variants - 1)


def digit_of(tokens: torch.Tensor) -> torch.Tensor:
    """The digit each token stands for, -1 where it stands for none."""
    forms = (tokens - FIRST_FORM).div(VARIANTS - 1, rounding_mode="floor")
    is_form = (tokens >= FIRST_FORM) & (tokens < FIRST_WORD)
    return torch.where(tokens < 10, tokens, torch.where(is_form, forms, -1))


def is_careful(words: torch.Tensor) -> torch.Tensor:
    """bool: the words of odd rank (half of them, 54% of the Zipf mass), after which the
    demonstrations' first digit is more often right (basemodel.warm_up): the grader never reads
    the word, but the answer depends on it, as on an LLM's forking tokens."""
    return (words - FIRST_WORD) % 2 == 0


def demonstrations(words: torch.Tensor, answers: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """long [B, MAX_RESPONSE_LEN]: the words, then the answers with their first digit in a
    Zipf-drawn form."""
    variants = torch.multinomial(form_distribution(), len(answers), replacement=True, generator=generator)
    lead = form(answers[:, :1], variants.unsqueeze(1))
    return torch.cat([words.unsqueeze(1), lead, answers[:, 1:]], dim=1)


def response_lengths(responses: torch.Tensor) -> torch.Tensor:
    """long [B]: generated tokens up to and including the first EOS (all of them without EOS)."""
    is_eos = responses == EOS
    return torch.where(is_eos.any(1), is_eos.long().argmax(1) + 1, responses.shape[1])


def response_mask(responses: torch.Tensor) -> torch.Tensor:
    """float [B, T]: 1 on the tokens that belong to the response (the rest were sampled past EOS)."""
    positions = torch.arange(responses.shape[1], device=responses.device)
    return (positions < response_lengths(responses).unsqueeze(1)).float()


def answer_ids(responses: torch.Tensor) -> torch.Tensor:
    """long [B]: the answer each response gives as a number (10 × first digit + second digit, the first
    in any form), -1 where it gives none (not two digits then EOS). `score` is 1 exactly where this is
    the problem's answer; maj@k votes on it."""
    first, second = digit_of(responses[:, FREE_LEN]), responses[:, FREE_LEN + 1]
    ended = (responses[:, -1] == EOS) & (response_lengths(responses) == MAX_RESPONSE_LEN)  # EOS right after
    formed = ended & (first >= 0) & (second < 10)
    return torch.where(formed, 10 * first + second, -1)


def score(problems: Problems, responses: torch.Tensor) -> torch.Tensor:
    """Exact-match reward, float [B]: the answer digits (the first in any form), then EOS, nothing else."""
    answer = responses[:, FREE_LEN:]
    read = torch.cat([digit_of(answer[:, :1]), answer[:, 1:]], dim=1)
    within = torch.arange(answer.shape[1], device=answer.device) < problems.answer_lens.unsqueeze(1)
    same = ((read == problems.answers) | ~within).all(1)
    return (same & (response_lengths(responses) == FREE_LEN + problems.answer_lens)).float()
