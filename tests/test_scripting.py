"""What scripts and habitual command-line users get: `--json` documents alone on stdout, the exit codes each
help lists, NO_COLOR and $COLUMNS, a question before `cancel`, a Ctrl-C that leaves waited-on runs running,
shell completion of names, and a run's log one line per step. Against real local sweeps of the synthetic
backend (the job's path, not the training, is under test)."""

from __future__ import annotations

import json
import os
import pty
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from pdmctl.cli import app
from pdmctl.resources import known
from pdmctl.shell import complete
from pdmctl.steplines import StepLines
from tests.conftest import pdmctl

SYN = ["backend=synthetic", "model=synthetic"]
SLOW = [*SYN, "backend.steps=200", "backend.step_s=1"]  # runs that stay running until cancelled
# how long a test waits for a job to start, a step to be logged or a process to exit: on a loaded 2-core machine
# (CI's lanes side by side) a job's start alone can take minutes; a wait that ends early passes at once
LOADED_S = 300.0
SCRIPT = Path(sys.executable).with_name("pdmctl")


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder whose store holds sweep `two`: pdm_agg and dppo_topk_kl, seeds 0 and 1, every run finished."""
    root = tmp_path_factory.mktemp("finished")
    res = pdmctl("sweep", *SYN, "mask=pdm_agg,dppo_topk_kl", "seed=0,1", "backend.seed_spread=0.01", "--name",
                 "two", "--wait", cwd=root)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    return root


def _document(res) -> dict:
    assert res.returncode == 0, res.stdout + res.stderr
    document = json.loads(res.stdout)  # the whole of stdout is the one document
    assert document["schema"] == 1, document
    return document


def _one_line(res, code: int = 2) -> str:
    assert res.returncode == code, res.stdout + res.stderr
    assert res.stdout == "", res.stdout
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    return lines[0]


def _live(folder: Path, sweep: str) -> list[str]:
    """The keys of the sweep's queued, running and unstarted runs, in the table's order."""
    runs = _document(pdmctl("status", sweep, "--json", cwd=folder))["runs"]
    return [r["key"] for r in runs if r["state"] in ("running", "queued", "not started")]


def _registered(folder: Path, sweep: str) -> bool:
    return pdmctl("status", sweep, "--json", cwd=folder).returncode == 0


def _wait_for(condition, timeout: float = 120.0, poll: float = 0.5) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(poll)


def _env(**extra: str) -> dict[str, str]:
    """The environment pdmctl runs in here: this one's, without a tracking URI or colour settings of its own."""
    unset = ("MLFLOW_TRACKING_URI", "NO_COLOR", "FORCE_COLOR")
    return {**{k: v for k, v in os.environ.items() if k not in unset}, "COLUMNS": "200", **extra}


