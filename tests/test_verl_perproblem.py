"""Per-problem records of VeRL's validation, taken where VeRL's own V0 trainer has them:
its `extract_reward` and `_val_metrics_update`, patched, on a validation batch as `_validate` builds it."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("verl")


def test_the_records_are_verls_own_grades_and_their_mean_is_its_mean_at_16(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from verl import DataProto
    from verl.trainer.ppo import ray_trainer

    from pdmctl.backends.verl import perproblem

    # restored after the test: the patch is the TaskRunner's, for its whole life
    monkeypatch.setattr(ray_trainer, "extract_reward", ray_trainer.extract_reward)
    monkeypatch.setattr(ray_trainer.RayPPOTrainer, "_val_metrics_update", ray_trainer.RayPPOTrainer._val_metrics_update)
    monkeypatch.setattr(ray_trainer, "_pdmctl_per_problem", False, raising=False)
    monkeypatch.setattr(perproblem, "_PENDING", {})
    perproblem.install()
    perproblem.install()  # once
    assert ray_trainer._pdmctl_per_problem

    rng = np.random.default_rng(0)
    n, problems = 4, {"aime24": [5, 1, 3], "aime25": [0, 2], "math_dapo": [9]}
    sources, uids, acc, pred = [], [], [], []
    for source, indices in problems.items():  # the batch in the parquet's order is not assumed
        batch_uids = [f"{source}-{i}-uuid" for i in indices]
        rows = [(source, uid, index) for uid, index in zip(batch_uids, indices, strict=True) for _ in range(n)]
        grades = rng.random(len(rows)) < 0.4
        answers = np.array([str(int(rng.integers(0, 3))) for _ in rows], dtype=object)
        answers[~grades & (rng.random(len(rows)) < 0.3)] = "[INVALID]"
        batch = DataProto.from_dict(
            tensors={"rm_scores": torch.zeros(len(rows), 2)},
            non_tensors={"uid": np.array([r[1] for r in rows], dtype=object),
                         "data_source": np.array([r[0] for r in rows], dtype=object),
                         "extra_info": np.array([{"index": r[2], "split": "test"} for r in rows], dtype=object),
                         "acc": grades, "pred": answers},
            meta_info={"validate": True, "reward_extra_keys": ["acc", "pred"]},
        )  # fmt: skip
        _, extra = ray_trainer.extract_reward(batch)  # as `_validate` calls it (the patched module global)
        sources += [r[0] for r in rows]
        uids += [r[1] for r in rows]
        acc += list(extra["acc"])
        pred += list(extra["pred"])
    infos = {"reward": [float(a) for a in acc], "acc": acc, "pred": pred}
    metrics = ray_trainer.RayPPOTrainer._val_metrics_update(None, np.array(sources, dtype=object), uids, infos, [])

    for dataset, indices in (("aime24", [5, 1, 3]), ("aime25", [0, 2])):
        record = perproblem.take(dataset)
        assert record is not None and perproblem.take(dataset) is None  # taken once
        assert record["problems"] == sorted(indices)
        assert np.shape(record["correct"]) == np.shape(record["answers"]) == (len(indices), n)
        assert np.mean(record["accuracies"]) == pytest.approx(metrics[f"val-core/{dataset}/acc/mean@{n}"])
        for correct, answers in zip(record["correct"], record["answers"], strict=True):
            assert all(a >= 0 for a, c in zip(answers, correct, strict=True) if c)  # a correct sample answers
    assert perproblem.take("math_dapo") is None  # not a data source the report reads

    from pdmctl.report import passk

    record_24 = perproblem.records(sources, uids, infos, {})["aime24"]  # no index known: the batch's order
    assert record_24["problems"] == [-1, -1, -1]
    passk.scores(np.array(record_24["correct"]), np.array(record_24["answers"]), passk.ks_for(n))  # grades agree
