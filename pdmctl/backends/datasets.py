"""The data sets a run reads, described for MLflow's inputs (`RunLogger.log_datasets` logs them as
`mlflow.log_input` does): the testbed's task set (its training problems, drawn in code, and each fixed
held-out set), VeRL's parquet files with the digest its run config states.

Each description: `name`, `digest`, `context` (training, evaluation), and either `uri` (a file the run reads)
or `tags` (data made in code); `rows` where known.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pdmctl.backends.base import Tracker


def log_datasets(tracker: Tracker, describe: Callable[[], list[dict[str, Any]]]) -> None:
    """The run's data sets as MLflow inputs, where its tracker logs into the ledger (the job's `RunLogger`,
    reached through the wrappers around it); a test's tracker has none. A set that cannot be described or
    logged is a line in the job's log, never the run's end."""
    log = getattr(tracker, "log_datasets", None)
    if log is None:
        return
    try:
        log(describe())
    except Exception as exc:
        print(f"pdmctl job: data sets not logged as MLflow inputs ({type(exc).__name__}: {exc})".splitlines()[0],
              flush=True)  # fmt: skip


def toy_datasets(flat: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The testbed's task set: its training problems (drawn afresh each step from the run's seed: data made in
    code, named by its task and seed) and each held-out set (fixed problems: sha256 over their prompts and
    answers, 16 hex digits, and their number)."""
    from pdmctl.backends.toy import ToyConfig
    from pdmctl.backends.toy.trainer import task_for

    cfg = ToyConfig.from_mapping(flat)
    task = task_for(cfg)
    drawn = hashlib.sha256(f"{task.name}:train:seed={cfg.seed}".encode()).hexdigest()[:16]
    out: list[dict[str, Any]] = [{"name": f"{task.name}-train", "digest": drawn, "context": "training",
                                  "tags": {"task": task.name, "model": cfg.model, "seed": cfg.seed,
                                           "problems": f"{cfg.prompts_per_step} a step, drawn from the seed"}}]  # fmt: skip
    for name in task.eval_sets:
        problems = task.heldout(name)
        digest = hashlib.sha256(name.encode() + problems.prompts.numpy().tobytes()
                                + problems.answers.numpy().tobytes()).hexdigest()[:16]  # fmt: skip
        out.append({"name": name, "digest": digest, "context": "evaluation", "rows": int(problems.answers.shape[0]),
                    "tags": {"task": task.name, "set": name}})  # fmt: skip
    return out


def verl_datasets(files: Sequence[Path], digest: str) -> list[dict[str, Any]]:
    """VeRL's parquet files (the training file first, then the held-out ones), each with `digest`: the one
    its run config states (`backend.data_manifest`, pinned at submit), else the one the job found."""
    return [{"name": Path(path).stem, "uri": str(path), "digest": digest,
             "context": "training" if i == 0 else "evaluation"} for i, path in enumerate(files)]  # fmt: skip