def _run(args: list[str], cwd: Path, stdin=subprocess.DEVNULL, answer: bytes | None = None):
    """pdmctl with stdin a terminal where `answer` is given (typed at once), else `stdin`."""
    full = _env()
    master = None
    if answer is not None:
        master, stdin = pty.openpty()
    try:
        proc = subprocess.Popen([str(SCRIPT), *args], cwd=cwd, env=full, stdin=stdin, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip
        if master is not None:
            os.close(stdin)
            os.write(master, answer)
        out, err = proc.communicate(timeout=300)
    finally:
        if master is not None:
            os.close(master)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def _on_a_terminal(args: list[str], cwd: Path, env: dict) -> str:
    """pdmctl's stdout and stderr on a terminal (a pseudo-terminal that reports colours), as one text."""
    full = _env(TERM="xterm-256color", **env)
    master, slave = pty.openpty()
    proc = subprocess.Popen([str(SCRIPT), *args], cwd=cwd, env=full, stdin=subprocess.DEVNULL, stdout=slave,
                            stderr=slave)  # fmt: skip
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the terminal closed: pdmctl has exited
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    proc.wait(timeout=60)
    return b"".join(chunks).decode(errors="replace")


def _colours(text: str) -> list[str]:
    """The SGR sequences in `text` that set a colour (foreground or background), not bold, dim or italic."""
    found = []
    for params in re.findall(r"\x1b\[([0-9;]*)m", text):
        codes = [int(c) for c in params.split(";") if c]
        if any(30 <= c <= 49 or 90 <= c <= 107 for c in codes if c not in (39, 49)):
            found.append(params)
    return found


# ---------------------------------------------------------------------------
# --json
# ---------------------------------------------------------------------------


def test_status_json_is_one_document_of_every_run_with_numbers_as_numbers(finished: Path) -> None:
    res = pdmctl("status", "--json", cwd=finished)
    document = _document(res)
    assert document["command"] == "status" and document["sweep"] is None
    assert document["counts"] == {"finished": 4}
    runs = document["runs"]
    assert len(runs) == 4 and {r["state"] for r in runs} == {"finished"}
    for run in runs:
        assert run["sweep"] == "two" and re.fullmatch(r"[0-9a-f]{12}", run["key"]), run
        assert isinstance(run["avg16_pct"], float) and 0 < run["avg16_pct"] < 100, run
        assert run["step"] == 4 and run["attempts"] == 1 and run["job_id"], run
    assert "{" not in res.stderr  # the lines under the table went to stderr, not into the document
    named = _document(pdmctl("status", "two", "--json", cwd=finished))
    assert named["sweep"] == "two" and len(named["runs"]) == 4


def test_status_json_of_a_store_without_runs_is_a_document_with_none(workdir: Path) -> None:
    document = _document(pdmctl("status", "--json", cwd=workdir))
    assert document["runs"] == [] and document["counts"] == {}


def test_status_json_refuses_an_unknown_sweep_and_watch_in_one_line(finished: Path) -> None:
    assert "sweep 'nosuch': no runs" in _one_line(pdmctl("status", "nosuch", "--json", cwd=finished))
    assert "--watch" in _one_line(pdmctl("status", "--json", "--watch", cwd=finished))


def test_report_json_holds_its_tables_and_names_the_files_written(finished: Path, tmp_path: Path) -> None:
    res = pdmctl("report", "two", "--json", "--out", str(tmp_path / "out"), "--panels", "none", cwd=finished)
    document = _document(res)
    assert document["command"] == "report" and document["sweeps"] == ["two"]
    assert document["definition"]["baseline"] == "dppo_topk_kl" and document["baseline_present"] is True
    labels = [c["label"] for c in document["columns"]]
    assert {r["mask"] for r in document["results"]} == {"pdm_agg", "dppo_topk_kl"}
    for row in document["results"]:
        assert row["seeds"] == [0, 1] and set(row["values"]) == set(labels), row
        cell = row["values"][labels[0]]
        assert cell["n"] == 2 and cell["low_pct"] <= cell["mean_pct"] <= cell["high_pct"], cell
    (comparison,) = document["comparisons"]
    assert comparison["mask"] == "pdm_agg" and comparison["baseline"]["mask"] == "dppo_topk_kl"
    assert comparison["paired"] is True and comparison["seeds"] == [0, 1]
    assert set(comparison["values"][labels[0]]) >= {"difference_pp", "low_pp", "high_pp", "p", "p_holm"}
    assert document["excluded"] == []
    assert document["written"] and all(Path(p).is_file() for p in document["written"])
    assert "wrote" in res.stderr


def test_seeds_json_holds_the_look(finished: Path) -> None:
    document = _document(pdmctl("seeds", "two", "--json", cwd=finished))
    assert document["command"] == "seeds" and document["sweep"] == "two" and document["look"] == 1
    assert document["submitted"] is None and document["unfinished"] == 0
    assert {c["mask"] for c in document["comparisons"]} == {"pdm_agg"}
    assert all(c["n"] == 2 and c["baseline"] == "dppo_topk_kl" for c in document["comparisons"])


@pytest.mark.parametrize("command", [["report"], ["seeds"], ["status", "x"]])
def test_json_without_a_store_is_one_line_and_exit_2(workdir: Path, command: list[str]) -> None:
    line = _one_line(pdmctl(*command, "--json", cwd=workdir))
    assert line.startswith("error:"), line


# ---------------------------------------------------------------------------
# exit codes
# ---------------------------------------------------------------------------


def _commands(command=None, path=()):
    command = command or typer.main.get_command(app)
    subcommands = getattr(command, "commands", None)
    if not subcommands:
        yield path
        return
    for name, sub in sorted(subcommands.items()):
        yield from _commands(sub, (*path, name))


def test_every_commands_help_lists_its_exit_codes() -> None:
    runner = CliRunner()
    for path in _commands():
        out = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
        assert out.exit_code == 0, (path, out.output)
        assert "Exit codes:" in out.output, path
        codes = out.output.split("Exit codes:", 1)[1].split("Examples:", 1)[0]
        assert re.search(r"^\s*0\s", codes, re.M), (path, codes)
        assert re.search(r"^\s*2\s.*bad input", codes, re.M), (path, codes)
    status = runner.invoke(app, ["status", "--help"], env={"COLUMNS": "200"}).output
    assert "failed or cancelled runs exit 0 too" in status, status


def test_a_failed_run_exits_sweep_wait_1_and_status_0_as_their_helps_say(workdir: Path) -> None:
    waited = pdmctl("sweep", *SYN, "backend.fail=true", "seed=0", "--name", "bad", "--wait", cwd=workdir)
    assert waited.returncode == 1, waited.stdout + waited.stderr
    res = pdmctl("status", "bad", cwd=workdir)
    assert res.returncode == 0 and "failed" in res.stdout, res.stdout + res.stderr
    assert _document(pdmctl("status", "bad", "--json", cwd=workdir))["counts"] == {"failed": 1}


# ---------------------------------------------------------------------------
# NO_COLOR, COLUMNS
# ---------------------------------------------------------------------------


def test_no_color_leaves_no_colour_on_a_terminal(finished: Path) -> None:
    for args in (["status"], ["status", "nosuch"], ["status", "--help"]):
        coloured = _on_a_terminal(args, finished, {})
        assert _colours(coloured), (args, coloured)  # the terminal gets colours: the check can see them
        plain = _on_a_terminal(args, finished, {"NO_COLOR": "1"})
        assert _colours(plain) == [], (args, plain)
        assert ("finished" in plain) if args == ["status"] else True


def test_piped_output_takes_its_width_from_columns(finished: Path) -> None:
    narrow = pdmctl("status", cwd=finished, env={"COLUMNS": "90"})
    assert narrow.returncode == 0 and "two" in narrow.stdout, narrow.stderr
    assert max(map(len, narrow.stdout.splitlines())) <= 90, narrow.stdout
    default = pdmctl("status", cwd=finished, env={"COLUMNS": ""})  # unset: the piped default, 160
    widest = max(map(len, default.stdout.splitlines()))
    assert 90 < widest <= 160, default.stdout


# ---------------------------------------------------------------------------
# cancel asks first
# ---------------------------------------------------------------------------


def test_cancel_asks_naming_how_many_runs_and_without_a_terminal_cancels_nothing(workdir: Path) -> None:
    started = pdmctl("sweep", *SLOW, "seed=0,1", "--name", "slow", cwd=workdir)
    assert started.returncode == 0, started.stdout + started.stderr
    try:
        keys = _live(workdir, "slow")
        assert len(keys) == 2
        line = _one_line(_run(["cancel", "slow"], workdir))  # stdin is no terminal, no --yes
        assert "would cancel 2 run(s) of sweep slow" in line and "--yes" in line, line
        assert len(_live(workdir, "slow")) == 2
        declined = _run(["cancel", "slow"], workdir, answer=b"n\n")
        assert declined.returncode == 1, declined.stdout + declined.stderr
        assert "cancel 2 run(s) of sweep slow" in declined.stderr and "nothing cancelled" in declined.stderr
        assert declined.stdout == "" and len(_live(workdir, "slow")) == 2
        accepted = _run(["cancel", keys[0]], workdir, answer=b"y\n")  # one run, by its key
        assert accepted.returncode == 0, accepted.stdout + accepted.stderr
        assert f"cancel run {keys[0]} (" in accepted.stderr and "of sweep slow (" in accepted.stderr
        assert "1 run(s) cancelled" in accepted.stdout and _live(workdir, "slow") == [keys[1]]
        assert "no such sweep or run" in _one_line(_run(["cancel", "nosuch", "-y"], workdir))
        yes = _run(["cancel", "slow", "-y"], workdir)  # no terminal, and no question asked
        assert yes.returncode == 0 and "1 run(s) cancelled" in yes.stdout and yes.stderr == "", yes.stderr
        assert _live(workdir, "slow") == []
        again = _run(["cancel", "slow"], workdir)  # nothing left: no question, exit 0
        assert again.returncode == 0 and "nothing to cancel" in again.stdout, again.stdout + again.stderr
    finally:
        pdmctl("cancel", "slow", "--yes", cwd=workdir)


def test_cancel_of_nothing_says_so_in_one_line_and_exits_0(workdir: Path) -> None:
    res = _run(["cancel"], workdir)  # no store, no target: nothing to ask about
    assert res.returncode == 0, res.stdout + res.stderr
    said = res.stdout.strip()
    assert said == "nothing to cancel: no queued, running or unstarted run in any sweep you may change", said
    assert "no such sweep or run" in _one_line(_run(["cancel", "nosuch"], workdir))


# ---------------------------------------------------------------------------
# Ctrl-C while waiting
# ---------------------------------------------------------------------------


def test_ctrl_c_while_waiting_exits_130_and_the_runs_go_on(workdir: Path) -> None:
    proc = subprocess.Popen([str(SCRIPT), "sweep", *SLOW, "seed=0", "--name", "waited", "--wait"], cwd=workdir,
                            env=_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip

    def steps() -> list[int]:  # none before the sweep has registered its run
        res = pdmctl("status", "waited", "--json", cwd=workdir)
        return [r["step"] or 0 for r in json.loads(res.stdout)["runs"]] if res.returncode == 0 else []

    try:
        _wait_for(lambda: steps() != [] and steps()[0] >= 1, timeout=LOADED_S)  # submitted, and training
        os.killpg(proc.pid, signal.SIGINT)  # as a Ctrl-C at the terminal: to the whole foreground group
        _, err = proc.communicate(timeout=LOADED_S)
        assert proc.returncode == 130, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "stopped waiting; the runs go on" in lines[0], err
        assert "pdmctl status waited --watch" in lines[0] and "pdmctl logs KEY --follow" in lines[0], err
        at_interrupt = steps()[0]
        _wait_for(lambda: steps()[0] > at_interrupt, timeout=LOADED_S)  # still training after the Ctrl-C
        assert len(_live(workdir, "waited")) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
        pdmctl("cancel", "waited", "--yes", cwd=workdir)


def test_ctrl_c_while_driving_a_study_exits_130_and_its_trial_goes_on(workdir: Path) -> None:
    space = ["delta=interval(0.02,0.3)", "backend.steps=200", "backend.step_s=1"]
    proc = subprocess.Popen([str(SCRIPT), "tune", *SYN, *space, "--trials", "3", "--name", "study"], cwd=workdir,
                            env=_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        _wait_for(lambda: _registered(workdir, "study") and _live(workdir, "study") != [], timeout=LOADED_S)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=LOADED_S)
        assert proc.returncode == 130, err
        assert "stopped driving study study; its trials in flight go on" in err.strip().splitlines()[-1], err
        assert "pdmctl status study --watch" in err, err
        assert len(_live(workdir, "study")) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
        pdmctl("cancel", "study", "--yes", cwd=workdir)


# ---------------------------------------------------------------------------
# shell completion
# ---------------------------------------------------------------------------


def test_completion_functions_offer_profiles_sweep_files_masks_and_override_values() -> None:
    assert complete.clusters("") == known("clusters") and complete.clusters("loc") == ["local"]
    assert complete.sweep_files("paper") == [n for n in known("sweeps") if n.startswith("paper")] != []
    assert "pdm_agg" in complete.masks("pdm") and all(m.startswith("pdm") for m in complete.masks("pdm"))
    assert complete.overrides(None, "ma") == ["mask="]
    assert complete.overrides(None, "mask=pdm_agg,dppo_topk_") == ["mask=pdm_agg,dppo_topk_kl",
                                                                  "mask=pdm_agg,dppo_topk_tv"]  # fmt: skip
    assert complete.overrides(None, "delta=0.") == []  # a value, not a name: nothing to offer


def _completed(words: str, cwd: Path) -> list[str]:
    """What bash's completion offers for the command line `words` (the last word being typed)."""
    cword = str(len(words.split(" ")) - 1)
    env = _env(_PDMCTL_COMPLETE="complete_bash", COMP_WORDS=words, COMP_CWORD=cword)
    done = subprocess.run([str(SCRIPT)], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    return done.stdout.split()


def test_shell_completion_offers_the_stores_sweeps_and_runs_and_the_shipped_names(finished: Path) -> None:
    keys = sorted(r["key"] for r in _document(pdmctl("status", "--json", cwd=finished))["runs"])
    assert _completed("pdmctl status ", finished) == ["two"]
    assert _completed("pdmctl report t", finished) == ["two"]
    assert _completed("pdmctl logs ", finished) == keys
    assert _completed("pdmctl cancel t", finished) == ["two"]
    assert _completed("pdmctl sweep --file paper", finished) == complete.sweep_files("paper")
    assert _completed("pdmctl sweep mask=grpo", finished) == ["mask=grpo_clip_higher", "mask=grpo_unclipped"]
    assert _completed("pdmctl sweep mask = grpo_c", finished) == ["grpo_clip_higher"]  # bash splits at `=`
    assert _completed("pdmctl report --baseline dppo_topk", finished) == ["dppo_topk_kl", "dppo_topk_tv"]
    unreadable = "pdmctl status --tracking-uri sqlite:////nonexistent/x.db "
    assert _completed(unreadable, finished) == []  # nothing offered, and no traceback


# ---------------------------------------------------------------------------
# logs
# ---------------------------------------------------------------------------


def test_logs_print_one_readable_line_per_step(finished: Path) -> None:
    key = _document(pdmctl("status", "--json", cwd=finished))["runs"][0]["key"]
    res = pdmctl("logs", key, cwd=finished)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    steps = [line for line in lines if line.startswith("pdmctl job: step ")]
    assert [int(re.match(r"pdmctl job: step (\d+): ", s).group(1)) for s in steps] == [0, 1, 2, 3, 4], lines
    for line in steps[1:]:  # held-out sets first, then the reward, four significant digits
        assert re.fullmatch(
            r"pdmctl job: step \d: eval/toy24=[0-9.]+ eval/toy25=[0-9.]+ train/reward=[0-9.]+", line
        ), line
        assert all(
            len(v.rstrip("0").replace(".", "").lstrip("0")) <= 4 for v in re.findall(r"=([0-9.]+)", line)
        )
    assert re.fullmatch(r"pdmctl job: finished: eval/toy24=[0-9.]+ eval/toy25=[0-9.]+", lines[-1]), lines[-1]
    assert "{" not in res.stdout


def test_step_lines_join_a_steps_metrics_logged_in_several_calls(capsys: pytest.CaptureFixture[str]) -> None:
    logged = []

    class Inner:
        def log_metrics(self, metrics, step):
            logged.append((step, dict(metrics)))

    with StepLines(Inner()) as tracker:
        tracker.log_metrics({"train/reward": 0.5, "train/count": 3.0}, 1)
        tracker.log_metrics({"eval/toy24": 0.123456}, 1)
        tracker.log_metrics({"train/reward": float("nan")}, 2)
    assert capsys.readouterr().out.splitlines() == [
        "pdmctl job: step 1: eval/toy24=0.1235 train/reward=0.5 train/count=3",
        "pdmctl job: step 2: train/reward=nan",
    ]
    assert [(step, sorted(metrics)) for step, metrics in logged] == [  # each call passed on as it came
        (1, ["train/count", "train/reward"]), (1, ["eval/toy24"]), (2, ["train/reward"])]  # fmt: skip
