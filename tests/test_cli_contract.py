"""The command line's contract, as a property: whatever a careless or hostile user types, a call
either succeeds or exits 2 with one line on stderr and no traceback, and a refused call leaves the store
and the run directories byte for byte as they were.

Hypothesis draws the inputs: overrides, sweep files, cluster profiles (control characters in the values
that reach the sbatch script included), tracking URIs, tune files, the options of analyze, tune and logs,
and the environment variables pdmctl reads, with values that are empty, huge, non-finite, not UTF-8, of
the wrong type, or paths. `test_contract_in_process` runs
`pdmctl.cli.main` (the console script, click's usage errors included) in this process, many examples;
`test_contract_as_a_user_runs_it` runs the real CLI in a subprocess, a few. Both stay within about a
minute each. Sweeps always run with --dry-run: a call that succeeds may write, but it must not start jobs
here.

Not drawn: a cluster profile's fields of the wrong type (`workdir: 5`), which the
cluster-profile schema covers.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdmctl.grid import expand
from pdmctl.ledger import open_ledger
from tests.conftest import pdmctl, sqlite_uri
from tests.test_bad_input import snapshot

HUGE = "x" * 9000
NASTY_TEXT = st.one_of(
    st.sampled_from(["", " ", "inf", "-inf", "nan", "1e309", "-1", "0", "null", "[]", "{}", "[1,2", "'", '"',
                     "a,b", "range(1,0)", "range(0,10,0)", "interval(0,1)", "glob(*)", "glob(zz*)",
                     "choice()", "/etc/passwd", "../../x", "~", "$HOME", "\udcff\udcfe", "é", "x" * 300, HUGE,
                     "true", "--help-me", "-5", "1" * 400]),  # fmt: skip
    st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12),
)
KEYS = st.sampled_from(["delta", "k", "seed", "seeds", "mask", "model", "precision", "backend", "data",
                        "backend.steps", "backend.lr", "+note", "++k", "delta_low", "mask.eps_low", "+a.b.c",
                        "nosuchkey", ""])  # fmt: skip


@st.composite
def overrides(draw) -> list[str]:
    items = draw(st.lists(st.tuples(KEYS, NASTY_TEXT), max_size=3))
    out = [f"{k}={v}" for k, v in items]
    if draw(st.booleans()):
        out.append(draw(st.sampled_from(["~delta_low", "~nosuchkey", "=5", "k", "seeds=3", "seed=7"])))
    return out


SWEEP_FILES = st.one_of(
    st.sampled_from([b"\xff\xfegrid:\n", b"grid: 7\n", b"grid:\n", b"grid: {}\n", b"settings: []\n", b"",
                     b"grid: {delta: [.inf]}\n", b"grid: {k: [-1]}\n", b"grid: {seed: {a: 1}}\n",
                     b"settings: [{k: 10}, 3]\n", b"name: ../../evil\ngrid: {k: 10}\n", b"- a\n- b\n",
                     b"grid: {mask: /etc/passwd}\n", b"grid: {k: 10}\nextra: 1\n", b"\x00\x01\x02",
                     b"grid: {delta: interval(0,1)}\n", b"grid: {note: " + HUGE.encode() + b"}\n"]),  # fmt: skip
    st.binary(max_size=40),
)
PROFILES = st.one_of(
    st.sampled_from([b"\xff\xfename: x\n", b"[1, 2]\n", b"executor: nope\n", b"max_concurrent: 0\n",
                     b"max_concurrent: many\n", b"name: x\nexecutor: local\n", b"{{{\n", b"",
                     b"executor: slurm\nmem_gb: .nan\n", b"executor: slurm\nmem_gb: .inf\n"]),  # fmt: skip
    # a control character in any value that reaches the sbatch script
    st.builds(lambda field, text: f"executor: slurm\n{field}: {text!r}\n".replace("'", '"').encode(),
              st.sampled_from(["account", "qos", "job_name", "partition", "gpu_type", "workdir", "python"]),
              st.text(alphabet=st.sampled_from("ab\n\r\x0b\x85\t"), min_size=1, max_size=6)),
)
ENV = st.dictionaries(  # environment variables pdmctl reads, set to nasty values
    st.sampled_from(["PDMCTL_CACHE", "PDMCTL_TOY_BASE", "PDMCTL_TUNE_STORAGE", "PDMCTL_TOY_HOLD_AT_STEP",
                     "PDMCTL_VERL_HOLD_AT_STEP", "PDMCTL_VERL_FAIL", "PDMCTL_CONFIG_DIR", "PDMCTL_SWEEP_DIR",
                     "PDMCTL_CLUSTER_DIR", "PDMCTL_REPORT_DIR", "PDMCTL_VERL_PROBE", "SLURM_RESTART_COUNT"]),  # fmt: skip
    st.sampled_from(["", " ", "2", "warmup", "bogus", "relative/dir", "/proc/pdmctl", "/etc/passwd", "sqlite://",
                     "\u00e9"]),  # fmt: skip
    max_size=2,
)
TUNE_FILES = st.sampled_from([b"tune: {space: [delta], trials: 2}\n", b"tune: {space: 5, trials: 2}\n",
                              b"grid: [1]\ntune: {space: {delta: 'interval(0.1,0.2)'}, trials: 2}\n",
                              b"tune: {space: {delta: 'interval(0.1,0.2)'}, trials: many}\n",
                              b"tune: {space: {delta: 'interval(0.1,0.2)'}, trials: 2.5}\n",
                              b"tune: {space: {mask: 'glob(pdm_*)'}, trials: 2}\n", b"tune: 3\n"])  # fmt: skip
VERL_KEYS = ["verl.actor_rollout_ref.rollout.n", "verl.data.train_batch_size", "verl.actor_rollout_ref.rollout."
             "gpu_memory_utilization", "verl.actor_rollout_ref.rollout.top_p", "verl.actor_rollout_ref.actor."
             "ppo_mini_batch_size", "backend.total_training_steps", "backend.total_epochs"]  # fmt: skip
VERL_VALUES = st.one_of(st.sampled_from(["0", "-3", "1e23", "1" * 25, "nan", "inf", "-5", "1.5", "0.5", "8", "abc"]),
                        st.integers(-(2**70), 2**70).map(str), st.floats(allow_nan=True).map(repr))  # fmt: skip
DATA_FILES = st.one_of(
    st.sampled_from([b"", b"7", b"[1, 2]", b"\xff\xfe{}", b"[" * 50_000, b"[" * 50_000 + b"]" * 50_000,
                     b'{"problem": "a", "answer": 1}\n{"problem": ', b'{"data": 5}', b"PAR1\x00\x00PAR1",
                     b'{"problem": "\xc3\x28", "answer": 1}\n', b'[{"prompt": [], "reward_model": {}}]',
                     b'{"problem": "What is 1+1?", "answer": 2}\n']),  # fmt: skip
    st.binary(max_size=40),
)
URIS = st.one_of(
    st.sampled_from(["", " ", "foo://bar", "sqlite://", "sqlite:///", "sqlite:///nonexistent/dir/x.db",
                     "http://", "file:///tmp/x", "mysql://u@127.0.0.1:9/x", "sqlite:///" + "d" * 300 + ".db",
                     "postgresql+psycopg2://u:p@127.0.0.1:9/db", "http://127.0.0.1:9/"]),  # fmt: skip
    NASTY_TEXT,
)


@st.composite
def calls(draw) -> tuple[list[str], dict[str, bytes], dict[str, str]]:
    """A command line, the files (name -> bytes) it refers to, and the environment it runs in."""
    files: dict[str, bytes] = {}
    kind = draw(st.sampled_from(["sweep", "sweep-file", "cluster", "uri", "status", "report", "resume",
                                 "cancel", "logs", "analyze", "tune", "verl", "data"]))  # fmt: skip
    base = ["backend=synthetic", "model=synthetic"]
    if kind == "sweep":
        args = ["sweep", *draw(overrides()), *base, "--dry-run"]
        if draw(st.booleans()):
            args += [draw(st.sampled_from(["--max-runs", "--name"])), draw(NASTY_TEXT)]
    elif kind == "verl":  # the engine's own sizes, counts and fractions, bounded
        key = draw(st.sampled_from(VERL_KEYS))
        args = ["sweep", "backend=verl", "model=qwen3-4b-base", "backend.nnodes=1", f"{key}={draw(VERL_VALUES)}",
                "--dry-run"]  # fmt: skip
    elif kind == "data":  # damaged local sources of data prepare: truncated, not UTF-8, nested, of the wrong shape
        name = draw(st.sampled_from(["d.jsonl", "d.json", "d.parquet"]))
        files[name] = draw(DATA_FILES)
        args = ["data", "prepare", "prepared", "--train", name, "--aime24", name, "--aime25", name]
    elif kind == "sweep-file":
        files["s.yaml"] = draw(SWEEP_FILES)
        args = ["sweep", "--file", "s.yaml", *base, "--dry-run"]
    elif kind == "cluster":
        files["c.yaml"] = draw(PROFILES)
        args = [draw(st.sampled_from(["sweep", "status", "resume"])), "--cluster", "c.yaml"]
        args += [*base, "--dry-run"] if args[0] == "sweep" else []
    elif kind == "uri":
        command = draw(st.sampled_from([["sweep", *base, "--dry-run"], ["status"], ["cancel"], ["report"],
                                        ["logs", "abc"], ["resume"]]))  # fmt: skip
        args = [*command, "--tracking-uri", draw(URIS)]
    elif kind == "status":
        args = ["status", draw(NASTY_TEXT), "--watch", "--interval", draw(NASTY_TEXT)]
    elif kind == "report":
        option = draw(st.sampled_from(["--at", "--out", "--baseline", "--interval", "--definition"]))
        args = ["report", "kept", option, draw(NASTY_TEXT)]
    elif kind == "resume":
        args = ["resume", draw(NASTY_TEXT), "--max-attempts", draw(NASTY_TEXT), "--dry-run"]
    elif kind == "cancel":
        args = ["cancel", draw(NASTY_TEXT).lstrip("-") or "zz"]  # a run or sweep that does not exist
        if args[1] == "kept":
            args[1] = "zz"
    elif kind == "logs":
        args = ["logs", draw(NASTY_TEXT), "--attempt", draw(NASTY_TEXT), *draw(st.sampled_from([[], ["--follow"]]))]
    elif kind == "analyze":  # never a valid --seeds: every call is refused before any analysis
        args = ["analyze", "--seeds", draw(st.sampled_from(["0", "-1", "abc", "nan", "", "100001", "9" * 20])),
                *draw(overrides())]  # fmt: skip
        option = draw(st.sampled_from([None, "--first-seed", "--json", "--csv", "--figures", "--jobs", "--threads"]))
        if option is not None:
            args += [option, draw(NASTY_TEXT)]
    else:
        args = ["tune", *draw(overrides()), *base, "--trials", draw(NASTY_TEXT), "--dry-run"]
        if draw(st.booleans()):
            args += ["--storage", draw(URIS)]
        if draw(st.booleans()):
            files["t.yaml"] = draw(TUNE_FILES)
            args += ["--file", "t.yaml"]
    return args, files, draw(ENV)


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store with one run in it, closed (no -wal/-shm files): copied fresh for every example."""
    root = tmp_path_factory.mktemp("template")
    ledger = open_ledger(sqlite_uri(root))
    specs = expand(["seed=9", "backend=synthetic", "model=synthetic"], sweep="kept")
    ledger.register(specs, {s.key: str(root / "pdmctl-runs" / "kept" / s.key) for s in specs})
    ledger.engine.dispose()
    return root


