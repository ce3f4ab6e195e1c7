"""Each held-out problem's samples at each VeRL validation, stored as the testbed stores them.

VeRL logs only `val-core/<source>/acc/mean@16`, the mean over problems; the report's seed × problem
interval and its unbiased pass@k / maj@k need each problem's samples. They are read where VeRL has them,
in its V0 trainer's validation (`RayPPOTrainer._validate`, verl 0.9.1):

* `extract_reward` (as `ray_trainer` calls it) on a validation batch: each sample's prompt `uid` (one
  per problem and validation, shared by its n samples) and its problem, `extra_info.index` of the
  parquet (pdmctl's data and the tiny model's have it; else the problem's place in the validation);
* `_val_metrics_update(data_sources, sample_uids, reward_extra_infos_dict, ...)`: every sample's data
  source, uid and VeRL's own grades (`acc`, and the extracted answer `pred` of `math_dapo`), the same
  lists VeRL averages into mean@16.

The record per data source (`per_problem/<aime24>/step_<N>.json`, `ledger.load_samples` /
`load_per_problem`): `accuracies` (problem order: by index), `correct` (problems × n, VeRL's `acc`),
`answers` (an id per distinct (answer, grade) within the problem, -1 where nothing was extracted and the
sample is wrong) and `problems` (the indices). It waits here until the logging wrapper (`resume.py`)
logs that validation's `val-core/<source>/acc/mean@16`, and goes into the run's spool with it: the step
is the one the mean is logged at, and a validation repeated by a resumed attempt (whose mean is not
logged again) does not replace the first one's record.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

from pdmctl.backends.verl.metrics import VAL_DATA_SOURCES

_PENDING: dict[str, dict[str, Any]] = {}  # report name (aime24) -> the latest validation's record
_PROBLEMS: dict[str, int] = {}  # prompt uid -> its problem's index, from the validation batches
NO_ANSWERS = ("", "[INVALID]", "None")


def take(dataset: str) -> dict[str, Any] | None:
    """The latest validation's record for `dataset` (`aime24`), once."""
    return _PENDING.pop(dataset, None)


def install() -> None:
    """Patch VeRL's V0 trainer where it is imported (the TaskRunner, once `fit` starts its logger)."""
    trainer = sys.modules.get("verl.trainer.ppo.ray_trainer")
    if trainer is None or getattr(trainer, "_pdmctl_per_problem", False):
        return
    original_extract = trainer.extract_reward
    original_update = trainer.RayPPOTrainer._val_metrics_update

    def extract_reward(batch: Any) -> Any:
        result = original_extract(batch)
        if batch.meta_info.get("validate"):
            try:
                _note_problems(batch.non_tensor_batch)
            except Exception as exc:  # never the validation's failure
                print(f"pdmctl: the validation's problem indices not read ({type(exc).__name__}: {exc})", flush=True)
        return result

    def _val_metrics_update(self: Any, data_sources: Any, sample_uids: Any, reward_extra_infos_dict: Any,
                            *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        try:
            _PENDING.update(records(data_sources, sample_uids, reward_extra_infos_dict, _PROBLEMS))
        except Exception as exc:
            print(f"pdmctl: per-problem scores not kept ({type(exc).__name__}: {exc})", flush=True)
        _PROBLEMS.clear()
        return original_update(self, data_sources, sample_uids, reward_extra_infos_dict, *args, **kwargs)

    trainer.extract_reward = extract_reward
    trainer.RayPPOTrainer._val_metrics_update = _val_metrics_update
    trainer._pdmctl_per_problem = True


def _note_problems(non_tensor: Mapping[str, Any]) -> None:
    uids = non_tensor.get("uid")
    extra = non_tensor.get("extra_info")
    index = non_tensor.get("index")
    if uids is None:
        return
    for i, uid in enumerate(uids):
        found = None
        if extra is not None and isinstance(extra[i], Mapping):
            found = extra[i].get("index")
        if found is None and index is not None:
            found = index[i]
        if found is not None:
            _PROBLEMS[str(uid)] = int(found)


def records(data_sources: Sequence[Any], sample_uids: Sequence[Any], infos: Mapping[str, Sequence[Any]],
            problems: Mapping[str, int]) -> dict[str, dict[str, Any]]:  # fmt: skip
    """report name -> its record (module docstring), for the data sources the report reads."""
    if "acc" not in infos:
        return {}  # VeRL's mean@16 is then of `reward`, which no pdmctl metric reads
    acc, preds = list(infos["acc"]), list(infos.get("pred", [None] * len(sample_uids)))
    if not (len(acc) == len(sample_uids) == len(data_sources) == len(preds)):
        raise ValueError(f"{len(acc)} grades for {len(sample_uids)} samples")
    grouped: dict[str, dict[str, list[tuple[int, Any]]]] = {}
    for source, uid, correct, pred in zip(data_sources, sample_uids, acc, preds, strict=True):
        if str(source) in VAL_DATA_SOURCES:
            grouped.setdefault(str(source), {}).setdefault(str(uid), []).append((int(bool(correct)), pred))
    out = {}
    for source, by_uid in grouped.items():
        seen = {uid: i for i, uid in enumerate(by_uid)}  # the validation's order where no index is known
        order = sorted(by_uid, key=lambda uid: (problems.get(uid, 10**12), seen[uid]))
        correct_rows, answer_rows = [], []
        for uid in order:
            ids: dict[tuple[str, int], int] = {}
            answers = []
            for correct, pred in by_uid[uid]:
                text = "" if pred is None else str(pred).strip()
                if text in NO_ANSWERS and not correct:
                    answers.append(-1)
                else:  # an answer graded two ways (VeRL's verifiers differ) counts as two answers
                    answers.append(ids.setdefault((text, correct), len(ids)))
            correct_rows.append([c for c, _ in by_uid[uid]])
            answer_rows.append(answers)
        out[VAL_DATA_SOURCES[source]] = {
            "dataset": VAL_DATA_SOURCES[source],
            "accuracies": [sum(row) / len(row) for row in correct_rows],
            "correct": correct_rows,
            "answers": answer_rows,
            "problems": [problems.get(uid, -1) for uid in order],
        }
    return out


def artifact_path(dataset: str, step: int) -> str:
    return f"per_problem/{dataset}/step_{step:07d}.json"  # where ledger.load_samples reads it
