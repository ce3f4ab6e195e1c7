"""The real engine on this CPU: VeRL 0.9.1 + vLLM's CPU build + the tiny Qwen3, through `pdmctl sweep`.

Run with the engine environment's Python (scripts/engine-env.sh; scripts/ci-engine.sh runs these):

    DIR/bin/python -m pytest -m engine tests/test_verl_engine.py

One sweep (a PDM and a DPPO run, the user's command with the debug dump and step 1's snapshot on, tracked on the CI's MLflow
server through a 60 s outage) serves the ledger, top-K, loss and outage checks; the failure test runs one
more job; the SLURM test one through the job body on the CI's SLURM on VeRL's V1 trainer (TransferQueue),
which reaches its time limit mid-training and is requeued (two engine starts).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import Result, pdmctl, sqlite_uri

ENGINE_ENV = importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("verl") is not None
# a marker, not a module-level skip: the main suite deselects these (`-m "not engine"`) without a skip
pytestmark = [
    pytest.mark.engine,
    pytest.mark.timeout(5400),
    pytest.mark.skipif(not ENGINE_ENV, reason="needs the engine environment: bash scripts/engine-env.sh DIR"),
]

# scripts/gpu-check.sh runs these same tests on a GPU with PDMCTL_ENGINE_MODEL=qwen3-tiny-gpu
MODEL = os.environ.get("PDMCTL_ENGINE_MODEL", "qwen3-tiny")
ON_CPU = MODEL == "qwen3-tiny"
SWEEP_TIMEOUT_S = 3600  # two jobs, one after the other; one can take 15 min on a slow 2-core machine, mostly start-up
SHM = Path("/dev/shm")
SNAPSHOT_STEP = 1  # the sweep's runs snapshot this step's updates (the step whose batch has mixed rewards)


@dataclass(frozen=True)
class EngineSweep:
    root: Path
    result: Result
    dump_dir: Path
    uri: str  # the tracking server itself (the sweep and its jobs saw it through a relay that closed a while)
    name: str
    outage: str  # what happened to the relay
    live: list[tuple[float, list[list[str]]]] = field(default_factory=list)  # `status` rows while it ran
    status_cli: str = ""  # `pdmctl status` run while a run trained


def _tiny_dir(root: Path) -> str:
    # CI shares one build between runs (PDMCTL_TINY_DIR); a bare run builds its own
    return os.environ.get("PDMCTL_TINY_DIR") or str(root / "tiny")


def _training(row: list[str]) -> bool:
    """A `pdmctl status` row of a run that is running, past step 0, with an avg@16."""
    return row[3].startswith("running") and row[4].isdigit() and int(row[4]) > 0 and bool(row[5])


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineSweep]:
    """The user's sweep, tracked on the CI's MLflow server through a TCP relay (the server is shared with the
    tests beside this one, so it is not stopped itself) that closes for 60 s once the first run has logged
    step 1 (`test_freq=1`: a validation every step, so some fall in the outage); while it runs,
    `pdmctl status`'s rows (its own code, in this process) every second, and the CLI itself once the first
    run shows a step and an avg@16."""
    import subprocess
    import sys
    import threading

    from pdmctl import cli, orchestrate
    from tests.test_spool import Relay

    root = tmp_path_factory.mktemp("engine-sweep")
    dump_dir = root / "dump"
    proc = subprocess.run([str(Path(__file__).resolve().parents[1] / ".ci" / "mlflow_server_up.sh")],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    server = f"http://127.0.0.1:{os.environ.get('MLFLOW_PORT', '5055')}"
    relay = Relay(int(server.rsplit(":", 1)[1]))
    uri = f"http://127.0.0.1:{relay.port}"
    name = f"engine-{int(time.time())}"
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env.update({"COLUMNS": "200", "PDMCTL_VERL_DUMP_DIR": str(dump_dir), "PDMCTL_TINY_DIR": _tiny_dir(root),
                "PDMCTL_VERL_SNAPSHOT_STEP": str(SNAPSHOT_STEP)})  # fmt: skip
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdmctl.cli", "sweep", "backend=verl", f"model={MODEL}", "mask=pdm_agg,dppo_topk_kl",
         "k=5", "backend.test_freq=1", "--name", name, "--wait", "--tracking-uri", uri], cwd=root, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    live: list[tuple[float, list[list[str]]]] = []
    status_cli: list[subprocess.Popen] = []
    outage: list[str] = []
    done = threading.Event()

    def poll() -> None:
        ctx = orchestrate.make_context("local", server)
        while not done.wait(1.0):
            with contextlib.suppress(Exception):  # the experiment may not exist yet, or the store be busy a moment
                rows = [cells for cells, _ in cli._status_rows(orchestrate.status(ctx, name))]
                live.append((time.monotonic() - started, rows))
                if not status_cli and any(_training(row) for row in rows):
                    status_cli.append(subprocess.Popen(
                        [sys.executable, "-m", "pdmctl.cli", "status", name, "--tracking-uri", server], cwd=root,
                        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))  # fmt: skip

    def away() -> None:
        """The relay closes for 60 s once a run's log shows step 1."""
        while not done.wait(1.0):
            logs = list((root / "pdmctl-runs" / name).glob("*/*/logs/attempt-1.log"))
            if any("step:1 -" in log.read_text(errors="replace") for log in logs):
                relay.down()
                went = time.monotonic()
                done.wait(60)
                relay.up()
                outage.append(f"away at step 1 of the first run for {time.monotonic() - went:.0f} s")
                return

    threads = [threading.Thread(target=poll, daemon=True), threading.Thread(target=away, daemon=True)]
    for thread in threads:
        thread.start()
    try:
        stdout, stderr = proc.communicate(timeout=SWEEP_TIMEOUT_S)
    finally:
        done.set()
        for thread in threads:
            thread.join(timeout=60)
        relay.down()
        if proc.poll() is None:
            proc.kill()
    cli_out = status_cli[0].communicate(timeout=300)[0] if status_cli else ""
    print(f"engine sweep: {time.monotonic() - started:.0f} s; tracking server {outage or ['never away']}")
    yield EngineSweep(root, Result(proc.returncode, stdout, stderr), dump_dir, server, name, "; ".join(outage),
                      live, cli_out)  # fmt: skip


