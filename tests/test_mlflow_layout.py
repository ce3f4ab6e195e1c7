"""A run as MLflow users find it, against a real MLflow store (embedded SQLite, through pdmctl's SQL ledger
and through MLflow's client): a handful of readable tags, the spec as `spec.json`, the config as params, the
data sets as MLflow inputs, every run a child of its sweep's parent run, which no reader counts as a run and
which holds the sweep's report; and a ledger recorded in the older tag-by-tag layout, read and carried on."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from pdmctl import grid, orchestrate
from pdmctl.ledger import RunLogger, SqlLedger, Submission, open_ledger
from pdmctl.ledger.client import ClientLedger
from pdmctl.ledger.records import PARENT_TAG, TAG_LEDGER, TAG_SWEEP_RUN, flatten
from pdmctl.report.collect import collect
from pdmctl.report.definition import load_definition
from tests.conftest import pdmctl, sqlite_uri

sys.path.insert(0, str(Path(__file__).parent))
from test_report_synthetic import finish, write_points

SYN = ["backend=synthetic", "model=synthetic"]
READABLE = {"pdmctl.sweep", "pdmctl.key", "pdmctl.mask", "pdmctl.model", "pdmctl.precision", "pdmctl.seed",
            "pdmctl.attempt"}  # fmt: skip
MLFLOW_TAGS = {"mlflow.runName", "mlflow.user", "mlflow.source.name", "mlflow.source.type", "mlflow.note.content",
               "mlflow.parentRunId"}  # fmt: skip


def _ledger(kind: str, uri: str):
    return SqlLedger(uri) if kind == "sql" else ClientLedger(uri)


def _sweep_runs(client: MlflowClient, sweep: str) -> list:
    exp = client.get_experiment_by_name(sweep)
    return client.search_runs([exp.experiment_id], f"tags.`pdmctl.sweep` = '{sweep}'")


@pytest.mark.parametrize("kind", ["sql", "client"])
def test_a_run_has_a_handful_of_readable_tags_its_spec_as_an_artifact_and_its_config_as_params(
    tmp_path: Path, kind: str
) -> None:
    uri = sqlite_uri(tmp_path)
    ledger = _ledger(kind, uri)
    specs = grid.expand(["mask=pdm_agg,grpo_clip_higher", "seed=3", *SYN], sweep="tags")
    ids = ledger.register(specs, {s.key: str(tmp_path / "runs" / s.key) for s in specs})
    client = MlflowClient(uri)
    parent = ledger.sweep_run("tags")
    for spec in specs:
        run = client.get_run(ids[spec.key])
        tags = run.data.tags
        ours = {k for k in tags if k.startswith("pdmctl.")}
        assert ours == READABLE | {TAG_LEDGER}, ours  # one internal tag beside the readable ones
        assert set(tags) >= MLFLOW_TAGS and tags[PARENT_TAG] == parent
        assert (tags["pdmctl.mask"], tags["pdmctl.model"], tags["pdmctl.precision"], tags["pdmctl.seed"]) == (
            spec.config["mask"]["name"], "synthetic", spec.config["precision"]["name"], "3")
        for name, value in tags.items():  # readable: no JSON, no path, nothing empty (the ledger's own aside)
            if name != TAG_LEDGER:
                assert value.strip() and not value.startswith(("{", "[", "/")), (name, value)
        assert str(tmp_path) not in json.dumps({k: v for k, v in tags.items() if k != TAG_LEDGER})
        # the spec for people, the config as params
        spec_json = Path(client.download_artifacts(run.info.run_id, "spec.json", str(tmp_path / run.info.run_id)))
        assert json.loads(spec_json.read_text()) == json.loads(spec.to_json())
        assert run.data.params == flatten(spec.config)
        # the ledger reads its record back whole
        (record,) = [r for r in ledger.runs("tags") if r.key == spec.key]
        assert record.spec == spec and record.run_dir == str(tmp_path / "runs" / spec.key / run.info.run_id)
    # filtering on a readable tag, as in MLflow's UI
    exp = client.get_experiment_by_name("tags")
    found = client.search_runs([exp.experiment_id], "tags.`pdmctl.mask` = 'pdm_agg' and tags.`pdmctl.seed` = '3'")
    assert [r.info.run_id for r in found] == [ids[specs[0].key]]


def test_the_sql_ledger_writes_what_mlflows_own_client_writes(tmp_path: Path) -> None:
    """The SQL ledger writes rows into MLflow's tables itself: MLflow's client reads such a run exactly as it
    reads one made through its own API (the client ledger's), tag for tag, param for param, artifact for
    artifact, status for status."""
    uri = sqlite_uri(tmp_path)
    client = MlflowClient(uri)
    seen = {}
    for kind in ("sql", "client"):
        ledger = _ledger(kind, uri)
        specs = grid.expand(["mask=pdm_agg", "seed=0", *SYN], sweep=f"same-{kind}")
        (run_id,) = ledger.register(specs, {s.key: str(tmp_path / kind) for s in specs}).values()
        ledger.mark_intent({run_id: "tok:0:1"}, "local")
        ledger.mark_submitted([Submission(run_id, "job-1", "local", 1, "tok:0:1")])
        run = client.get_run(run_id)
        tags = {k: v.replace(f"same-{kind}", "same") for k, v in run.data.tags.items() if k not in (TAG_LEDGER, PARENT_TAG)}
        seen[kind] = (run.info.status, tags, run.data.params, [a.path for a in client.list_artifacts(run_id)],
                      run.info.run_name, json.loads(run.data.tags[TAG_LEDGER]).keys())  # fmt: skip
        (record,) = ledger.runs(f"same-{kind}")
        assert record.job_id == "job-1" and record.attempt == 1 and record.pending_submission is None
        assert record.executor == "local" and record.submission == "tok:0:1"
    assert seen["sql"] == seen["client"]
    assert seen["sql"][0] == "SCHEDULED"


def _old_layout_run(client: MlflowClient, exp_id: str, spec, run_dir: Path, *, attempt: int, submission: str,
                    submitted: str, status: str, look: str | None = None) -> str:  # fmt: skip
    """A run as pdmctl recorded it before `pdmctl.ledger`: every field its own tag, the spec cut into parts,
    provenance as `pdmctl.prov.*`, its description once in `pdmctl.summary`."""
    spec_json = spec.to_json()
    parts = [spec_json[i : i + 300] for i in range(0, len(spec_json), 300)]  # an older pdmctl's parts
    tags = {
        "mlflow.runName": "old", "mlflow.user": "someone", "pdmctl.summary": spec.summary,
        "pdmctl.sweep": spec.sweep, "pdmctl.key": spec.key, "pdmctl.backend": spec.backend,
        "pdmctl.attempt": str(attempt), "pdmctl.job_id": f"local-{attempt}",
        "pdmctl.executor": json.dumps({"executor": "local", "profile": "local", "run_root": str(run_dir.parent)}),
        "pdmctl.submission": submission, "pdmctl.submitted": submitted,
        **{"pdmctl.spec" if i == 0 else f"pdmctl.spec.{i}": part for i, part in enumerate(parts)},
        "pdmctl.prov.commit": "a" * 40, "pdmctl.prov.dirty": "no", "pdmctl.prov.version.torch": "2.0",
        "pdmctl.prov.attempt.1": json.dumps({"job_id": "local-1", "started": "2026-01-01T00:00:00+0000",
                                             "commit": "a" * 40}),
    }  # fmt: skip
    if look:
        tags["pdmctl.prov.look"] = look
    run = client.create_run(exp_id, tags={"mlflow.runName": "old"})
    run_id = run.info.run_id
    tags["pdmctl.run_dir"] = str(run_dir / run_id)
    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()],
                     params=[Param(k, v) for k, v in flatten(spec.config).items()])  # fmt: skip
    client.log_batch(run_id, metrics=[Metric(name, 0.5, 0, 4) for name in ("eval/toy24", "eval/toy25")]
                     + [Metric("avg16", 50.0, 0, 4)])  # the older mean, in %
    client.set_terminated(run_id, status)
    return run_id


@pytest.mark.parametrize("kind", ["sql", "client"])
def test_a_ledger_recorded_in_the_older_layout_is_read_and_carried_on(tmp_path: Path, kind: str) -> None:
    uri = sqlite_uri(tmp_path)
    SqlLedger(uri)  # the store, as an older pdmctl made it
    client = MlflowClient(uri)
    exp_id = client.create_experiment("old", tags={"pdmctl": "sweep"})
    specs = grid.expand(["mask=pdm_agg", "seed=0,1", *SYN], sweep="old")
    runs = tmp_path / "runs"
    done = _old_layout_run(client, exp_id, specs[0], runs, attempt=1, submission="t0:0:1", submitted="t0:0:1",
                           status="FINISHED", look="1")  # fmt: skip
    # an interrupted resubmission: the intent for attempt 2 recorded, its job id never
    pending = _old_layout_run(client, exp_id, specs[1], runs, attempt=1, submission="t1:0:2", submitted="t0:1:1",
                              status="FAILED")  # fmt: skip
    ledger = _ledger(kind, uri)
    records = {r.run_id: r for r in ledger.runs("old")}
    assert set(records) == {done, pending}
    old = records[done]
    assert old.spec == specs[0] and old.run_dir == str(runs / done) and old.summary == specs[0].summary
    assert json.loads(old.executor or "")["executor"] == "local" and old.job_id == "local-1"
    assert old.provenance["commit"] == "a" * 40 and old.provenance["version.torch"] == "2.0"
    assert old.provenance["look"] == "1" and [a["job_id"] for a in old.attempts] == ["local-1"]
    assert old.pending_submission is None and records[pending].pending_submission == "t1:0:2"
    # the report reads them as it did
    data = collect(ledger, ["old"], load_definition("default"))
    assert _counted(data) == {done} and [e.run_id for e in data.excluded] == [pending]

    # carried on by this pdmctl: registering the same specs adds no run, makes the sweep's parent and adopts them
    again = ledger.register(specs, {s.key: str(runs) for s in specs})
    assert again == {specs[0].key: done, specs[1].key: pending}
    parent = ledger.sweep_run("old")
    assert parent is not None and {client.get_run(r).data.tags[PARENT_TAG] for r in again.values()} == {parent}
    # the interrupted submission is confirmed by its job id, a new one recorded in the ledger's record
    ledger.mark_submitted([Submission(pending, "local-2", "local", 2, "t1:0:2")])
    assert next(r for r in ledger.runs("old") if r.run_id == pending).pending_submission is None
    ledger.mark_intent({done: "t2:0:2"}, "new-executor")
    carried = next(r for r in ledger.runs("old") if r.run_id == done)
    assert carried.pending_submission == "t2:0:2" and carried.executor == "new-executor"
    assert carried.spec == specs[0] and carried.run_dir == str(runs / done)  # still the older tags'
    ledger.mark_submitted([Submission(done, "local-3", "new-executor", 2, "t2:0:2")])
    logger = RunLogger(uri, done)
    logger.start(2, "local-3")
    logger.record_provenance(2, "local-3", {"commit": "b" * 40, "dirty": "no"})
    carried = next(r for r in ledger.runs("old") if r.run_id == done)
    assert carried.pending_submission is None and carried.job_id == "local-3" and carried.attempt == 2
    assert carried.provenance["commit"] == "b" * 40 and carried.provenance["version.torch"] == "2.0"
    assert [(a["attempt"], a["job_id"]) for a in carried.attempts] == [(1, "local-1"), (2, "local-3")]
    assert carried.provenance["look"] == "1"


def _finished_sweep(uri: str, tmp_path: Path, kind: str, name: str) -> tuple[object, dict]:
    """A synthetic sweep of four runs: three finished with both held-out sets at step 4, one failed."""
    ledger = _ledger(kind, uri)
    specs = grid.expand(["mask=pdm_agg,dppo_topk_kl", "seed=0,1", *SYN], sweep=name)
    ids = ledger.register(specs, {s.key: str(tmp_path / "pdmctl-runs" / name / s.key) for s in specs})
    by_id = {ids[s.key]: s for s in specs}
    sql = SqlLedger(uri)
    points = [(rid, m, 4, 0.3 + 0.1 * spec.seed) for rid, spec in by_id.items() for m in ("eval/toy24", "eval/toy25")]
    write_points(sql, points)
    failed = ids[specs[-1].key]
    finish(sql, [rid for rid in by_id if rid != failed])
    finish(sql, [failed], "FAILED", "boom")
    return ledger, by_id


@pytest.mark.parametrize("kind", ["sql", "client"])
def test_a_sweeps_parent_run_is_never_counted_as_one_of_its_runs(tmp_path: Path, monkeypatch, kind: str) -> None:
    """Status counts, the report's tables, seeds and resume see the sweep's four runs, never its parent."""
    from pdmctl.budget.seeds import propose

    monkeypatch.chdir(tmp_path)
    uri = sqlite_uri(tmp_path)
    ledger, by_id = _finished_sweep(uri, tmp_path, kind, "kids")
    client = MlflowClient(uri)
    parent = ledger.sweep_run("kids")
    assert parent is not None and parent not in by_id
    parent_tags = client.get_run(parent).data.tags
    assert parent_tags[TAG_SWEEP_RUN] == "kids" and "pdmctl.sweep" not in parent_tags
    assert {client.get_run(rid).data.tags[PARENT_TAG] for rid in by_id} == {parent}
    assert {r.run_id for r in ledger.runs("kids")} == set(by_id) and ledger.sweeps() == ["kids"]
    assert {r.run_id for r in ledger.runs()} == set(by_id)

    ctx = orchestrate.make_context("local", uri)
    views = orchestrate.status(ctx, "kids")
    assert len(views) == 4 and sorted(v.state.value for v in views).count("finished") == 3
    chosen, _ = orchestrate.resume(ctx, "kids", dry_run=True)
    assert [v.record.run_id for v in chosen] == [next(r for r in by_id if r not in _finished(ledger, "kids"))]
    definition = load_definition("default")
    data = collect(ledger, ["kids"], definition)
    assert _counted(data) == _finished(ledger, "kids") and set(data.records) == set(by_id)
    assert [e.run_id for e in data.excluded] == [v.record.run_id for v in chosen]
    look = propose(data, definition, max_seeds=4)
    assert look.unfinished == 0
    # a second registration (a resume, seeds --submit) keeps the one parent
    ledger.register(list(by_id.values()), {s.key: str(tmp_path) for s in by_id.values()})
    assert ledger.sweep_run("kids") == parent
    exp = client.get_experiment_by_name("kids")
    assert len(client.search_runs([exp.experiment_id])) == 5  # four runs and their parent


def _counted(data) -> set[str]:
    """The runs the report's tables average."""
    return {p.run_id for points in data.by_row.values() for p in points}


def _finished(ledger, sweep: str) -> set[str]:
    return {r.run_id for r in ledger.runs(sweep) if r.status == "FINISHED"}


def _report_files(client: MlflowClient, run_id: str) -> set[str]:
    return {a.path for a in client.list_artifacts(run_id, "report")}


def test_a_report_of_one_sweep_is_logged_to_its_parent_run_and_of_several_to_none(tmp_path: Path, monkeypatch
                                                                                   ) -> None:  # fmt: skip
    """One sweep: the report's files go to its parent run, under report/. Several: there is no one parent and
    nothing is logged, which the report says. A parent deleted by hand: the next report makes a new one, makes
    the sweep's runs its children and logs there; the deleted one gets nothing."""
    from pdmctl.cli import app

    monkeypatch.chdir(tmp_path)
    uri = sqlite_uri(tmp_path)
    first, _ = _finished_sweep(uri, tmp_path, "sql", "one")
    _finished_sweep(uri, tmp_path, "sql", "two")
    client = MlflowClient(uri)
    parents = {name: first.sweep_run(name) for name in ("one", "two")}

    done = CliRunner().invoke(app, ["report", "one", "--panels", "none", "--tracking-uri", uri])
    assert done.exit_code == 0, done.output
    assert f"logged to run {parents['one']}, the parent run of sweep one" in " ".join(done.output.split())
    written = {p.relative_to(tmp_path / "reports" / "one").as_posix() for p in (tmp_path / "reports" / "one").rglob("*")
               if p.is_file()}  # fmt: skip
    assert {"report/index.html", "report/results.csv"} <= _report_files(client, parents["one"])
    assert {f"report/{name}" for name in written if "/" not in name} == _report_files(client, parents["one"])

    both = CliRunner().invoke(app, ["report", "one", "two", "--panels", "none", "--tracking-uri", uri,
                                    "--out", str(tmp_path / "both")])  # fmt: skip
    assert both.exit_code == 0, both.output
    assert "not logged: the report spans 2 sweeps" in " ".join(both.output.split())
    assert _report_files(client, parents["two"]) == set()
    assert not any("both" in p for p in _report_files(client, parents["one"]))

    client.delete_run(parents["two"])  # by hand, in MLflow's UI
    assert first.sweep_run("two") is None
    assert len(orchestrate.status(orchestrate.make_context("local", uri), "two")) == 4
    again = CliRunner().invoke(app, ["report", "two", "--panels", "none", "--tracking-uri", uri])
    assert again.exit_code == 0, again.output
    new = first.sweep_run("two")
    assert new is not None and new != parents["two"] and f"logged to run {new}" in " ".join(again.output.split())
    assert "report/index.html" in _report_files(client, new) and _report_files(client, parents["two"]) == set()
    assert {client.get_run(r.run_id).data.tags[PARENT_TAG] for r in first.runs("two")} == {new}
    assert len(first.runs("two")) == 4


def test_the_data_sets_are_logged_as_mlflow_inputs_once_each(tmp_path: Path) -> None:
    """The testbed's task set (its training problems, drawn in code, and its held-out sets) and VeRL's parquet
    files with the digest its run config pins, as MLflow's inputs, through the wrappers a job puts around the
    ledger's tracker; a second attempt logs none twice."""
    from pdmctl.backends.datasets import log_datasets, toy_datasets
    from pdmctl.backends.registry import _verl_datasets, flat_config
    from pdmctl.steplines import StepLines

    uri = sqlite_uri(tmp_path)
    ledger = SqlLedger(uri)
    toy = grid.expand(["mask=pdm_agg", "seed=0"], sweep="data")[0]
    verl = grid.expand(["backend=verl", "model=qwen3-8b-base", f"backend.data_dir={tmp_path / 'verl'}",
                        f"backend.data_manifest={'ab' * 32}"], sweep="data")[0]  # fmt: skip
    ids = ledger.register([toy, verl], {s.key: str(tmp_path / s.key) for s in (toy, verl)})
    client = MlflowClient(uri)
    for _ in range(2):
        with StepLines(RunLogger(uri, ids[toy.key])) as tracker:
            log_datasets(tracker, lambda: toy_datasets(flat_config(toy.config)))
        log_datasets(RunLogger(uri, ids[verl.key]), lambda: _verl_datasets(flat_config(verl.config), tmp_path))
    inputs = client.get_run(ids[toy.key]).inputs.dataset_inputs
    seen = {d.dataset.name: (d.dataset.source_type, {t.key: t.value for t in d.tags}["mlflow.data.context"])
            for d in inputs}  # fmt: skip
    assert len(inputs) == 3 and seen == {"addition-train": ("code", "training"), "toy24": ("code", "evaluation"),
                                         "toy25": ("code", "evaluation")}
    held = {d.dataset.name: d.dataset for d in inputs if d.dataset.name != "addition-train"}
    assert all(json.loads(d.profile)["num_rows"] > 0 and len(d.digest) == 16 for d in held.values())
    assert held["toy24"].digest != held["toy25"].digest
    inputs = client.get_run(ids[verl.key]).inputs.dataset_inputs
    assert len(inputs) == 3
    by_name = {d.dataset.name: d for d in inputs}
    assert set(by_name) == {"dapo_math_17k", "aime24", "aime25"}
    for name, d in by_name.items():
        assert d.dataset.source_type == "local"
        assert json.loads(d.dataset.source)["uri"] == str(tmp_path / "verl" / f"{name}.parquet")
        tags = {t.key: t.value for t in d.tags}
        assert tags["pdmctl.digest"] == "ab" * 32 and d.dataset.digest == ("ab" * 32)[:36]
        assert tags["mlflow.data.context"] == ("training" if name == "dapo_math_17k" else "evaluation")


def test_a_testbed_run_end_to_end_as_mlflow_shows_it(workdir: Path) -> None:
    """A real run of the testbed through `pdmctl sweep --wait`: the job leaves the readable tags (its attempt and
    job id; no executor, submission or provenance tag of its own), its provenance in the ledger's record,
    `heldout/avg16` a fraction as its sets are, its data sets as inputs, a child of the sweep's parent run."""
    short = ["backend.steps=2", "backend.eval_every=2", "backend.checkpoint_every=2", "backend.prompts_per_step=8"]
    made = pdmctl("sweep", "--name", "e2e", "mask=pdm_agg", "seed=0", *short, "--wait", cwd=workdir)
    assert made.returncode == 0, made.stdout + made.stderr
    client = MlflowClient(sqlite_uri(workdir))
    (run,) = _sweep_runs(client, "e2e")
    tags = run.data.tags
    assert {k for k in tags if k.startswith("pdmctl.")} == READABLE | {"pdmctl.job_id", TAG_LEDGER}
    assert tags["pdmctl.attempt"] == "1" and tags["pdmctl.job_id"].startswith("local-")
    record = json.loads(tags[TAG_LEDGER])
    assert record["provenance"]["config"] and record["attempts"]["1"]["job_id"] == tags["pdmctl.job_id"]
    metrics = run.data.metrics
    assert metrics["heldout/avg16"] == pytest.approx((metrics["eval/toy24"] + metrics["eval/toy25"]) / 2)
    assert 0 <= metrics["heldout/avg16"] <= 1 and "avg16" not in metrics
    assert {d.dataset.name for d in run.inputs.dataset_inputs} == {"addition-train", "toy24", "toy25"}
    (record,) = open_ledger(sqlite_uri(workdir)).runs("e2e")
    assert tags[PARENT_TAG] == open_ledger(sqlite_uri(workdir)).sweep_run("e2e")
    assert record.pending_submission is None and record.provenance["config"]
