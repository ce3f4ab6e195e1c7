"""pass@k and maj@k (pdmctl.report.passk) against enumerating every k-subset of a problem's samples, and the
testbed's answers against its grader."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from pdmctl.backends.toy import llm_task
from pdmctl.backends.toy import task as addition
from pdmctl.report import passk


def brute_force(correct: list[int], answers: list[int], k: int) -> tuple[float, float]:
    """(pass@k, maj@k) as the mean over every k-subset of the samples: any correct; the correct answers'
    share of the answers tied for the most votes (no vote from a sample without an answer)."""
    right = {a for c, a in zip(correct, answers, strict=True) if c}
    hits = majority = 0.0
    subsets = list(itertools.combinations(range(len(correct)), k))
    for subset in subsets:
        hits += any(correct[i] for i in subset)
        votes: dict[int, int] = {}
        for i in subset:
            if answers[i] != passk.NO_ANSWER:
                votes[answers[i]] = votes.get(answers[i], 0) + 1
        if votes:
            top = [a for a, v in votes.items() if v == max(votes.values())]
            majority += sum(a in right for a in top) / len(top)
    return hits / len(subsets), majority / len(subsets)


def test_unbiased_pass_and_majority_at_k_equal_enumerating_every_subset() -> None:
    rng = np.random.default_rng(0)
    problems = [([1, 0, 0, 0], [7, 3, 3, -1]),  # ties: 7 against 3 at k = 2, 3
                ([1, 1, 0, 0, 0, 0], [5, 5, 2, 2, 4, 4]),  # a three-way tie at the top with all six
                ([0, 0, 0], [-1, -1, -1]),  # nobody answers
                ([1, 1, 1, 1, 1], [9, 9, 9, 9, 9]),
                ([1, 1, 0, 0, 0], [1, 2, 3, 3, -1])]  # two answers graded correct (a judge's equivalents)
    for _ in range(40):
        n = int(rng.integers(1, 11))
        answers = rng.integers(-1, 4, n)  # few distinct answers: ties are common
        problems.append(([int(a == 2) for a in answers], [int(a) for a in answers]))
    for correct, answers in problems:
        ks = list(range(1, len(correct) + 1))
        expected = np.array([brute_force(correct, answers, k) for k in ks])
        assert passk.pass_at_k(np.array([correct]), ks)[0] == pytest.approx(expected[:, 0], abs=1e-12)
        assert passk.majority_at_k(correct, answers, ks) == pytest.approx(expected[:, 1], abs=1e-12)
    # VeRL PR 7240's case: one correct of four is pass@4 = 1 (VeRL's bootstrapped best@4 says 0.684)
    assert passk.pass_at_k(np.array([[1, 0, 0, 0]]), [1, 4])[0] == pytest.approx([0.25, 1.0])
    # a tie is a tie: [right, wrong] at k = 2 is half a win; the expectation over the 4 samples above
    assert passk.majority_at_k([1, 0], [1, 2], [2])[0] == pytest.approx(0.5)
    assert passk.ks_for(16) == [1, 2, 4, 8, 16] and passk.ks_for(12) == [1, 2, 4, 8, 12]
    with pytest.raises(ValueError, match="graded both correct and wrong"):
        passk.majority_at_k([1, 0], [3, 3], [1])
    # a whole evaluation: the mean over problems; pass@1 = maj@1 = the mean accuracy
    correct = np.array([[1, 0, 1, 1], [0, 0, 0, 1]])
    passing, majority = passk.scores(correct, np.where(correct == 1, 5, np.array([[1, 2, 1, 1], [3, 3, 4, 4]])), [1, 4])
    assert passing[0] == majority[0] == pytest.approx(correct.mean())


@pytest.mark.parametrize("task", [addition, llm_task])
def test_the_testbeds_answer_is_the_graders(task) -> None:
    """`answer_ids` names the answer exactly where `score` grades a response correct: maj@k's votes."""
    problems = task.heldout("toy24")
    g = torch.Generator().manual_seed(0)
    vocab = addition.VOCAB_SIZE if task is addition else task.VOCAB_SIZE
    width = task.MAX_RESPONSE_LEN
    noise = torch.randint(0, vocab, (len(problems), width), generator=g)
    if task is addition:
        right = torch.cat([torch.full((len(problems), 1), addition.FIRST_WORD), problems.answers], 1)
        truth = 10 * problems.answers[:, 0] + problems.answers[:, 1]
    else:
        right = task.responses(problems.prompts, torch.full((len(problems),), task.FIRST_WORD),
                               torch.zeros(len(problems), dtype=torch.bool), problems.answers)  # fmt: skip
        truth = problems.answers[:, 0] * task.VOCAB_SIZE + problems.answers[:, 1]
    wrong = right.clone()
    wrong[:, -2 if task is addition else 3] = (wrong[:, -2 if task is addition else 3] + 1) % 10
    unended = right.clone()  # the right digits, never an EOS: no answer
    unended[unended == addition.EOS] = vocab - 1
    responses = torch.cat([noise, right, wrong, unended])
    four = addition.Problems(*(torch.cat([getattr(problems, f)] * 4) for f in ("prompts", "answers", "answer_lens")))
    answers, scores = task.answer_ids(responses), task.score(four, responses)
    assert torch.equal(scores == 1, answers == truth.repeat(4))
    assert (answers[3 * len(problems):] == -1).all()
    p = len(problems)
    assert scores[p : 2 * p].all() and (answers[2 * p : 3 * p] >= 0).all()  # right; wrong but answered