def _fresh(template: Path, files: dict[str, bytes], factory: pytest.TempPathFactory) -> Path:
    work = factory.mktemp("call")
    shutil.copy(template / "mlflow.db", work / "mlflow.db")
    for name, data in files.items():
        (work / name).write_bytes(data)
    return work


def _check(returncode: int, stderr: str, before: dict[str, str], work: Path, args: list[str]) -> None:
    shown = f"pdmctl {' '.join(map(repr, args))[:500]}\nrc={returncode}\nstderr:\n{stderr[-2000:]}"
    assert "Traceback" not in stderr, shown
    assert returncode in (0, 2), shown
    if returncode == 2:
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), shown
        after = snapshot(work)
        assert after == before, shown + f"\nchanged: {sorted(set(after.items()) ^ set(before.items()))[:6]}"


def _main(args: list[str], work: Path, env: dict[str, str]) -> tuple[int, str]:
    """The console script's `main` in this process, in `env` (as a user's shell: no test running): its
    exit code and its stderr."""
    from pdmctl.cli import main

    saved_env, saved_cwd, saved_argv = dict(os.environ), Path.cwd(), sys.argv
    err, out = io.StringIO(), io.StringIO()
    os.environ.update(env)
    os.environ.pop("PYTEST_CURRENT_TEST", None)
    os.chdir(work)
    sys.argv = ["pdmctl", *args]
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                main()
                code = 0
            except SystemExit as ended:
                code = ended.code if isinstance(ended.code, int) else (0 if ended.code is None else 1)
    finally:
        sys.argv = saved_argv
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    return code, err.getvalue()


@settings(max_examples=30, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
@given(call=calls())
def test_contract_in_process(call, template: Path, tmp_path_factory: pytest.TempPathFactory,
                             monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("PDMCTL_STORE_BUSY_S", "5")
    args, files, env = call
    args = [a.encode(errors="surrogateescape").decode(errors="replace") for a in args]  # in-process: str
    work = _fresh(template, files, tmp_path_factory)
    before = snapshot(work)
    code, stderr = _main(args, work, env)
    _check(code, stderr, before, work, args)
    shutil.rmtree(work, ignore_errors=True)


@settings(max_examples=6, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
@given(call=calls())
def test_contract_as_a_user_runs_it(call, template: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    args, files, env = call  # a lone surrogate reaches the process as the raw byte, as a shell would pass it
    work = _fresh(template, files, tmp_path_factory)
    before = snapshot(work)
    result = pdmctl(*args, cwd=work, timeout=120, env={**env, "PDMCTL_STORE_BUSY_S": "5"})
    _check(result.returncode, result.stderr, before, work, args)
    shutil.rmtree(work, ignore_errors=True)