def _runs(uri: str, experiment: str | None = None) -> list:
    """The runs in the store (of one experiment: a shared server holds other tests' too), not the sweeps'
    parent runs."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    runs_only = "tags.`pdmctl.sweep` LIKE '%'"
    if experiment is not None:
        return client.search_runs([client.get_experiment_by_name(experiment).experiment_id], runs_only)
    experiments = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(experiments, runs_only)


def _history(uri: str, run_id: str, name: str) -> dict[int, float]:
    from mlflow.tracking import MlflowClient

    return {m.step: m.value for m in MlflowClient(uri).get_metric_history(run_id, name)}


def _job_logs(root: Path) -> str:
    return "\n".join(p.read_text(errors="replace")[-4000:] for p in root.rglob("*.log"))


def test_sweep_trains_both_masks_and_fills_the_ledger(sweep: EngineSweep) -> None:
    assert sweep.result.returncode == 0, sweep.result.stdout[-3000:] + sweep.result.stderr[-3000:]
    runs = _runs(sweep.uri, sweep.name)
    assert len(runs) == 2, [r.info.run_name for r in runs]
    for run in runs:
        assert run.info.status == "FINISHED", (run.data.tags, _job_logs(sweep.root))
        names = set(run.data.metrics)
        assert any(n.startswith("actor/") for n in names), sorted(names)  # VeRL's own actor metrics
        # no recompute forward of old log-probs (bypass_mode): VeRL times its steps but logs no such phase
        assert "timing_s/gen" in names and "timing_s/update_actor" in names, sorted(names)
        assert "timing_s/old_log_prob" not in names and "actor/entropy" not in names, sorted(names)
        gap = _history(sweep.uri, run.info.run_id, "train/rollout_probs_diff_mean")  # the loss's, in its place
        assert sorted(gap) == [1, 2, 3] and all(0.0 <= v < 1.0 for v in gap.values()), gap
        mask_frac = _history(sweep.uri, run.info.run_id, "train/mask_frac")
        assert sorted(mask_frac) == [1, 2, 3]
        assert all(0.0 <= v <= 1.0 for v in mask_frac.values())
        # the preset's later mini-batches are off-policy (lr 1e-2): the mask bites, and says how much
        assert max(mask_frac.values()) > 0.0, ("no token masked", run.data.params.get("actor_rollout_ref.actor.policy_loss.loss_mode"), mask_frac)
        for name in ("train/out_of_region_frac", "train/mean_divergence"):
            assert sorted(_history(sweep.uri, run.info.run_id, name)) == [1, 2, 3], name
        for dataset in ("eval/aime24", "eval/aime25"):
            evals = _history(sweep.uri, run.info.run_id, dataset)
            assert sorted(evals) == [0, 1, 2, 3], (dataset, evals)  # before training and after each step
            assert all(0.0 <= v <= 1.0 for v in evals.values())
    # the stall watchdog's progress: the vLLM servers count the tokens they generate and
    # the actors the micro-batches they train, and Ray brings both reports to the job's reader
    logs = "\n".join(p.read_text(errors="replace") for p in sweep.root.rglob("attempt-*.log"))
    assert re.search(r"pdmctl-progress tokens=[1-9]\d* host=\S+ pid=\d+", logs), logs[-3000:]
    assert re.search(r"pdmctl-progress microbatches=[1-9]\d* host=\S+ pid=\d+", logs), logs[-3000:]


def test_status_shows_a_verl_runs_step_and_avg16_while_it_trains(sweep: EngineSweep) -> None:
    """VeRL's `critic/score/mean` and `val-core/<source>/acc/mean@16` reach pdmctl's
    names as VeRL logs them, so `pdmctl status` shows a step and an avg@16 before the run finishes, and
    the job's copy when the attempt ends adds no step."""
    training = [(t, row) for t, rows in sweep.live for row in rows if _training(row)]
    assert training, f"no running row with a step > 0 and an avg@16 in {len(sweep.live)} polls: {sweep.live[-3:]}"
    for t, row in training[:1] + training[-1:]:
        print(f"status at {t:.0f} s: {' | '.join(row[1:6])}")
    print(f"pdmctl status while a run trained:\n{sweep.status_cli}")
    for run in _runs(sweep.uri, sweep.name):
        _no_step_twice(sweep.uri, run.info.run_id)
        assert sorted(_history(sweep.uri, run.info.run_id, "train/reward")) == [1, 2, 3]


