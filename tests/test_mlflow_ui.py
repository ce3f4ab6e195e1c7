"""What MLflow's own UI shows of a pdmctl sweep, read back through MLflow's client from a real store
(embedded SQLite): the experiment's kind, each run's Source, commit and Description, its name, its
tags (none empty, none repeated by another), and avg@16 as a metric (heldout/avg16) in the unit of the
held-out sets beside it (fractions)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pdmctl.ledger import RunLogger, SqlLedger, Submission
from pdmctl.ledger.records import AVG16_METRIC, EXPERIMENT_KIND_TAG, TAG_REASON, TRAINING_KIND, run_name
from pdmctl.provenance import SOURCE_DIR

sys.path.insert(0, str(Path(__file__).parent))  # the synthetic-sweep helpers beside this file
from test_report_synthetic import finish, make_sweep


def head_commit() -> str | None:
    done = subprocess.run(["git", "-C", str(SOURCE_DIR), "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def test_a_sweep_opens_in_the_training_view_with_source_commit_and_description(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    sweep = make_sweep(uri, "ui", ["mask=pdm_agg,grpo_clip_higher", "seed=0,1,2"])
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("ui")
    assert experiment is not None and experiment.tags[EXPERIMENT_KIND_TAG] == TRAINING_KIND
    runs = {r.info.run_id: r for r in client.search_runs([experiment.experiment_id], "tags.`pdmctl.sweep` = 'ui'")}
    assert set(runs) == set(sweep.specs)
    for run_id, spec in sweep.specs.items():
        tags = runs[run_id].data.tags
        assert tags["mlflow.source.name"] == "pdmctl sweep ui" and tags["mlflow.source.type"] == "JOB"
        assert tags["mlflow.note.content"] == spec.summary  # the Description: mask, δ, K, setting, seed
        if head_commit() is not None:
            assert tags["mlflow.source.git.commit"] == head_commit()
        assert all(value.strip() for value in tags.values()), {k: v for k, v in tags.items() if not v.strip()}
        assert "pdmctl.summary" not in tags  # the Description holds it
        # the name leads with what varies: seed, mask, δ, K, before the setting every run shares
        name = runs[run_id].info.run_name
        assert name == run_name(spec) and name.startswith(f"s{spec.seed} {spec.config['mask']['name']} ")
        assert name.index(f"K{spec.config['k']}") < name.index(spec.config["model"]["name"])
    assert "δ" not in runs[sweep.run_id("grpo_clip_higher", 0)].info.run_name  # GRPO's clip has no δ
    # every run differs within the first 19 characters MLflow's run table shows (seed and mask)
    shown = {r.info.run_name[:19] for r in runs.values()}
    assert len(shown) == len(runs), shown
    # the ledger reads its records back as before: the summary from the Description
    assert {r.summary for r in sweep.ledger.runs("ui")} == {s.summary for s in sweep.specs.values()}


def test_a_new_attempt_leaves_no_empty_tag_and_logs_avg16_as_a_fraction(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    sweep = make_sweep(uri, "attempts", ["mask=pdm_agg", "seed=0"])
    (run_id,) = sweep.specs
    client = MlflowClient(uri)
    finish(sweep.ledger, [run_id], "FAILED", "node lost")
    assert client.get_run(run_id).data.tags[TAG_REASON] == "node lost"
    sweep.ledger.mark_submitted([Submission(run_id, "job-2", "local", 1)])  # the resubmission: no reason yet
    assert TAG_REASON not in client.get_run(run_id).data.tags
    assert SqlLedger(uri).runs("attempts")[0].reason is None

    logger = RunLogger(uri, run_id)
    logger.start(1, "job-2", "local")
    logger.notice("resumed from step 4")
    logger.finish("FAILED", "out of memory")
    logger.start(2, "job-3", "local", "tok:0:2")
    tags = client.get_run(run_id).data.tags
    assert TAG_REASON not in tags and "pdmctl.notice" not in tags  # the last attempt's, not this one's
    assert all(value.strip() for value in tags.values()), {k: v for k, v in tags.items() if not v.strip()}
    logger.record_provenance(2, "job-3", {"commit": "c" * 40, "dirty": "no", "data": ""})
    tags = client.get_run(run_id).data.tags
    assert tags["mlflow.source.git.commit"] == "c" * 40 and not any(k.startswith("pdmctl.prov") for k in tags)
    assert SqlLedger(uri).runs("attempts")[0].provenance["commit"] == "c" * 40
    assert "data" not in SqlLedger(uri).runs("attempts")[0].provenance  # an empty field is not recorded

    logger.log_metrics({"eval/toy24": 0.5, "eval/toy25": 0.25, "train/reward": 0.1}, 4)
    logger.log_metrics({"train/reward": 0.2}, 5)  # no evaluation at this step: no avg16 either
    history = client.get_metric_history(run_id, AVG16_METRIC)
    assert AVG16_METRIC == "heldout/avg16" and [(m.step, m.value) for m in history] == [(4, pytest.approx(0.375))]
    assert client.get_metric_history(run_id, "avg16") == []  # the older name, in %, is not logged any more
    record = SqlLedger(uri).runs("attempts")[0]
    assert record.avg16 == pytest.approx(0.375)  # status reads the held-out sets, not avg16 twice


def test_copied_evaluations_get_avg16_once_per_step_where_every_set_is_there(tmp_path: Path) -> None:
    """An engine's own metrics are copied one by one at a job's end: avg16 follows from the copies, at the
    steps that hold every held-out set, once each even when copied again by a later attempt."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    sweep = make_sweep(uri, "copy", ["mask=pdm_agg", "seed=0"])
    (run_id,) = sweep.specs
    client = MlflowClient(uri)
    from mlflow.entities import Metric

    client.log_batch(run_id, metrics=[Metric("val/a", 0.5, 0, 0), Metric("val/b", 0.3, 0, 0),
                                      Metric("val/a", 0.7, 0, 3), Metric("val/b", 0.5, 0, 3),
                                      Metric("val/a", 0.9, 0, 5)])  # fmt: skip
    rename = {"val/a": "eval/aime24", "val/b": "eval/aime25"}.get
    for _ in range(2):
        RunLogger(uri, run_id).copy_metrics(rename)
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, AVG16_METRIC))
    assert history == [(0, pytest.approx(0.4)), (3, pytest.approx(0.6))]


def test_the_client_ledger_writes_the_same_tags_as_the_sql_one(tmp_path: Path) -> None:
    """A tracking server's ledger goes through MLflow's client (here on the same SQLite store): the
    experiment's kind, the run's Source and Description, and a cleared reason removed, not emptied."""
    from pdmctl import grid
    from pdmctl.ledger.client import ClientLedger

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    ledger = ClientLedger(uri)
    specs = grid.expand(["mask=pdm_agg", "seed=0"], sweep="served")
    (run_id,) = ledger.register(specs, {s.key: str(tmp_path / "runs") for s in specs}).values()
    client = MlflowClient(uri)
    assert client.get_experiment_by_name("served").tags[EXPERIMENT_KIND_TAG] == TRAINING_KIND
    ledger.set_status([run_id], "FAILED", "boom")
    ledger.mark_submitted([Submission(run_id, "job-1", "local", 1)])
    run = client.get_run(run_id)
    assert run.info.run_name == run_name(specs[0]) and run.data.tags["mlflow.note.content"] == specs[0].summary
    assert run.data.tags["mlflow.source.name"] == "pdmctl sweep served" and TAG_REASON not in run.data.tags
    assert all(value.strip() for value in run.data.tags.values())
    assert [r.summary for r in ledger.runs("served")] == [specs[0].summary]
