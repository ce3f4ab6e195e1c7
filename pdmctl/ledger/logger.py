"""What a job uses: log into its one run (metrics once per step across attempts, per-problem
scores, notices, the end)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from pdmctl.ledger.records import (
    _TAG_VALUE_MAX,
    RUNNING,
    TAG_ATTEMPT,
    TAG_EXECUTOR,
    TAG_JOB,
    TAG_NOTICE,
    TAG_REASON,
    TAG_SUBMITTED,
)
from pdmctl.ledger.store import _chunks, _mlflow_client, _now_ms, _retry


class RunLogger:
    """The Tracker a job hands its backend: MLflow metrics into the ledger's run.

    On a resumed attempt the backend replays the steps after its checkpoint;
    points already in the run (same metric, step <= the last logged step) are
    skipped, so every step appears once.
    """

    def __init__(self, uri: str, run_id: str) -> None:
        self.client = _mlflow_client(uri)
        self.uri = uri
        self.run_id = run_id
        self.last_logged: dict[str, int] = {}  # metric -> last step already in the run

    def start(self, attempt: int, job_id: str, executor: str, submission: str = "") -> None:
        from mlflow.entities import RunTag

        # the job confirms its own submission: the ledger knows its id even if the submitter was interrupted
        tags = [RunTag(TAG_ATTEMPT, str(attempt)), RunTag(TAG_JOB, job_id), RunTag(TAG_EXECUTOR, executor),
                RunTag(TAG_REASON, ""), RunTag(TAG_SUBMITTED, submission), RunTag(TAG_NOTICE, "")]  # fmt: skip
        _retry(lambda: self.client.log_batch(self.run_id, tags=tags))
        _retry(lambda: self.client.update_run(self.run_id, status=RUNNING))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        for name in metrics:
            if name not in self.last_logged:
                hist = _retry(lambda n=name: self.client.get_metric_history(self.run_id, n))
                self.last_logged[name] = max((m.step for m in hist), default=-1)
        now = _now_ms()
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items() if step > self.last_logged[k]]
        for chunk in _chunks(batch, 500):
            _retry(lambda c=chunk: self.client.log_batch(self.run_id, metrics=c))
        for m in batch:
            self.last_logged[m.key] = step

    def log_per_problem(self, dataset: str, step: int, accuracies: Sequence[float]) -> None:
        _retry(lambda: self.client.log_dict(self.run_id, {"step": step, "dataset": dataset,
                                                          "accuracies": [float(a) for a in accuracies]},
                                            f"per_problem/{dataset}/step_{step:07d}.json"))  # fmt: skip

    def copy_metrics(self, rename) -> dict[str, float]:
        """Log every metric another writer put into this run under `rename(name)` (skipping None).

        VeRL logs into the run with its own names; the report reads pdmctl's.
        Returns the last value of each renamed metric.
        """
        run = _retry(lambda: self.client.get_run(self.run_id))
        final: dict[str, float] = {}
        for name in run.data.metrics:
            new = rename(name)
            if new is None or new == name:
                continue
            for m in sorted(
                _retry(lambda n=name: self.client.get_metric_history(self.run_id, n)), key=lambda m: m.step
            ):
                self.log_metrics({new: m.value}, m.step)
                final[new] = m.value
        return final

    def notice(self, message: str) -> None:
        print(f"pdmctl job: {message}", flush=True)  # the job's stdout is the run's log
        _retry(lambda: self.client.set_tag(self.run_id, TAG_NOTICE, message[:_TAG_VALUE_MAX]))

    def finish(self, status: str, reason: str | None = None) -> None:
        if reason is not None:
            _retry(lambda: self.client.set_tag(self.run_id, TAG_REASON, reason[:_TAG_VALUE_MAX]))
        _retry(lambda: self.client.set_terminated(self.run_id, status=status))


def load_per_problem(uri: str, run_id: str, dataset: str) -> dict[int, list[float]]:
    """step -> per-problem accuracies of one run's evaluations (for the two-level bootstrap)."""
    client = _mlflow_client(uri)
    out: dict[int, list[float]] = {}
    try:
        files = client.list_artifacts(run_id, f"per_problem/{dataset}")
    except Exception:
        return out
    for f in files:
        data = client.load_dict(run_id, f.path) if hasattr(client, "load_dict") else None
        if data is None:
            import mlflow.artifacts

            data = json.loads(Path(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=f.path,
                                                                      tracking_uri=uri)).read_text())  # fmt: skip
        out[int(data["step"])] = [float(a) for a in data["accuracies"]]
    return out

