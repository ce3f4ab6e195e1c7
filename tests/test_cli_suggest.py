"""The command line suggests: --version, shell completion, examples in every help, and a mistyped flag,
config option, key, sweep file, cluster profile or sweep name answered with the name meant (exit 2)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from pdmctl import __version__
from pdmctl.cli import app
from pdmctl.grid import expand
from pdmctl.ledger import open_ledger
from tests.conftest import pdmctl, sqlite_uri

SYN = ["backend=synthetic", "model=synthetic"]


def _commands(command=None, path=()):
    """Every leaf command of the CLI as (its words, its click command)."""
    command = command or typer.main.get_command(app)
    subcommands = getattr(command, "commands", None)
    if not subcommands:
        yield path, command
        return
    for name, sub in sorted(subcommands.items()):
        yield from _commands(sub, (*path, name))


@pytest.fixture
def store(workdir: Path) -> Path:
    """A store holding one sweep, `paper-main`, registered (nothing runs)."""
    ledger = open_ledger(sqlite_uri(workdir))
    specs = expand(["seed=9", *SYN], sweep="paper-main")
    ledger.register(specs, {s.key: str(workdir / "pdmctl-runs" / "paper-main" / s.key) for s in specs})
    ledger.engine.dispose()
    return workdir


def test_version_prints_the_package_version_and_exits_0(workdir: Path) -> None:
    res = pdmctl("--version", cwd=workdir)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"pdmctl {__version__}"), res.stdout
    if (Path(__file__).resolve().parents[1] / ".git").exists():  # a checkout: the commit too
        assert re.search(r"\(commit [0-9a-f]{12}", res.stdout), res.stdout


def test_shell_completion_completes_command_names(workdir: Path) -> None:
    script = Path(sys.executable).with_name("pdmctl")
    env = {**os.environ, "_PDMCTL_COMPLETE": "complete_bash", "COMP_WORDS": "pdmctl swe", "COMP_CWORD": "1"}
    done = subprocess.run([str(script)], cwd=workdir, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["sweep"], done.stdout
    shown = subprocess.run([str(script), "--show-completion", "bash"], cwd=workdir, capture_output=True, text=True,
                           timeout=120)  # fmt: skip
    assert shown.returncode == 0 and "_PDMCTL_COMPLETE" in shown.stdout, shown.stdout + shown.stderr


def test_every_command_help_ends_with_examples_of_itself() -> None:
    runner = CliRunner()
    commands = list(_commands())
    assert len(commands) >= 12, [p for p, _ in commands]
    for path, _ in commands:
        out = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
        assert out.exit_code == 0, (path, out.output)
        assert "Examples:" in out.output, path
        examples = out.output.split("Examples:", 1)[1]
        assert f"pdmctl {' '.join(path)}" in examples, (path, examples)


def test_each_short_flag_means_one_long_flag_across_commands() -> None:
    meaning: dict[str, list[set[str]]] = {}  # a short flag -> the long names of each option it is short for
    for _, command in _commands():
        for param in command.params:
            longs = {o for o in (*param.opts, *param.secondary_opts) if o.startswith("--")}
            for short in (o for o in param.opts if o.startswith("-") and not o.startswith("--")):
                meaning.setdefault(short, []).append(longs)
    assert set.intersection(*meaning["-f"]) == {"--file"}, meaning["-f"]
    assert [s for s, names in meaning.items() if not set.intersection(*names)] == []  # one shared long name
    logs = dict(_commands())[("logs",)]
    assert next(p for p in logs.params if p.name == "follow").opts == ["--follow", "-F"]


def test_server_help_keeps_the_extra_in_square_brackets(workdir: Path) -> None:
    res = pdmctl("server", "--help", cwd=workdir)
    assert res.returncode == 0, res.stderr
    assert "pip install 'pdmctl[server]'" in res.stdout, res.stdout


@pytest.mark.parametrize(
    ("command", "flag", "needle"),
    [
        ("sweep", "--wiat", "no such option --wiat (did you mean --wait?)"),
        ("sweep", "--dryrun", "no such option --dryrun (did you mean --dry-run?)"),
        ("sweep", "--seedz=3", "no such option --seedz (did you mean the override seed=...?)"),
        ("doctor", "--dryrun", "no such option --dryrun"),
        ("tune", "--dryrun", "no such option --dryrun (did you mean --dry-run?)"),
        ("analyze", "--seedz", "no such option --seedz (did you mean --seeds?)"),
    ],
)
def test_mistyped_flag_is_named_as_a_flag_with_the_closest_one(workdir: Path, command: str, flag: str,
                                                               needle: str) -> None:  # fmt: skip
    res = pdmctl(command, "delta=0.05", flag, cwd=workdir)
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"pdmctl {command}: {needle}" in res.stderr, res.stderr
    assert "malformed" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (workdir / "mlflow.db").exists()


def test_an_option_value_that_starts_with_a_dash_is_not_a_flag(workdir: Path) -> None:
    res = pdmctl("sweep", *SYN, "--name", "-x", "--dry-run", cwd=workdir)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "sweep name: '-x' must be letters" in res.stderr, res.stderr  # the name was read as --name's value


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["mask=pdm_ag"], "mask: unknown option 'pdm_ag' (did you mean 'pdm_agg'?); choose from"),
        (["detla=0.05"], "detla: unknown key (did you mean 'delta'?)"),
        (["backend.stpes=3"], "backend.stpes: unknown key (did you mean 'backend.steps'?)"),
        (["mak=pdm_agg"], "mak: unknown key (did you mean 'mask'?)"),
        (["--file", "paper-mian"], "sweep file: 'paper-mian' not found (did you mean 'paper-main'?) (known:"),
        (["--cluster", "locl"], "cluster profile: 'locl' not found (did you mean 'local'?) (known:"),
        (["seeds=3", "seed=1"], "seed: given twice ('seeds=3' and 'seed=1'); give its values once, e.g. seed=0,1,2"),
        (["seeds=2", "seed=5,7"], "e.g. seed=0,1,5,7"),
    ],
)
def test_mistyped_names_get_the_name_meant(workdir: Path, args: list[str], needle: str) -> None:
    res = pdmctl("sweep", *args, "--dry-run", cwd=workdir)
    assert res.returncode == 2, res.stdout + res.stderr
    assert needle in res.stderr, res.stderr


def test_an_unknown_key_with_no_close_match_says_how_to_add_it(workdir: Path) -> None:
    res = pdmctl("sweep", "zzzqqq=1", "--dry-run", cwd=workdir)
    assert res.returncode == 2
    assert "zzzqqq: unknown key (no such field in the run config; '+zzzqqq=...' adds one)" in res.stderr


@pytest.mark.parametrize("command", ["resume", "cancel", "status"])
def test_an_unknown_sweep_exits_2_listing_the_known_ones(store: Path, command: str) -> None:
    res = pdmctl(command, "paper-mian", cwd=store)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "(did you mean 'paper-main'?)" in res.stderr, res.stderr
    assert "(known sweeps: paper-main)" in res.stderr, res.stderr
    assert res.stdout == "", res.stdout  # nothing resubmitted, cancelled or listed


@pytest.mark.parametrize("command", ["resume", "cancel", "status"])
def test_a_sweep_asked_of_a_store_not_made_yet_exits_2(workdir: Path, command: str) -> None:
    res = pdmctl(command, "nosuch", cwd=workdir)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "'nosuch': no " in res.stderr and "(no store at" in res.stderr, res.stderr
    assert not (workdir / "mlflow.db").exists()


def test_a_known_sweep_still_resumes_and_cancels(store: Path) -> None:
    resumed = pdmctl("resume", "paper-main", "--dry-run", cwd=store)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "1 run(s) to resume" in resumed.stdout
    cancelled = pdmctl("cancel", "paper-main", "--yes", cwd=store)
    assert cancelled.returncode == 0 and "run(s) cancelled" in cancelled.stdout, cancelled.stderr


def test_every_commands_help_names_value_types_as_click_does_and_none_beside_a_flag() -> None:
    """No Python annotation in any help (`<bool>` beside each flag, `<list[str]>`): a flag shows no type, a
    value TEXT, INTEGER, FLOAT or PATH, a repeatable one with `...`."""
    runner = CliRunner()
    for words in (("sweep",), ("status",), ("report",), ("server", "user", "add"), ("tune",), ("seeds",)):
        result = runner.invoke(app, [*words, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, (words, result.output)
        assert not re.search(r"<(str|int|float|bool|path|list\[\w+\])>", result.output), (words, result.output)
        for line in result.output.splitlines():
            if "--help " in line:
                assert "TEXT" not in line and "BOOL" not in line.upper().replace("BOOLEAN", ""), (words, line)
