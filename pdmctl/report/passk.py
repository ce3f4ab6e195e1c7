"""pass@k and maj@k, unbiased, from each problem's n samples: their correctness and their answers.

Both are the expectation, over the C(n, k) ways of choosing k of a problem's n samples, of a score of
those k, averaged over problems; with k = n it is the score of all n, with k < n every sample counts
(not only the first k, which is an unbiased estimate too but a noisier one).

pass@k: 1 if any of the k is correct. Its expectation is 1 − C(n − c, k) / C(n, k) for c correct of n
(Chen et al. 2021, "Evaluating Large Language Models Trained on Code"), the chance that k draws
without replacement hit a correct one: `scipy.stats.hypergeom.sf(0, n, c, k)`. VeRL's best@N
bootstraps k of n with replacement, which is biased low (VeRL PR 7240: 1 correct of 4 gives best@4 =
0.684 instead of 1).

maj@k: the k samples vote with their answers (samples with no answer do not vote); the score is 1 if
the correct answer has strictly the most votes, 1/t if it ties with t − 1 other answers for the most
(a tie is a tie, not a win), 0 otherwise, and 0 when none of the k answers. No library computes its
expectation; `majority_at_k` does it exactly, by counting: for each count x of correct votes, the
ways the other answers' votes stay at most x, and how many of them reach x (a dynamic programme over
the answers). tests/test_report_passk.py checks both against enumerating every subset.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
from scipy import stats as sps
from scipy.special import comb

NO_ANSWER = -1


def ks_for(n: int) -> list[int]:
    """The k a table shows for n samples per problem: powers of two up to n, and n."""
    ks = [k for k in (2**i for i in range(n.bit_length())) if k <= n]
    return ks + ([n] if ks[-1] != n else [])


def pass_at_k(correct: np.ndarray, ks: Sequence[int]) -> np.ndarray:
    """Unbiased pass@k per problem: `correct` is problems × n (0/1); answers problems × len(ks)."""
    correct = np.asarray(correct)
    n = correct.shape[1]
    c = correct.sum(axis=1)[:, None]
    return sps.hypergeom.sf(0, n, c, np.asarray(ks)[None, :])


def _groups(correct: Sequence[int], answers: Sequence[int]) -> tuple[list[int], list[int], int]:
    """(sizes of the correct answers' groups, sizes of the wrong answers' groups, samples with no answer)."""
    graded: dict[int, set[int]] = {}
    for c, a in zip(correct, answers, strict=True):
        if a != NO_ANSWER:
            graded.setdefault(a, set()).add(int(c))
    if any(len(v) > 1 for v in graded.values()):
        raise ValueError("maj@k: one answer is graded both correct and wrong within a problem")
    if any(int(c) and a == NO_ANSWER for c, a in zip(correct, answers, strict=True)):
        raise ValueError("maj@k: a sample graded correct has no answer")
    sizes = Counter(a for a in answers if a != NO_ANSWER)
    right = sorted(sizes[a] for a, grades in graded.items() if 1 in grades)
    wrong = sorted(sizes[a] for a, grades in graded.items() if 1 not in grades)
    return right, wrong, sum(a == NO_ANSWER for a in answers)


@lru_cache(maxsize=65536)
def _group_wins(size: int, others: tuple[int, ...], silent: int) -> np.ndarray:
    """For one answer with `size` samples, other answers with `others` samples each and `silent` samples
    with no answer (n in all): the number of k-subsets, for k = 0..n, weighted by the answer's share of
    the win (1 alone at the top, 1/t tied with t − 1 others; 0 below)."""
    n = size + sum(others) + silent
    total = np.zeros(n + 1)
    silent_ways = comb(silent, np.arange(n + 1))  # C(silent, j)
    for x in range(1, size + 1):  # x votes for this answer
        # ways[s, t]: picks of s samples from the other answers, each at most x, t of them at exactly x
        ways = np.zeros((n + 1, len(others) + 1))
        ways[0, 0] = 1.0
        for b in others:
            grown = np.zeros_like(ways)
            for y in range(min(b, x) + 1):
                w = comb(b, y)
                if y < x:
                    grown[y:, :] += w * ways[: n + 1 - y, :]
                else:
                    grown[y:, 1:] += w * ways[: n + 1 - y, :-1]
            ways = grown
        shared = ways @ (1.0 / np.arange(1, len(others) + 2))  # s -> weighted count over t
        # k = x + s + j: the silent samples fill the rest
        spread = np.convolve(shared, silent_ways)[: n + 1 - x]
        total[x:] += comb(size, x) * spread
    return total


def majority_at_k(correct: Sequence[int], answers: Sequence[int], ks: Sequence[int]) -> np.ndarray:
    """Unbiased maj@k of one problem for each k (ties split, see the module's docstring)."""
    right, wrong, silent = _groups(correct, answers)
    n = len(answers)
    wins = np.zeros(n + 1)
    for i, size in enumerate(right):
        others = tuple(sorted(right[:i] + right[i + 1 :] + wrong))
        wins += _group_wins(size, others, silent)
    ks = np.asarray(ks)
    return wins[ks] / comb(n, ks)


def scores(correct: np.ndarray, answers: np.ndarray, ks: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(pass@k, maj@k) of one evaluation: the mean over problems, for each k; `correct` and `answers` are
    problems × n."""
    correct, answers = np.asarray(correct), np.asarray(answers)
    passing = pass_at_k(correct, ks).mean(axis=0)
    majority = np.mean([majority_at_k(c, a, ks) for c, a in zip(correct, answers, strict=True)], axis=0)
    return passing, majority