def test_verl_validations_give_per_problem_scores_and_the_two_level_interval(sweep: EngineSweep) -> None:
    """Each validation's problems × 16 samples (VeRL's own grades) are stored as the
    testbed stores them; their mean is VeRL's mean@16; the report gets its seed × problem interval and
    pass@k / maj@k for the VeRL rows."""
    import numpy as np

    from pdmctl.ledger import load_per_problem, load_samples, open_ledger
    from pdmctl.report.build import build_report
    from pdmctl.report.definition import load_definition
    from pdmctl.report.tables import results_table

    runs = _runs(sweep.uri, sweep.name)
    for run in runs:
        for dataset in ("aime24", "aime25"):
            evals = _history(sweep.uri, run.info.run_id, f"eval/{dataset}")
            per_problem = load_per_problem(sweep.uri, run.info.run_id, dataset)
            assert sorted(per_problem) == sorted(evals), (dataset, sorted(per_problem), sorted(evals))
            for step, accuracies in per_problem.items():
                assert len(accuracies) == 16, "the tiny model's 16 held-out problems"
                assert np.mean(accuracies) == pytest.approx(evals[step], abs=1e-6), (dataset, step)
                correct, answers = load_samples(sweep.uri, run.info.run_id, dataset, step)
                assert np.shape(correct) == np.shape(answers) == (16, 16), "16 samples per problem"
    ledger = open_ledger(sweep.uri)
    for record in ledger.runs(sweep.name):  # where the engine's numbers come from
        prov = record.provenance
        assert len(prov["data"]) == 16 and int(prov["data"], 16) >= 0, ("the data the job read, digested", prov)
        assert prov["version.verl"] == "0.9.1" and prov["version.vllm"].startswith("0.") and prov["version.torch"]
        assert prov["eval_sampling"].startswith("n=16 ") and len(prov["commit"]) == 40, prov
        assert json.loads(prov["attempt.1"])["job_id"].startswith("local-"), prov
    report = build_report(ledger, [sweep.name], load_definition("default"), two_level=True)
    assert len(report.rows) == 2
    for row in report.rows:
        assert row.two_level == {"AIME24": True, "AIME25": True, "Average": True}, row
    table = results_table(report)
    # AIME24, AIME25 and their average carry the two-level mark in both rows (one seed each here: n/a)
    assert all(sum("‡" in str(cell) for cell in r) == 3 for r in table.rows) and "two-level" in table.note, table.rows
    assert {p.row.mask for p in report.pass_k} == {"pdm_agg", "dppo_topk_kl"}
    assert all(p.samples == 16 and p.ks == (1, 2, 4, 8, 16) for p in report.pass_k)
    for p in report.pass_k:
        print(f"{p.row.mask}: pass@16 {p.cells['AIME24', 'pass', 16].mean:.3f}, maj@16 "
              f"{p.cells['AIME24', 'maj', 16].mean:.3f}, pass@1 {p.cells['AIME24', 'pass', 1].mean:.3f}")
    for r in table.rows:
        print("report:", " | ".join(map(str, r)))


def _dumps(dump_dir: Path) -> list[tuple[dict, dict]]:
    import torch

    pairs = []
    for logits_file in sorted(dump_dir.glob("logits-*.pt")):
        loss_file = logits_file.with_name(logits_file.name.replace("logits-", "loss-"))
        assert loss_file.exists(), f"{logits_file.name} without its loss record"
        pairs.append((torch.load(logits_file, weights_only=False), torch.load(loss_file, weights_only=False)))
    return pairs


def test_topk_came_from_vllm(sweep: EngineSweep) -> None:
    pairs = _dumps(sweep.dump_dir)
    assert len(pairs) == 2, "one actor micro-batch per run"
    _check_topk_from_vllm(pairs)
    # the servers asked vLLM for flat lists and read them as arrays (no Logprob object per entry)
    from pdmctl.backends.verl.topk import FLAT_LOGPROBS_LINE

    logs = "\n".join(p.read_text(errors="replace") for p in sweep.root.rglob("attempt-*.log"))
    assert FLAT_LOGPROBS_LINE in logs, logs[-3000:]


def _check_topk_from_vllm(pairs: list[tuple[dict, dict]]) -> None:
    import torch

    for logits, _ in pairs:
        ids, logprobs, sampled = logits["topk_ids"], logits["topk_logprobs"], logits["sampled_ids"]
        k = ids.shape[-1] - 1
        assert k == 5 and ids.shape[0] > 0
        top = ids[:, :k]
        assert all(len(set(row.tolist())) == k for row in top), "K distinct ids per generated token"
        assert bool(torch.isfinite(logprobs[:, :k]).all())
        # ranks: vLLM's top-K comes sorted by rank, so log-probs do not increase along the row
        assert bool((logprobs[:, 1:k] <= logprobs[:, : k - 1] + 1e-6).all())
        hit = (ids == sampled[:, None]) & torch.isfinite(logprobs)
        assert bool(hit.any(-1).all()), "every sampled token is in its row's TopK ∪ {k}"
        # vLLM's log-prob of the sampled token, carried in the support, is VeRL's rollout_log_probs
        assert bool((hit.sum(-1) == 1).all()), "the sampled token appears once in its row"
        sampled_lp = logprobs.masked_fill(~hit, 0).sum(-1)
        torch.testing.assert_close(sampled_lp, logits["sampled_logprobs"], atol=1e-5, rtol=0)


