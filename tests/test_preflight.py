"""`pdmctl preflight`: one short job per distinct setting of a sweep that trains, checkpoints, requeues
itself through SLURM's time-limit signal and resumes (pdmctl/preflight). The plan of paper-main on the h20
profile without SLURM; on the CI's one-node SLURM, the testbed's preflight for real: every setting resumed,
every step once, kept out of the sweep's own status; a setting that fails is one line naming its error,
exit 2."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pdmctl import grid
from pdmctl.preflight import cli as preflight_cli

REPO = Path(__file__).resolve().parents[1]
TOY = ["backend.prompts_per_step=8", "backend.eval_samples=2", "backend.group_size=4"]


def _pdmctl(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 900):
    return subprocess.run([str(Path(sys.executable).parent / "pdmctl"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})  # fmt: skip


def test_one_preflight_run_per_setting_and_mask_method_with_a_checkpoint_every_step() -> None:
    """paper-main's 48 runs give 12 preflight runs: its four settings times the three methods (GRPO's
    ratio, DPPO's top-K and PDM's masks; PDM agg and uni share PDM's code), each a few steps with a
    checkpoint every step, in a sweep of its own."""
    specs = grid.expand([], grid.load_sweep_file("paper-main"))
    chosen = preflight_cli.representatives(specs)
    assert len(specs) == 48 and len(chosen) == 12
    assert {(s.config["model"]["name"], s.config["mask"]["method"]) for s in chosen} == {
        (m, method) for m in ("qwen3-4b-base", "qwen3-8b-base", "qwen3-30b-a3b-base")
        for method in ("grpo", "dppo", "pdm")} and len({s.config["precision"]["name"] for s in chosen}) == 3  # fmt: skip
    run = preflight_cli.preflight_spec(chosen[0], 3)
    assert run.sweep == "paper-main.preflight" and run.key != chosen[0].key
    assert {k: run.config["backend"][k] for k in ("total_training_steps", "save_freq", "val_before_train")} == {
        "total_training_steps": 3, "save_freq": 1, "val_before_train": False}  # fmt: skip
    toy = preflight_cli.preflight_spec(grid.expand(["backend=toy"], None, "s")[0], 4)
    assert {k: toy.config["backend"][k] for k in ("steps", "checkpoint_every", "eval_every")} == {
        "steps": 4, "checkpoint_every": 1, "eval_every": 4}  # fmt: skip


def _staged_h20(tmp_path: Path) -> Path:
    """clusters/h20.yaml with every placeholder filled in, its weights staged (sparse files of each preset's
    size) and its data prepared (`pdmctl data prepare`'s layout and manifest, from a local file)."""
    from pdmctl.backends.verl.data import prepare_data
    from tests.conftest import stage_model

    for name, preset in (("Qwen3-4B-Base", "qwen3-4b-base"), ("Qwen3-8B-Base", "qwen3-8b-base"),
                         ("Qwen3-30B-A3B-Base", "qwen3-30b-a3b-base")):  # fmt: skip
        stage_model(tmp_path / "models" / name, preset)
    source = tmp_path / "problems.jsonl"
    source.write_text("".join(json.dumps({"problem": f"{i} + 1 = ?", "answer": str(i + 1)}) + "\n" for i in range(8)))
    prepare_data(tmp_path / "data", str(source), str(source), str(source))
    text = (REPO / "clusters" / "h20.yaml").read_text().replace("CHANGE-ME", "site")
    fields = {**yaml.safe_load(text), "models_dir": str(tmp_path / "models"), "data_dir": str(tmp_path / "data"),
              "workdir": str(tmp_path / "runs"), "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}  # fmt: skip
    path = tmp_path / "h20.yaml"
    path.write_text(yaml.safe_dump(fields))
    return path


def test_the_dry_run_of_paper_mains_preflight_plans_each_setting_without_slurm_and_writes_nothing(
    tmp_path: Path,
) -> None:
    """`pdmctl preflight --file paper-main --cluster h20 --dry-run` where no SLURM answers (as on a laptop):
    one line saying what was not checked, then each of the 12 preflight jobs with its expected wall time,
    and the total in GPU-hours; nothing written (no ledger, no run directory)."""
    profile = _staged_h20(tmp_path)
    result = _pdmctl("preflight", "--file", "paper-main", "--cluster", str(profile), "--dry-run", "--offline",
                     cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("cluster h20: not checked against SLURM (--offline): its partition site-partition "
                               "and 4 node(s) a job"), lines[0]  # fmt: skip
    jobs = [line for line in lines if line.startswith("  ")]
    assert len(jobs) == 12, result.stdout
    assert all("GPU(s), expected " in line and "two attempts" in line for line in jobs), jobs
    assert sum("qwen3-30b-a3b-base fp8_e2e" in line for line in jobs) == 3, jobs
    assert lines[-1].startswith("preflight total: ") and "GPU-hours expected" in lines[-1], lines[-1]
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "runs").exists()


def test_a_preflight_on_local_processes_is_refused_in_one_line(tmp_path: Path) -> None:
    result = _pdmctl("preflight", "backend=toy", "--dry-run", cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stdout + result.stderr
    assert "a preflight proves a SLURM profile's jobs and its requeue path" in result.stderr
    assert not (tmp_path / "mlflow.db").exists()


def test_offline_planning_is_for_a_dry_run_only(tmp_path: Path) -> None:
    result = _pdmctl("preflight", "backend=toy", "--offline", "--cluster", "slurm-local", cwd=tmp_path)
    assert result.returncode == 2 and "--offline: plans without SLURM; give --dry-run too" in result.stderr


def _slurm_answers() -> bool:
    import shutil

    if shutil.which("sinfo") is None:
        return False
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=20).returncode == 0
    except subprocess.TimeoutExpired:
        return False


needs_slurm = pytest.mark.skipif(not _slurm_answers(), reason="no SLURM answering here (.ci/slurm_up.sh)")


def _profile(tmp_path: Path, **options) -> str:
    from tests.test_slurm import write_profile

    return write_profile(tmp_path, name="slurm-preflight", max_concurrent=2, **options)


@pytest.mark.slurm
@needs_slurm
def test_on_slurm_each_setting_reaches_a_step_requeues_itself_resumes_and_every_step_is_logged_once(
    tmp_path: Path,
) -> None:
    """The testbed's preflight of two masks of different methods on the CI's SLURM: each run's first attempt
    requeues itself after step 1's checkpoint (SLURM's USR2 to the batch step, then submitit's requeue), the
    next attempt resumes from it and trains steps 2 and 3; each verdict says so with its measurements, and
    every train metric is logged once a step. The profile saves on the way out (`save_grace_s`), as the h20
    profile does: the job's handler takes the signal, the step's checkpoint is already written, and it
    requeues at once. The sweep's own status leaves the preflight out; a second
    `pdmctl preflight` submits nothing and prints the same verdicts."""
    from pdmctl import orchestrate
    from pdmctl.ledger import open_ledger

    profile = _profile(tmp_path, signal_delay_s=60, save_grace_s=30)  # as clusters/h20.yaml: a save on the way out
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = ["preflight", *TOY, "mask=pdm_agg,grpo_clip_higher", "--name", "pf", "--cluster", profile,
            "--tracking-uri", uri]  # fmt: skip
    result = _pdmctl(*args, "--wait", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    verdicts = [line for line in result.stdout.splitlines() if line.startswith("  ")]
    assert len(verdicts) == 2 and all(line.startswith("  ok    toy-small bf16 ") for line in verdicts), result.stdout
    for line in verdicts:
        assert ("steps 1-3 in 2 attempts, requeued after step 1 and resumed from its checkpoint; first step after "
                in line and "the resumed attempt's after " in line and "a step " in line and "a checkpoint " in line), line  # fmt: skip
    ctx = orchestrate.make_context(profile, uri)
    records = open_ledger(uri).runs("pf.preflight")
    assert len(records) == 2 and all(r.status == "FINISHED" and r.attempt == 2 for r in records)
    histories = open_ledger(uri).metric_histories([r.run_id for r in records])
    for record in records:
        for name, history in histories[record.run_id].items():
            if name.startswith("train/"):
                assert [s for s, _ in history] == [1, 2, 3], (name, history)
        logs = sorted(p.name for p in (Path(ctx.run_dir(record)) / "logs").glob("attempt-*.log"))
        assert logs == ["attempt-1.log", "attempt-2.log"], logs
        first = (Path(ctx.run_dir(record)) / "logs" / "attempt-1.log").read_text()
        assert "pdmctl: preflight: step 1 checkpointed; requeueing through SLURM's time-limit signal" in first
        assert "Requeued job" in first, first[-2000:]
        assert "pdmctl: SLURM's USR2: the step under way finishes and is checkpointed" in first, first[-2000:]
        assert "no checkpoint within" not in first, first[-2000:]  # requeued at once, not at the grace's end
    assert orchestrate.status(ctx, "pf") == []  # the sweep itself: no run of its own yet
    again = _pdmctl(*args, cwd=tmp_path)
    assert again.returncode == 0 and "submitted 0 job(s)" in again.stdout, again.stdout + again.stderr
    assert [line for line in again.stdout.splitlines() if line.startswith("  ")] == verdicts


@pytest.mark.slurm
@needs_slurm
def test_each_setting_that_cannot_run_is_one_line_naming_its_error_and_exit_2(tmp_path: Path) -> None:
    """Three preflight jobs on the CI's SLURM, each meeting for real what most often stops a setting: an
    allocation the machine cannot hold at the first forward (torch's allocator), a module its environment
    lacks (Python's import), and, on its resume after the requeue, a checkpoint its loader refuses (a pickle
    that would run code, written over step 1's). Each setting is one line naming the kind of failure and the
    error; the command exits 2; the planted code never ran."""
    profile = _profile(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    broken = "oom@pdm import:transformer_engine@grpo plant@dppo"
    result = _pdmctl("preflight", *TOY, "mask=pdm_agg,grpo_clip_higher,dppo_topk_kl", "--name", "pf", "--cluster",
                     profile, "--tracking-uri", uri, "--wait", cwd=tmp_path, env={"PDMCTL_TOY_BREAK": broken})  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    lines = {line.split()[3]: line for line in result.stdout.splitlines() if line.startswith("  FAIL  ")}
    assert sorted(lines) == ["dppo_topk_kl", "grpo_clip_higher", "pdm_agg"], result.stdout
    assert "): out of memory: RuntimeError: " in lines["pdm_agg"] and "allocate" in lines["pdm_agg"], lines
    assert ("): a module the job's environment lacks: ModuleNotFoundError: No module named 'transformer_engine'"
            in lines["grpo_clip_higher"]), lines  # fmt: skip
    assert "): a checkpoint its loader refused: " in lines["dppo_topk_kl"], lines
    assert "step_00000001.pt does not load" in lines["dppo_topk_kl"], lines
    assert all(len(line.splitlines()) == 1 for line in lines.values())
    assert not list(tmp_path.rglob("planted-code-ran")), "the planted checkpoint's code ran"


def test_a_sweeps_dry_run_costs_the_settings_its_preflight_measured_from_those_measurements(tmp_path: Path) -> None:
    """Once the preflight of paper-main's 4B setting has finished in the ledger (its runs' step times,
    start-ups, checkpoint writes and validation as VeRL logs them), the sweep's dry run costs that setting's
    runs from them and says so; the settings no preflight measured keep the stated model."""
    from pdmctl.backends.registry import flat_config, get_backend
    from pdmctl.ledger import FINISHED, RunLogger, open_ledger

    profile = _staged_h20(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    specs = grid.expand([], grid.load_sweep_file("paper-main"))
    four_b = [preflight_cli.preflight_spec(s, 3) for s in preflight_cli.representatives(specs)
              if s.config["model"]["name"] == "qwen3-4b-base"]  # fmt: skip
    ledger = open_ledger(uri)
    ids = ledger.register(four_b, {s.key: str(tmp_path / "runs" / s.key) for s in four_b})
    for spec in four_b:
        logger = RunLogger(uri, ids[spec.key])
        logger.start(attempt=2, job_id="1_0", executor="slurm")
        for step, seconds in ((1, 400.0), (2, 500.0), (3, 600.0)):
            logger.log_metrics({"timing_s/step": seconds, "train/mask_frac": 0.01}, step)
        logger.log_metrics({"pdmctl/first_step_s": 900.0}, 1)
        logger.log_metrics({"pdmctl/first_step_s": 700.0}, 2)
        logger.log_metrics({"timing_s/save_checkpoint": 60.0, "timing_s/testing": 300.0}, 3)
        logger.finish(FINISHED)
    setting = get_backend("verl").setting(flat_config(four_b[0].config))
    result = _pdmctl("sweep", "--file", "paper-main", "--cluster", str(profile), "--dry-run", "--offline",
                     cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    text = " ".join(result.stdout.split())
    assert "rests on preflight paper-main.preflight's 3 run(s) of this setting" in text, result.stdout[-4000:]
    assert "measured a step of 500 s (400-600) and a start-up of 800 s an attempt" in text, result.stdout[-4000:]
    assert "rests on the stated assumptions" in text, result.stdout[-4000:]  # the 8B and 30B settings
    assert setting.startswith("qwen3-4b-base bf16")
    # the sweep's total names both bases, with how many runs rest on measurements
    total = text[text.index("sweep cost:"):]
    measured = re.search(r"rests on measurements for (\d+) run\(s\) \(their settings' preflight runs", total)
    assert measured and 0 < int(measured.group(1)) < 48 and f"and for {48 - int(measured.group(1))} on the stated assumptions" in total, total


@pytest.mark.parametrize(("error", "kind"), [
    ("OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 95.00 GiB",
     "out of memory"),
    ("RuntimeError: CUDA error: out of memory", "out of memory"),
    ("ModuleNotFoundError: No module named 'transformer_engine'", "a module the job's environment lacks"),
    ("RefusedCheckpoint: pdmctl: /ckpt/global_step_1/actor/model.pt: refused: it names posix.system, which no "
     "checkpoint the trainer writes holds", "a checkpoint its loader refused"),
    ("ValueError: step 3: the loss is nan", None),
])  # fmt: skip
def test_the_kinds_of_failure_a_setting_meets_on_a_gpu_node_are_named(error: str, kind: str | None) -> None:
    """CUDA's and VeRL's guard's words for what stops a setting, as the testbed's are (the SLURM test above)."""
    from pdmctl.preflight.summary import kind_of

    assert kind_of(error) == kind
