"""What a job uses: log into its one run (metrics once per step across attempts, per-problem
scores, the data sets it reads, notices, the end).

One unit for every evaluation metric: the held-out sets (`eval/NAME`) and their mean (`heldout/avg16`,
`AVG16_METRIC`) are fractions in [0, 1]; the report, `status`, `tune` and `seeds` show avg@16 in % and
compute it from the `eval/NAME` series themselves, never from the logged mean. Runs of an older pdmctl
logged the mean in % as `avg16`: no reader reads it (nor `heldout/avg16`), so those runs read as before, and
a run resumed under this version goes on with `heldout/avg16` (its `avg16` keeps the older steps, in %).
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from pdmctl.ledger.records import (
    _TAG_VALUE_MAX,
    AVG16_METRIC,
    COMMIT_TAG,
    RUNNING,
    TAG_ATTEMPT,
    TAG_JOB,
    TAG_NOTICE,
    TAG_REASON,
    ledger_state,
    ledger_tags,
    stale_ledger_parts,
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

    def start(self, attempt: int, job_id: str, executor: str = "", submission: str = "") -> None:
        """The attempt begins: its number and job id (which confirm its submission: the ledger knows its job id
        even if the submitter was interrupted), the previous attempt's reason and notice removed. `executor` and
        `submission` are the submitter's, already in the ledger's record."""
        from mlflow.entities import RunTag

        tags = [RunTag(TAG_ATTEMPT, str(attempt)), RunTag(TAG_JOB, job_id)]
        _retry(lambda: self.client.log_batch(self.run_id, tags=tags))
        # the previous attempt's reason and notice no longer hold: removed, never left as empty tags
        present = _retry(lambda: self.client.get_run(self.run_id)).data.tags
        for key in (TAG_REASON, TAG_NOTICE):
            if key in present:
                _retry(lambda k=key: self.client.delete_tag(self.run_id, k))
        _retry(lambda: self.client.update_run(self.run_id, status=RUNNING))

    def record_provenance(self, attempt: int, job_id: str, fields: Mapping[str, str], **about: Any) -> None:
        """The attempt's provenance (pdmctl.provenance.collect) into the ledger's record (`pdmctl.ledger`): the
        fields (the latest attempt's win) and a record of this attempt (job id, start, commit, `about`); the
        commit also as MLflow's Source commit. The job is the record's only writer while it runs."""
        from mlflow.entities import RunTag

        record = {"job_id": job_id, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  **{k: fields[k] for k in ("commit", "dirty") if k in fields}, **about}  # fmt: skip
        present = _retry(lambda: self.client.get_run(self.run_id)).data.tags
        state = ledger_state(present)
        state["provenance"] = {**(state.get("provenance") or {}),
                               **{k: str(v)[:_TAG_VALUE_MAX] for k, v in fields.items() if str(v)}}  # fmt: skip
        state["attempts"] = {**(state.get("attempts") or {}), str(attempt): record}
        tags = [RunTag(k, v) for k, v in ledger_tags(state).items()]
        if fields.get("commit") and fields["commit"] != "unknown":  # MLflow's Source: the commit the job ran
            tags.append(RunTag(COMMIT_TAG, str(fields["commit"])))
        _retry(lambda: self.client.log_batch(self.run_id, tags=tags))
        for key in stale_ledger_parts(present, state):
            _retry(lambda k=key: self.client.delete_tag(self.run_id, k))

    def log_datasets(self, datasets: Sequence[Mapping[str, Any]]) -> None:
        """The data sets the run reads, as MLflow inputs (`DatasetInput`, as `mlflow.log_input` logs them; MLflow
        keeps one of each name and digest per run, so every attempt may log them again). Each: `name`,
        `digest`, `context` (training, evaluation), and `uri` (a file it reads: a `local` source) or `tags`
        (data made in code: a `code` source); `rows` where known."""
        from mlflow.entities import Dataset, DatasetInput, InputTag

        inputs = []
        for d in datasets:
            if d.get("uri"):
                source_type, source = "local", {"uri": str(d["uri"])}
            else:
                source_type, source = "code", {"tags": {str(k): str(v) for k, v in (d.get("tags") or {}).items()}}
            profile = json.dumps({"num_rows": int(d["rows"])}) if d.get("rows") is not None else None
            digest = str(d["digest"])
            dataset = Dataset(name=str(d["name"]), digest=digest[:36], source_type=source_type,  # MLflow keeps 36
                              source=json.dumps(source), profile=profile)  # fmt: skip
            tags = [InputTag("mlflow.data.context", str(d.get("context") or "training"))]
            if len(digest) > 36:  # the whole digest, as the run config states it
                tags.append(InputTag("pdmctl.digest", digest))
            inputs.append(DatasetInput(dataset, tags=tags))
        if inputs:
            _retry(lambda: self.client.log_inputs(self.run_id, datasets=inputs))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """The metrics at `step`; where they hold held-out sets (`eval/NAME`, a backend logs an evaluation's
        sets together), also `heldout/avg16`: their mean, a fraction as they are, the column to sort by in MLflow."""
        held_out = [float(v) for k, v in metrics.items() if k.startswith("eval/")]
        if held_out and AVG16_METRIC not in metrics:
            metrics = {**metrics, AVG16_METRIC: sum(held_out) / len(held_out)}
        self._log(metrics, step)

    def _log(self, metrics: Mapping[str, float], step: int) -> None:
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

    def log_per_problem(self, dataset: str, step: int, accuracies: Sequence[float], *,
                        correct: Sequence[Sequence[int]] | None = None,
                        answers: Sequence[Sequence[int]] | None = None) -> None:  # fmt: skip
        data: dict[str, Any] = {"step": step, "dataset": dataset, "accuracies": [float(a) for a in accuracies]}
        if correct is not None:  # per problem, per sample: 1 if graded correct; the answer's id (-1: none)
            data["correct"] = [[int(c) for c in row] for row in correct]
        if answers is not None:
            data["answers"] = [[int(a) for a in row] for row in answers]
        _retry(lambda: self.client.log_dict(self.run_id, data, f"per_problem/{dataset}/step_{step:07d}.json"))

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
                self._log({new: m.value}, m.step)
                final[new] = m.value
        self._log_averages()
        return final

    def _log_averages(self) -> None:
        """`heldout/avg16` at each step where the run holds every one of its held-out sets (copied one by one)."""
        names = [n for n in _retry(lambda: self.client.get_run(self.run_id)).data.metrics if n.startswith("eval/")]
        by_step: dict[int, list[float]] = defaultdict(list)
        for name in names:
            for m in _retry(lambda n=name: self.client.get_metric_history(self.run_id, n)):
                by_step[m.step].append(m.value)
        for step in sorted(by_step):
            if len(by_step[step]) == len(names):
                self._log({AVG16_METRIC: sum(by_step[step]) / len(names)}, step)

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



def load_samples(uri: str, run_id: str, dataset: str, step: int, location: str | None = None
                 ) -> tuple[list[list[int]], list[list[int]]] | None:  # fmt: skip
    """One evaluation's per-sample correctness and answer ids (problems × samples), or None where the run
    logged none at that step (runs of older pdmctl, or VeRL runs until they store them). `location`: the
    run's artifact root (`Ledger.artifact_locations`); a local one is read directly (MLflow's download
    takes half a second a file)."""
    path = f"per_problem/{dataset}/step_{step:07d}.json"
    try:
        if location and urlparse(location).scheme in ("", "file"):
            local = Path(urlparse(location).path if location.startswith("file:") else location) / path
            if not local.is_file():
                return None
            data = json.loads(local.read_text())
        else:
            _mlflow_client(uri)  # quiets MLflow's logging
            import mlflow.artifacts

            data = json.loads(Path(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=path,
                                                                       tracking_uri=uri)).read_text())  # fmt: skip
    except Exception:
        return None
    if "correct" not in data or "answers" not in data:
        return None
    return data["correct"], data["answers"]