def _check_mask_applied(pairs: list[tuple[dict, dict]]) -> None:
    """The mask and the ratio VeRL's loss applied to each dumped micro-batch are pdmctl.masks' on the same
    logits, exactly, with the same advantages."""
    import torch

    from pdmctl import masks

    for logits, loss in pairs:
        s = logits["settings"]
        inside = loss["response_mask"].bool()
        assert int(inside.sum()) == logits["sampled_ids"].shape[0], "the two records describe the same micro-batch"
        tensors = (logits["logits"].float(), logits["sampled_ids"], logits["topk_ids"], logits["topk_logprobs"],
                   logits["sampled_logprobs"], logits["advantages"])  # fmt: skip
        d = masks.token_diagnostics(*tensors, method=s["method"], divergence=s["divergence"], estimator=s["estimator"],
                                    delta=s["delta"], delta_low=s["delta_low"], eps_low=s["eps_low"],
                                    eps_high=s["eps_high"])  # fmt: skip
        assert torch.equal(d.keep.bool(), loss["keep"][inside].bool()), "the mask VeRL applied"
        torch.testing.assert_close(d.ratio.float(), loss["ratio"][inside].float(), rtol=1e-6, atol=0)
        torch.testing.assert_close(loss["advantages"][inside].float(), logits["advantages"].float())


def test_loss_inside_verl_equals_masks_policy_loss(sweep: EngineSweep) -> None:
    """The mask VeRL applied is pdmctl.masks' on the same logits, exactly; the loss is MATH.md's
    formula on VeRL's own log-probs, token by token; and `policy_loss` offline is that formula on the
    float log-probs of the same logits. The two log-probs agree to bf16 precision only (VeRL's actor
    runs its forward in bf16 on this CPU), so the summed losses are not compared: the advantages have
    both signs, and the sum cancels (it differed by 3% in one CI run, 0.2% in another)."""
    import torch

    from pdmctl import masks

    pairs = _dumps(sweep.dump_dir)
    assert len(pairs) == 2
    _check_mask_applied(pairs)
    for logits, loss in pairs:
        s = logits["settings"]
        n = logits["sampled_ids"].shape[0]
        inside = loss["response_mask"].bool()
        tensors = (logits["logits"].float(), logits["sampled_ids"], logits["topk_ids"], logits["topk_logprobs"],
                   logits["sampled_logprobs"], logits["advantages"])  # fmt: skip
        kwargs = dict(method=s["method"], divergence=s["divergence"], estimator=s["estimator"], delta=s["delta"],
                      delta_low=s["delta_low"], eps_low=s["eps_low"], eps_high=s["eps_high"])  # fmt: skip
        d = masks.token_diagnostics(*tensors, **kwargs)
        verl_lp = loss["log_prob"][inside].float()
        offline_lp = torch.log_softmax(logits["logits"].float(), -1).gather(-1, logits["sampled_ids"][:, None])[:, 0]
        # VeRL takes its log-probs from the model's own forward (bf16 on this CPU), the mask from the bf16
        # logits handed to the logits processor: they agree to bf16 precision
        torch.testing.assert_close(verl_lp, offline_lp, rtol=1e-2, atol=8e-3)
        # L = −A · sg(min(r, C)) · M · log π_k, token by token, on VeRL's log-probs
        weight = -logits["advantages"].float() * d.ratio.clamp(max=s["ratio_cap"]) * d.keep.float()
        torch.testing.assert_close(loss["token_loss"][inside].float(), weight * verl_lp, rtol=1e-5, atol=1e-7)
        # offline, `policy_loss` is the same formula on the float log-probs of the same logits, exactly
        offline, _ = masks.policy_loss(*tensors, torch.ones(n, dtype=torch.bool), **kwargs,
                                       ratio_cap=s["ratio_cap"], loss_agg_mode="token-mean")  # fmt: skip
        offline_sum = offline.detach().double() * n
        torch.testing.assert_close(offline_sum, (weight * offline_lp).sum().double(), rtol=1e-5, atol=1e-6)


def test_the_loss_never_reads_verls_old_log_probs_at_any_micro_batch_of_either_run(sweep: EngineSweep) -> None:
    """The runs skip VeRL's old-log-prob recompute (`bypass_mode`: `old_log_probs` holds the rollout's); one that
    recomputes them trains the same exactly when the loss never reads them. At every actor micro-batch of both
    runs' three steps, VeRL's whole `ppo_loss` again with `old_log_probs` replaced (0.5 lower a token, a leaf
    that asks for its gradient) gives the same loss, bit for bit, and the replacement never reaches it (no
    gradient at all): the same loss and the same gradient with the recompute's values or any other."""
    records = [json.loads(line) for path in sorted(sweep.dump_dir.glob("old-log-probs-*.jsonl"))
               for line in path.read_text().splitlines()]  # fmt: skip
    files = sorted(sweep.dump_dir.glob("old-log-probs-*.jsonl"))
    assert len(files) == 2, "one actor process a run"
    errors = [r["error"] for r in records if "error" in r]
    assert not errors, errors[:3]
    for path in files:  # 3 steps x 4 mini-batches x 2 micro-batches (the tiny preset's batch)
        assert len(path.read_text().splitlines()) == 3 * 4 * 2, path.name
    assert all(r["loss"] == r["replaced"] and not r["gradient"] and not r["reached"] for r in records), records[:5]
    print(f"old log-probs never read: {len(records)} micro-batches, losses {records[0]['loss']:.4g}...")


def test_analyze_engine_replays_the_snapshot_and_lands_on_verls_update(sweep: EngineSweep) -> None:
    """`pdmctl analyze --engine verl RUN_DIR --step 1` on the PDM run's snapshot, on every update of the step:
    VeRL's own gradients through the replay's clip and AdamW, and the replay's whole kept-everything update
    (its own forward: VeRL's packed micro-batches in bf16, as the snapshot recorded them), land on VeRL's
    weights after the step within a few float32 ulps of the largest weight, the replay's gradient VeRL's own
    to float32 rounding; the counterfactual rerun in float64 gives every own effect above the float32 floor the same
    sign; the primary metric, its channels and the regime table are printed."""
    (run,) = [r for r in _runs(sweep.uri, sweep.name) if r.data.params.get("mask.method") == "pdm"]
    run_dir = next((sweep.root / "pdmctl-runs").glob(f"{sweep.name}/*/{run.info.run_id}"))
    started = time.monotonic()
    result = pdmctl("analyze", "--engine", "verl", str(run_dir), "--step", str(SNAPSHOT_STEP), "--threads", "2",
                    cwd=sweep.root, timeout=1800)  # fmt: skip
    print(f"analyze --engine verl: {time.monotonic() - started:.0f} s\n{result.stdout}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    checks = re.findall(r"max \|Δw\| (\S+) from VeRL's weights after, (within|ABOVE) float32 rounding's (\S+)", result.stdout)
    assert checks, result.stdout
    for diff, _, bound in checks:
        assert float(diff) <= float(bound), (diff, bound)
    packed = re.findall(r"the replay's own forward \(VeRL's (\d+) packed micro-batch forward\(s\) in bf16\): "
                        r"gradient (\S+) from VeRL's", result.stdout)  # fmt: skip
    assert packed and len(checks) == 2 * len(packed), result.stdout
    assert all(float(rel) <= 1e-6 for _, rel in packed), packed  # float32 rounding (0 here: the same ops in order)
    (agree, above), = re.findall(r"signs of own effects agree on (\d+)/(\d+) above the floor", result.stdout)
    assert agree == above, result.stdout
    for said in ("PRIMARY METRIC engine", "CHANNELS engine step 1", "whole step:", "clip held:",
                 "The regime beside the paper's", "out of the region, of the response tokens"):  # fmt: skip
        assert said in result.stdout, said
    bad = pdmctl("analyze", "--engine", "verl", str(run_dir), "--step", "7", cwd=sweep.root)
    assert bad.returncode == 2 and "no snapshot of step 7" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def _engine_processes(marker: str) -> list[int]:
    """The engine's processes of the test's job: the trainer and all it started carry both the test's
    marker and the job's engine tag (the local executor's worker has the marker alone: it was
    started by the test's `pdmctl sweep` and outlives its jobs by design)."""
    needle = marker.encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if needle in environ and any(v.startswith(b"PDMCTL_ENGINE_TAG=") for v in environ):
                found.append(int(entry.name))
    return found


def _failing_sweep(tmp_path: Path, failure: str, timeout: int, **env: str) -> tuple[float, str]:
    """One PDM run with `PDMCTL_VERL_FAIL=failure` through `pdmctl sweep --wait`: it must end FAILED;
    returns how long it took and the run's reason."""
    env = {"PDMCTL_VERL_FAIL": failure, "PDMCTL_TINY_DIR": _tiny_dir(tmp_path), **env}
    started = time.monotonic()
    result = pdmctl(
        "sweep", "backend=verl", f"model={MODEL}", "mask=pdm_agg", "k=5", "--wait",
        "--tracking-uri", sqlite_uri(tmp_path), cwd=tmp_path, env=env, timeout=timeout,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    assert result.returncode != 0 or "FAILED" in result.stdout
    (run,) = _runs(sqlite_uri(tmp_path))
    assert run.info.status == "FAILED", (run.info.status, _job_logs(tmp_path))
    return elapsed, " ".join(v for k, v in run.data.tags.items() if "reason" in k)


@pytest.mark.engine_long  # a third engine start beside the sweep's two: by scripts/ci-engine.sh --all
def test_failure_in_the_rollout_fails_the_run_and_leaves_nothing(tmp_path: Path) -> None:
    shm_before = {p.name for p in SHM.iterdir()}
    marker = "PDMCTL_VERL_FAIL=rollout"
    elapsed, reason = _failing_sweep(tmp_path, "rollout", timeout=1800)
    assert elapsed < 1500, f"a failed engine job took {elapsed:.0f} s to end"
    assert "failure injected in the rollout worker" in reason, reason
    if not ON_CPU:
        pytest.xfail("leftover engine processes and /dev/shm segments: pdmctl cleans them up on CPU only")
    assert _engine_processes(marker) == [], "engine processes outlived the job"
    leftover = {p.name for p in SHM.iterdir()} - shm_before
    assert not {n for n in leftover if n.startswith(("verl_", "psm_", "sem.loky-"))}, leftover


# ---------------------------------------------------------------------------
# kill -9 and resume starts the engine twice: `engine_long`, run by scripts/ci-engine.sh --all (on a
# machine 3x slower than the one that measured it, it alone could take 30 min); the SLURM job runs in CI
# ---------------------------------------------------------------------------


def _job_processes(run_dir: Path) -> list[int]:
    """The job's processes: its `pdmctl.job` (named by its job file) and every engine process it
    started (they carry the ledger's MLflow run id in their environment)."""
    run_id = run_dir.name.encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(run_dir / "job.json").encode() in cmdline or b"MLFLOW_RUN_ID=" + run_id in environ:
            found.append(int(entry.name))
    return found


def _no_step_twice(uri: str, run_id: str) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    for name in client.get_run(run_id).data.metrics:
        steps = [m.step for m in client.get_metric_history(run_id, name)]
        assert len(steps) == len(set(steps)), f"{name}: steps {sorted(steps)}"


@pytest.mark.engine_long
def test_kill_9_after_the_first_checkpoint_then_resume_continues_the_same_run(tmp_path: Path) -> None:
    import signal

    env = {"PDMCTL_TINY_DIR": _tiny_dir(tmp_path)}
    uri = sqlite_uri(tmp_path)
    args = ["backend=verl", f"model={MODEL}", "mask=pdm_agg", "k=5", "--tracking-uri", uri]
    result = pdmctl("sweep", *args, cwd=tmp_path, env=env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    (run_dir,) = [p for p in (tmp_path / "pdmctl-runs").glob("default/*/*") if p.is_dir()]
    tracker = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    deadline = time.monotonic() + 1800
    while not tracker.exists() and time.monotonic() < deadline:
        time.sleep(2)
    assert tracker.exists(), _job_logs(tmp_path)
    first_checkpoint = int(tracker.read_text())
    pids = _job_processes(run_dir)
    assert pids, "the job's processes"
    for pid in pids:  # all at once, as the OOM killer or a lost node would
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    status = ""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the executor sees its job gone
        status = pdmctl("status", "--tracking-uri", uri, cwd=tmp_path).stdout
        if "finished" not in status and "running" not in status:
            break
        time.sleep(5)
    result = pdmctl("resume", "--wait", "--tracking-uri", uri, cwd=tmp_path, env=env, timeout=2400)
    assert result.returncode == 0, result.stdout + result.stderr + _job_logs(tmp_path)
    (run,) = _runs(uri)
    assert run.info.status == "FINISHED" and run.info.run_id == run_dir.name  # the same MLflow run
    second = (run_dir / "logs" / "attempt-2.log").read_text(errors="replace")
    assert f"global_step_{first_checkpoint}" in second, "VeRL resumed from the checkpoint"
    _no_step_twice(uri, run.info.run_id)
    assert sorted(_history(uri, run.info.run_id, "train/mask_frac")) == [1, 2, 3]
    assert {0, 3} <= set(_history(uri, run.info.run_id, "eval/aime24"))
    assert _job_processes(run_dir) == [], "processes of the killed attempt outlived the resume"


def _slurm(*args: str) -> str:
    import subprocess

    return subprocess.run(list(args), capture_output=True, text=True, timeout=60, check=True).stdout


def _wait_for_text(path: Path, text: str, timeout: float, root: Path, run: tuple[str, str] | None = None) -> str:
    """The log at `path` once it holds `text`; fails at once when the run (`(tracking URI, run id)`) ends
    without it (CI waited out 1,800 s for a job that had failed at its start)."""
    from mlflow.tracking import MlflowClient

    deadline, looked = time.monotonic() + timeout, time.monotonic()
    while True:
        content = path.read_text(errors="replace") if path.exists() else ""
        if text in content:
            return content
        assert time.monotonic() < deadline, f"no {text!r} in {path} after {timeout:.0f} s:\n{_job_logs(root)}"
        if run is not None and time.monotonic() - looked > 10:
            looked = time.monotonic()
            status = MlflowClient(run[0]).get_run(run[1]).info.status
            assert status not in ("FINISHED", "FAILED", "KILLED"), f"the run ended {status} without {text!r}:\n" + (
                _job_logs(root))  # fmt: skip
        time.sleep(1)


@contextlib.contextmanager
def _most_checkpoints(directory: Path) -> Iterator[list[int]]:
    """The most `global_step_*` directories seen in `directory` (looked at every 0.2 s) while the block runs."""
    import threading

    most, done = [0], threading.Event()

    def look() -> None:
        while not done.wait(0.2):
            most[0] = max(most[0], len(list(directory.glob("global_step_*"))))

    watcher = threading.Thread(target=look, daemon=True)
    watcher.start()
    try:
        yield most
    finally:
        done.set()
        watcher.join()


def test_a_preflight_on_slurm_trains_requeues_through_usr2_and_resumes_the_engine_through_the_guard(
    tmp_path: Path,
) -> None:
    """`pdmctl preflight` of a VeRL setting on the CI's SLURM: the job body starts Ray's head in the
    allocation and the trainer joins it; after step 1's checkpoint the job asks SLURM for its time-limit
    signal (USR2 to the batch step); with the profile's grace to save on the way out, the trainer answers that
    step 1 is checkpointed, the job requeues on its answer, and the next attempt resumes from VeRL's
    checkpoint (read through the checkpoint guard) into the same MLflow run, every step logged once. The
    verdict says so with the measured times and the checkpoint's size, and the sweep's dry run then costs the
    setting from those measurements. With 2 checkpoints a run
    (`backend.max_ckpt_to_keep=2`) and one after every step, the run ends with global_step_2 and _3, never
    more than 2 on disk during the resumed attempt. It runs VeRL 0.9.1's default trainer (V1, PDMCTL_VERL_TRAINER=v1),
    which moves samples through TransferQueue, not a DataProto: the top-K travels as two per-sample fields
    there (patches._patch_agent_loop_tq), and each attempt's first actor micro-batch holds vLLM's top-K and the
    mask pdmctl.masks computes on it (δ = 1e-6: the bf16 forward's train/rollout gap alone, 1e-7..1e-5 per
    token, puts most tokens out of the region, so the mask acts wherever the advantage is not zero)."""
    import yaml

    local = yaml.safe_load((Path(__file__).resolve().parents[1] / "clusters" / "slurm-local.yaml").read_text())
    profile = tmp_path / "slurm-verl.yaml"
    # a grace to save on the way out, as the GPU profiles give (clusters/h20.yaml): the job's USR2 handler
    # tells the trainer, in Ray's processes, through the run directory, and requeues on the trainer's answer
    profile.write_text(yaml.safe_dump({**local, "name": "slurm-verl", "time": 30, "signal_delay_s": 120,
                                       "save_grace_s": 90, "max_timeouts": 3}))  # fmt: skip
    dump_dir = tmp_path / "dump"
    env = {"PDMCTL_TINY_DIR": _tiny_dir(tmp_path), "PDMCTL_VERL_TRAINER": "v1", "PDMCTL_VERL_DUMP_DIR": str(dump_dir)}
    uri = sqlite_uri(tmp_path)
    # 2 checkpoints a run across attempts: VeRL alone keeps 1, 2 and 3 here (its list of
    # what it saved starts empty in the resumed attempt)
    args = ["backend=verl", f"model={MODEL}", "mask=pdm_agg", "k=5", "delta=1e-6", "backend.max_ckpt_to_keep=2",
            "--name", "engine", "--cluster", str(profile), "--tracking-uri", uri]  # fmt: skip
    result = pdmctl("preflight", *args, cwd=tmp_path, env=env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    (run_dir,) = [p for p in (tmp_path / "pdmctl-runs").glob("engine.preflight/*/*") if p.is_dir()]
    with _most_checkpoints(run_dir / "checkpoints") as most:
        result = pdmctl("preflight", *args, "--wait", cwd=tmp_path, env=env, timeout=2400)  # submits nothing
    assert result.returncode == 0, result.stdout + result.stderr + _job_logs(tmp_path)
    (verdict,) = [line for line in result.stdout.splitlines() if line.startswith("  ")]
    assert verdict.startswith(f"  ok    {MODEL} bf16 on fsdp pdm_agg (") or verdict.startswith("  ok    "), verdict
    for said in ("steps 1-3 in 2 attempts, requeued after step 1 and resumed from its checkpoint",
                 "first step after ", "the resumed attempt's after ", "a step ", "a checkpoint "):  # fmt: skip
        assert said in verdict, verdict
    (run,) = _runs(uri, "engine.preflight")
    assert run.info.status == "FINISHED" and run.info.run_id == run_dir.name, _job_logs(tmp_path)  # the same run
    kept = sorted(p.name for p in (run_dir / "checkpoints").glob("global_step_*"))
    print(f"checkpoints: at most {most[0]} on disk during attempt 2; at the end {kept}")
    assert kept == ["global_step_2", "global_step_3"] and most[0] <= 2, (kept, most)
    logs = {p.name: p.read_text(errors="replace") for p in (run_dir / "logs").glob("attempt-*.log")}
    assert sorted(logs) == ["attempt-1.log", "attempt-2.log"], sorted(logs)
    first, second = logs["attempt-1.log"], logs["attempt-2.log"]
    # the job took SLURM's USR2 (the trainer asked for it; its own line may not reach this log before Ray's log
    # forwarding is ended with the job) and requeued itself before any limit
    assert "Caught signal SIGUSR2" in first and "Requeued job" in first, first[-3000:]
    assert "DUE TO TIME LIMIT" not in first, first[-3000:]
    # through the save on the way out: the handler flagged the run, the trainer answered that step 1's
    # checkpoint was written, and the job requeued on that line, not at the grace's end
    assert "pdmctl: SLURM's USR2: the step under way finishes and is checkpointed" in first, first[-3000:]
    assert "pdmctl: checkpointed on the way out at step 1" in first, first[-3000:]
    assert "no checkpoint within 90 s" not in first, first[-3000:]
    # the job body started Ray's head in the allocation, and the trainer joined that cluster
    for log in (first, second):
        assert "Ray runtime started" in log and "pdmctl: 1 Ray node(s) up" in log, log[-3000:]
        assert "Connecting to existing Ray cluster" in log, log[-3000:]
    assert "global_step_1" in second and "requeueing" not in second, second[-3000:]  # resumed, never requeued again
    # the resume read VeRL's checkpoint files as weights only (safeload), and nothing was refused
    assert "pdmctl: checkpoint files load as weights only (first: " in second and ": refused: " not in second, second[-3000:]
    assert "Initial validation metrics" not in first + second  # no validation before the first step
    mask_frac = _history(uri, run.info.run_id, "train/mask_frac")
    assert sorted(mask_frac) == [1, 2, 3]
    assert set(_history(uri, run.info.run_id, "pdmctl/first_step_s")) == {1, 2}  # each attempt's start-up
    assert set(_history(uri, run.info.run_id, "eval/aime24")) == {3}  # the preflight evaluates at its end only
    _no_step_twice(uri, run.info.run_id)
    # V1: both attempts ran VeRL's V1 trainer; the mask acted at every step whose batch had a non-zero advantage
    # (the tiny model mostly fails every sample: a run with none would test no mask at all)
    for log in (first, second):
        assert "pdmctl: VeRL's V1 trainer (TransferQueue)" in log and "main_ppo_v0" not in log, "ran V0"
    adv = {step: max(abs(v), abs(_history(uri, run.info.run_id, "critic/advantages/min")[step]))
           for step, v in _history(uri, run.info.run_id, "critic/advantages/max").items()}  # fmt: skip
    informative = [step for step in sorted(adv) if adv[step] > 0]
    assert informative, ("no step had a non-zero advantage: the tiny model's rewards were all equal", adv)
    assert all(mask_frac[step] > 0.0 for step in informative), (mask_frac, adv)
    pairs = _dumps(dump_dir)
    assert 1 <= len(pairs) <= 2, "an actor micro-batch per attempt"
    _check_topk_from_vllm(pairs)
    _check_mask_applied(pairs)
    # the sweep's dry run of the setting now costs it from the preflight's measurements (the profile states
    # no throughput for the tiny model: without them it would have no cost)
    dry = pdmctl("sweep", *args, "--dry-run", cwd=tmp_path, env=env, timeout=300)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    text = " ".join(dry.stdout.split())
    assert "rests on preflight engine.preflight's 1 run(s) of this setting" in text, dry.stdout[-3000:]
    assert "measured a step of " in text, dry.stdout[-3000:]


@pytest.mark.engine_long
def test_a_tune_trial_on_the_engine_reports_every_validation(tmp_path: Path) -> None:
    """`pdmctl tune` on VeRL: the job reads each validation VeRL prints and reports it to its trial
    (what the pruner decides on), and the trial's value is the final evaluation in the ledger."""
    import optuna

    env = {"PDMCTL_TINY_DIR": _tiny_dir(tmp_path)}
    uri = sqlite_uri(tmp_path)
    result = pdmctl(
        "tune", "backend=verl", f"model={MODEL}", "k=5", "delta=interval(0.05,0.3)", "backend.test_freq=1",
        "--trials", "1", "--pruner", "median", "--name", "vt", "--tracking-uri", uri,
        cwd=tmp_path, env=env, timeout=2400,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr + _job_logs(tmp_path)
    (trial,) = optuna.load_study(study_name="vt", storage=f"sqlite:///{tmp_path / 'mlflow.optuna.db'}").trials
    assert trial.state == optuna.trial.TrialState.COMPLETE, _job_logs(tmp_path)
    assert sorted(trial.intermediate_values) == [0, 1, 2, 3]
    (run,) = _runs(uri)
    final = [_history(uri, run.info.run_id, f"eval/{s}")[3] for s in ("aime24", "aime25")]
    assert trial.value == pytest.approx(sum(final) / 2)
    assert trial.intermediate_values[3] == pytest.approx(trial.value)


@pytest.mark.engine_long
def test_a_failure_in_the_weight_sync_ends_the_job_in_bounded_time(tmp_path: Path) -> None:
    """The hazard of the first experiment: an exception in a vLLM worker during the weight sync hung
    the job. Injected there, the job ends (VeRL reports it, or pdmctl's watchdog ends the silent
    trainer that reports no progress for PDMCTL_ENGINE_STALL_S), the run is FAILED with a reason, nothing is left behind."""
    marker = "PDMCTL_VERL_FAIL=weight-sync"
    elapsed, reason = _failing_sweep(tmp_path, "weight-sync", timeout=2400, PDMCTL_ENGINE_STALL_S="300")
    assert "failure injected in the weight sync" in reason or "made no progress for 300 s" in reason, reason
    print(f"weight-sync failure: ended after {elapsed:.0f} s; reason: {reason}")
    if ON_CPU:
        assert _engine_processes(marker) == [], "engine processes outlived the job"


def test_a_tracking_server_outage_during_training_loses_no_metric(sweep: EngineSweep) -> None:
    """The tracking server went away for 60 s while the sweep's first run trained and validated: the
    TaskRunner kept what the server did not confirm on the run's disk and trained on, `sweep --wait` waited
    for the server; once it answered again every step of every metric of both runs is there once, with each
    validation's per-problem record."""
    from pdmctl.ledger import load_per_problem

    assert sweep.outage.startswith("away at step 1"), sweep.outage
    assert sweep.result.returncode == 0, sweep.result.stdout[-3000:] + sweep.result.stderr[-3000:]
    assert "waiting for it" in sweep.result.stdout, sweep.result.stdout[-3000:]
    logs = "\n".join(p.read_text(errors="replace") for p in sweep.root.rglob("attempt-*.log"))
    assert "entries kept in" in logs, "the outage was seen while a run trained"
    for run in _runs(sweep.uri, sweep.name):
        assert run.info.status == "FINISHED", (run.data.tags, _job_logs(sweep.root))
        _no_step_twice(sweep.uri, run.info.run_id)
        counts = {name: sorted(_history(sweep.uri, run.info.run_id, name)) for name in
                  ("train/mask_frac", "train/reward", "eval/aime24", "eval/aime25", "critic/score/mean")}  # fmt: skip
        print(f"steps per metric after the outage: {counts}")
        assert counts["train/mask_frac"] == counts["train/reward"] == [1, 2, 3]
        assert counts["eval/aime24"] == counts["eval/aime25"] == [0, 1, 2, 3]
        assert sorted(load_per_problem(sweep.uri, run.info.run_id, "aime24")) == [0, 1, 2, 3]
        run_dir = next(p for p in (sweep.root / "pdmctl-runs").glob(f"{sweep.name}/*/{run.info.run_id}"))
        assert not list((run_dir / "spool").glob("*.tmp*"))
