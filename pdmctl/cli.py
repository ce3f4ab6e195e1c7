"""pdmctl: the command line. Parses, prints, nothing else (the logic is in pdmctl.orchestrate)."""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.live import Live
from rich.table import Table

from pdmctl import usage
from pdmctl.grid import MAX_RUNS
from pdmctl.shell import complete
from pdmctl.shell.status import STATE_STYLE
from pdmctl.shell.status import status_rows as _status_rows  # noqa: F401 (the engine's tests read the rows here)
from pdmctl.shell.status import status_table as _status_table
from pdmctl.shell.waiting import wait as _wait
from pdmctl.terminal import console, fail, tail
from pdmctl.terminal import guard as _guard
from pdmctl.usage import OverridesCommand

app = typer.Typer(
    name="pdmctl",
    help="Sweeps, jobs, tracking and reports for trust-region-mask RL experiments (PDM vs DPPO vs GRPO).",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    if value:
        from pdmctl.usage import version_line

        print(version_line())
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True,
                           help="Print pdmctl's version (and its commit, where known) and exit."),
    ] = False,
) -> None:
    pass


ClusterOpt = Annotated[
    str, typer.Option("--cluster", "-c", help="Cluster profile under clusters/ (or a path).",
                      autocompletion=complete.clusters)
]
TrackingOpt = Annotated[
    str | None,
    typer.Option(
        "--tracking-uri", help="MLflow store (default: $MLFLOW_TRACKING_URI, the profile's, ./mlflow.db)."
    ),
]


# ---------------------------------------------------------------------------
# sweep
# ---------------------------------------------------------------------------


@app.command(cls=OverridesCommand, context_settings={"ignore_unknown_options": True})
def sweep(
    overrides: Annotated[
        list[str] | None, typer.Argument(help="Grid overrides: delta=0.05,0.15 k=10,20 seeds=3",
                                         autocompletion=complete.overrides)
    ] = None,
    file: Annotated[
        str | None, typer.Option("--file", "-f", help="A sweep file (sweeps/NAME.yaml or NAME).",
                                 autocompletion=complete.sweep_files)
    ] = None,
    name: Annotated[
        str | None, typer.Option("--name", "-n", help="Sweep name (default: the file's, or 'default').")
    ] = None,
    cluster: ClusterOpt = "local",
    tracking_uri: TrackingOpt = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the grid and what would launch; write nothing.")
    ] = False,
    wait: Annotated[
        bool, typer.Option("--wait", "-w", help="Block with a progress bar until every run ends.")
    ] = False,
    max_runs: Annotated[
        int, typer.Option("--max-runs", help="Refuse a grid of more runs than this (a guard against typos).")
    ] = MAX_RUNS,
    order: Annotated[
        str | None, typer.Option("--order", help="The array's order: answers (default: replicate 0 of every "
                                 "setting, then replicate 1, ...; inside one, setting by setting, the cheapest "
                                 "first), seed (the settings take turns arm by arm) or setting (one run of "
                                 "each setting, then grid order); a sweep file's order: otherwise.")
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="With --dry-run: the plan as JSON (every run in array order, its "
                           "expected cost with its range and upper bound; per setting and for the sweep; "
                           "docs/PLAN_JSON.md), nothing else on stdout.")
    ] = False,
    offline: Annotated[
        bool, typer.Option("--offline", help="With --dry-run: plan without asking SLURM (as where no sinfo is "
                           "found): the profile's partition and nodes taken as stated.")
    ] = False,
    calibrated_on: Annotated[
        str | None, typer.Option("--calibrated-on", metavar="SWEEP", autocompletion=complete.sweeps, help="With --dry-run: estimate the testbed's "
                                 "runs at the rate SWEEP's finished runs of the same setting measured.")
    ] = None,
    days: Annotated[
        float | None, typer.Option("--days", help="With --dry-run: also propose the largest part of the grid "
                                   "(its cheapest settings, seeds an arm) expected to end within N days on the "
                                   "profile's slots, and what it can resolve; the grid is not changed.")
    ] = None,
    budget: Annotated[
        float | None, typer.Option("--budget", metavar="HOURS", help="With --dry-run: the same within HOURS "
                                   "GPU-hours (CPU-hours on the testbed).")
    ] = None,
) -> None:
    """Expand a grid into runs, register them in MLflow and submit the ones not yet served."""
    from pdmctl import grid, orchestrate
    from pdmctl.budget import costing

    with _guard():
        if as_json and not dry_run:
            fail("--json: prints the plan of a dry run; give --dry-run too")
        if offline and not dry_run:
            fail("--offline: plans without SLURM; give --dry-run too")
        if calibrated_on is not None and not dry_run:
            fail("--calibrated-on: calibrates the estimates of a dry run; give --dry-run too")
        for flag, value in (("--days", days), ("--budget", budget)):
            if value is not None and as_json:
                fail(f"{flag}: its proposal is part of the text plan, not of --json")
            if value is not None and (not dry_run or not math.isfinite(value) or value <= 0):
                fail(f"{flag}: proposes a design in a dry run: give --dry-run and a finite number > 0, got {value}")
        sweep_file = grid.load_sweep_file(file) if file else None
        chosen = grid.check_order(order, "--order") if order is not None else (sweep_file and sweep_file.order) or "answers"
        priority = sweep_file.priority if sweep_file else ()
        ctx = orchestrate.make_context(cluster, tracking_uri)
        if not dry_run:  # before a grid whose checks may take seconds; a plan says it beside the plan
            orchestrate.check_placeholders(ctx.profile)
        specs = grid.expand(overrides or [], sweep_file, name, max_runs=max_runs)
        specs = orchestrate.pin_data(specs, ctx)  # the data's digest into each run's config (and key)
        if dry_run:
            from pdmctl.testhooks import check_environment

            check_environment()  # what the submission would refuse
            executor, unchecked = costing.plan_profile(ctx, offline)
            orchestrate.check_runs(specs, ctx, executor, storage=unchecked is None)
            unread = orchestrate.ledger_unreachable(ctx)
            calibration = _calibration(ctx, calibrated_on) if calibrated_on is not None else None
            if unread is None:  # VeRL settings the sweep's preflight measured: their cost from its steps
                calibration = {**costing.preflight_calibration(ctx, specs[0].sweep), **(calibration or {})} or None
            seconds = orchestrate.expected_seconds(specs, ctx, executor, calibration) if chosen == "answers" else None
            plan = orchestrate.plan(specs, ctx, read_only=True, read_ledger=unread is None, order=chosen,
                                    run_seconds=seconds, priority=priority)  # fmt: skip
            if as_json:
                import json

                from pdmctl.budget.costing import plan_json

                sys.stdout.write(json.dumps(plan_json(plan, ctx, executor, chosen, unread, calibration), indent=1)
                                 + "\n")
                return
            if unchecked:
                console.print(unchecked, highlight=False, markup=False, soft_wrap=True)
            _print_plan(plan, ctx, executor, unread)
            for line in [orchestrate.describe_order(plan.specs, chosen), *costing.first_answers_lines(
                    plan, ctx, executor, calibration)]:  # fmt: skip
                console.print(line, highlight=False, markup=False, soft_wrap=True)
            for line in orchestrate.describe_runs(plan.to_submit, ctx, executor, calibration):
                console.print(line, highlight=False, markup=False, soft_wrap=True)
            from pdmctl.budget.costing import testbed_line

            testbed = testbed_line(plan.to_submit, ctx, executor, calibration)
            if testbed is not None:
                console.print(testbed, highlight=False, markup=False, soft_wrap=True)
            if days is not None or budget is not None:
                from pdmctl.budget.design import design_lines

                for line in design_lines(plan, ctx, executor, days, budget, calibration):
                    console.print(line, highlight=False, markup=False, soft_wrap=True)
            return
        plan, job_ids = orchestrate.sweep(specs, ctx, order=chosen, priority=priority)
    counts = plan.counts()
    sweep_name = specs[0].sweep
    console.print(
        f"sweep [bold]{sweep_name}[/]: {len(specs)} run(s); submitted [bold]{len(job_ids)}[/]"
        + "".join(
            f", {n} {state}" for state, n in sorted(counts.items()) if state not in ("new", "not started")
        )
        + f"  (tracking: {_redacted(ctx.tracking_uri)})",
        highlight=False,
    )
    if any(s in orchestrate.RESUMABLE - {orchestrate.RunState.UNSUBMITTED} for s in counts):
        console.print("some runs ended badly: [bold]pdmctl resume[/] brings them back from their checkpoints")
    if wait:
        with _guard():  # a tracking server that stops answering meanwhile: one line
            _wait(ctx, sweep_name, cluster=cluster)
    else:
        console.print(f"follow with [bold]pdmctl status {sweep_name}[/] (or --watch)", highlight=False)


def _calibration(ctx, sweep_name: str):
    """The testbed's rates measured by `sweep_name`'s finished runs (pdmctl.budget.costing.calibrate); one line and exit 2
    where there are none."""
    from pdmctl.budget.costing import calibrate
    from pdmctl.ledger import ledger_exists, open_ledger

    records = open_ledger(ctx.tracking_uri).runs(sweep_name) if ledger_exists(ctx.tracking_uri) else []
    if not records:
        fail(f"--calibrated-on: no sweep {sweep_name!r} in {_redacted(ctx.tracking_uri)}")
    found = calibrate(records, sweep_name)
    if not found:
        fail(f"--calibrated-on: sweep {sweep_name!r} has no finished testbed run to measure")
    return found


def _redacted(uri: str) -> str:
    """A URI as printed: a password in it (postgresql://user:PASSWORD@host) as ***."""
    from pdmctl.ledger import _redact

    return _redact(uri)


def _print_plan(plan, ctx, executor, unread: str | None = None) -> None:
    from pdmctl.backends.registry import run_nodes

    table = Table(title=f"sweep {plan.specs[0].sweep if plan.specs else ''}: {len(plan.specs)} run(s)")
    for col in ("#", "key", "config", "state", "action"):
        table.add_column(col)
    submit = {s.key for s in plan.to_submit}
    for i, s in enumerate(plan.specs, 1):
        state = plan.states[s.key]
        table.add_row(str(i), s.key, s.summary, f"[{STATE_STYLE.get(state, '')}]{state}[/]",
                      "submit" if s.key in submit else "skip")  # fmt: skip
    console.print(table)
    counts = plan.counts()
    console.print(
        "counts: "
        + ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
        + f"; would submit {len(submit)}: {executor.describe([None] * len(submit), [run_nodes(s) for s in plan.to_submit])}",
        highlight=False,
    )
    console.print(f"tracking: {_redacted(ctx.tracking_uri)}  (dry run: nothing written)", highlight=False)
    if os.environ.get("PDMCTL_VERL_PROBE") == "1" and any(s.backend == "verl" for s in plan.specs):
        console.print("PDMCTL_VERL_PROBE=1 is set: each VeRL job would run the probe, not the trainer (unset "
                      "PDMCTL_VERL_PROBE for a real run)", highlight=False, markup=False, soft_wrap=True)  # fmt: skip
    if unread is not None:  # a dry run needs no server: it shows the grid as new, and says so
        console.print(f"did not read the ledger: {unread}; every run is shown as new (a sweep refuses to "
                      "submit until the server answers)", highlight=False, markup=False, soft_wrap=True)


# ---------------------------------------------------------------------------
# status / resume / cancel / logs (their tables and prompts: pdmctl.shell)
# ---------------------------------------------------------------------------


MIN_INTERVAL_S = 0.5  # --watch polls the store and the executor: not in a busy loop


@app.command()
def status(
    sweep_name: Annotated[
        str | None, typer.Argument(metavar="[SWEEP]", help="Sweep name (default: all).",
                                   autocompletion=complete.sweeps)
    ] = None,
    cluster: ClusterOpt = "local",
    tracking_uri: TrackingOpt = None,
    watch: Annotated[
        bool, typer.Option("--watch", help="Refresh every few seconds until every run ends.")
    ] = False,
    interval: Annotated[float, typer.Option(help="Seconds between refreshes with --watch.")] = 3.0,
    as_json: Annotated[
        bool, typer.Option("--json", help="The runs as one JSON document on stdout (docs/JSON.md); the lines "
                           "under the table go to stderr.")
    ] = False,
) -> None:
    """Where each run stands: state, step, latest avg@16, attempts, job id."""
    from pdmctl import orchestrate
    from pdmctl.shell.status import print_status

    with _guard():
        if not (math.isfinite(interval) and interval >= MIN_INTERVAL_S):
            fail(f"--interval: must be a number of seconds >= {MIN_INTERVAL_S:g}, got {interval:g}")
        if as_json and watch:
            fail("--json: prints the runs once; --watch refreshes a table: give one")
        ctx = orchestrate.make_context(cluster, tracking_uri)
        views = orchestrate.status(ctx, sweep_name)
        if sweep_name and not views:
            usage.check_sweep(ctx, sweep_name)
        title = f"pdmctl status — {sweep_name or 'all sweeps'}"
        if not watch:
            print_status(views, ctx, title, as_json, sweep_name)
            return
        with Live(_status_table(views, title), console=console, refresh_per_second=2) as live:
            while any(v.state in orchestrate.ACTIVE for v in views):
                time.sleep(interval)
                views = orchestrate.status(ctx, sweep_name)
                live.update(_status_table(views, title))


@app.command()
def resume(
    sweep_name: Annotated[
        str | None, typer.Argument(metavar="[SWEEP]", help="Sweep name (default: all).",
                                   autocompletion=complete.sweeps)
    ] = None,
    cluster: ClusterOpt = "local",
    tracking_uri: TrackingOpt = None,
    max_attempts: Annotated[
        int | None, typer.Option(help="Leave runs that already had this many attempts.")
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List what would be resubmitted.")] = False,
    wait: Annotated[bool, typer.Option("--wait", "-w", help="Block until every run ends.")] = False,
) -> None:
    """Resubmit the runs that failed, were cancelled, timed out, were lost or never started; each continues
    from its latest checkpoint in the same MLflow run."""
    from pdmctl import orchestrate

    with _guard():
        if max_attempts is not None and max_attempts < 1:
            fail(f"--max-attempts: must be >= 1, got {max_attempts}")
        ctx = orchestrate.make_context(cluster, tracking_uri)
        usage.check_sweep(ctx, sweep_name, change=True)  # and not another login's (a server's)
        # metrics runs kept on their disks during a tracking-server outage go first, after the checks
        chosen, job_ids = orchestrate.resume(ctx, sweep_name, max_attempts=max_attempts, dry_run=dry_run,
                                             say=lambda line: console.print(line, highlight=False))  # fmt: skip
    for v in chosen:
        console.print(f"{'would resume' if dry_run else 'resumed'} {v.key} ({v.summary}) — was {v.state}, "
                      f"attempt {(v.record.attempt if v.record else 0) + 1}", highlight=False)  # fmt: skip
    console.print(f"{len(chosen)} run(s) {'to resume' if dry_run else 'resubmitted'}", highlight=False)
    if wait and job_ids:
        _wait(ctx, sweep_name, cluster=cluster)


@app.command()
def cancel(
    target: Annotated[
        str | None, typer.Argument(metavar="[SWEEP|RUN]", help="A sweep, or a run key / run id.",
                                   autocompletion=complete.sweeps_and_runs)
    ] = None,
    cluster: ClusterOpt = "local",
    tracking_uri: TrackingOpt = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Cancel without asking first.")] = False,
) -> None:
    """Cancel the queued and running runs of a sweep or one run (neither: of each sweep you may change). Asks
    first, naming how many runs, unless --yes."""
    from pdmctl import orchestrate
    from pdmctl.shell.confirm import cancellable, confirm_cancel, nothing_line

    with _guard():
        ctx = orchestrate.make_context(cluster, tracking_uri)
        usage.check_target(ctx, target)
        live = cancellable(ctx, target)
        if not live:
            console.print(nothing_line(target), highlight=False, markup=False, soft_wrap=True)
            return
        confirm_cancel(live, target, yes)
        cancelled = orchestrate.cancel(ctx, target)
    for v in cancelled:
        console.print(f"cancelled {v.key} ({v.summary})", highlight=False)
    console.print(f"{len(cancelled)} run(s) cancelled", highlight=False)


@app.command()
def logs(
    run: Annotated[str, typer.Argument(metavar="RUN", help="Run key (or a prefix) or MLflow run id.",
                                       autocompletion=complete.runs)],
    follow: Annotated[bool, typer.Option("--follow", "-F", help="Keep printing as the log grows.")] = False,
    attempt: Annotated[int | None, typer.Option(help="Which attempt (default: the latest).")] = None,
    cluster: ClusterOpt = "local",
    tracking_uri: TrackingOpt = None,
) -> None:
    """Print a run's job output."""
    from pdmctl import orchestrate

    with _guard():
        ctx = orchestrate.make_context(cluster, tracking_uri)
        view = orchestrate.find_run(orchestrate.status(ctx, None), run)
        assert view.record is not None
        path = orchestrate.log_file(view.record, ctx, attempt)
        if not path.exists() and not follow:
            fail(f"run {view.key}: no log yet at {path} (state: {view.state})")
        ended = tail(path, follow, lambda: orchestrate.find_run(orchestrate.status(ctx, None), run).state
                      in orchestrate.ACTIVE)  # fmt: skip
        if ended:
            fail(f"run {view.key}: {ended}", code=1)


@app.command(cls=OverridesCommand, context_settings={"ignore_unknown_options": True})
def doctor(
    overrides: Annotated[
        list[str] | None, typer.Argument(help="Grid overrides of the sweep whose paths and checkpoints to check.",
                                         autocompletion=complete.overrides)
    ] = None,
    file: Annotated[str | None, typer.Option("--file", "-f", help="A sweep file: its runs' paths and checkpoints.",
                                             autocompletion=complete.sweep_files)] = None,
    cluster: ClusterOpt = "local",
    tracking_uri: TrackingOpt = None,
    on_node: Annotated[
        bool, typer.Option("--on-node", help="The node's checks (GPUs, driver, imports): run inside a job.")
    ] = False,
    job: Annotated[
        bool, typer.Option("--job", help="After the login node's checks, run the nodes' in a job of the profile's "
                           "nodes (srun): each node's, then across them (shared files, all-reduce, Ray).")
    ] = False,
    skip: Annotated[list[str] | None, typer.Option("--skip", help="A check to leave out (repeatable).")] = None,
) -> None:
    """Is the cluster ready: one line per check, exit 2 at the first that fails. On the login node: the profile
    (no placeholder), the partition (sinfo), the tracking server, the shared paths, the disk for the checkpoints;
    --job then runs --on-node on every node of a job of the profile's size: the driver against torch's CUDA
    build, the GPU count against the gres, vLLM, VeRL, Megatron (core and bridge), Transformer Engine, the paths
    and the tracking server from the node, the disk; then across the nodes: a file of the run root written on the
    first and read on the others (the same models, data and environment), an all-reduce (on one node: across
    its own GPUs), Ray with every node joined."""
    from pdmctl import doctor as doc
    from pdmctl import grid, orchestrate
    from pdmctl.doctor import nodes as doctor_nodes

    skip = list(skip or [])
    with _guard():
        known = set(doc.LOGIN_CHECKS) | set(doc.NODE_CHECKS) | set(doctor_nodes.CLUSTER_CHECKS)
        unknown = [s for s in skip if s not in known]
        if unknown:
            fail(f"--skip {unknown[0]}: no such check (checks: {', '.join(sorted(known))})")
        if job and on_node:
            fail("--job and --on-node: --job runs --on-node in a job; give one")
        ctx = orchestrate.make_context(cluster, tracking_uri)
        specs = grid.expand(overrides or [], grid.load_sweep_file(file) if file else None, None) if (file or overrides) else []
        if job and ctx.profile.executor != "slurm":
            fail(f"--job: cluster {ctx.profile.name} is not a SLURM profile")
        checker = doc.Doctor(ctx.profile, ctx.tracking_uri, specs)
        if ctx.profile.executor == "slurm" and checker.opts.python:
            checker.python = checker.opts.python if on_node else checker.python

    task = doctor_nodes.Task.from_env() if on_node else None  # one of several nodes: each line names it

    def say(line: str) -> None:
        console.print(f"{task.node}| {line}" if task else line, highlight=False, markup=False, soft_wrap=True)

    where = "node " + os.uname().nodename if on_node else "login node " + os.uname().nodename
    say(f"pdmctl doctor: cluster {ctx.profile.name}, on the {where}")
    if not doc.run_checks(checker, on_node, skip, say):
        raise typer.Exit(2)
    if task is not None and not doctor_nodes.run_checks(checker, task, skip, say):
        raise typer.Exit(2)
    if on_node and task is None and not doc.run_lines(  # one node: the all-reduce across its own GPUs
            [("all-reduce", lambda: doctor_nodes.one_node_all_reduce(checker, os.uname().nodename))], skip, say, {}):
        raise typer.Exit(2)
    if not job:
        if not on_node and ctx.profile.executor == "slurm":
            say(f"next: pdmctl doctor --cluster {cluster} --job (the nodes' checks, in a job of the profile's nodes)")
        return
    import subprocess

    from pdmctl.resources import find

    path = Path(cluster) if Path(cluster).suffix in (".yaml", ".yml") else find("clusters", cluster) or Path(cluster)
    args = [*(["--file", file] if file else []), *(overrides or [])]
    command = doc.job_command(ctx.profile, str(path.resolve()), checker.opts.python or sys.executable,
                              tracking_uri, skip, args)  # fmt: skip
    say(f"the nodes' checks, in a job of the profile's {checker.opts.nodes} node(s): {' '.join(command[:-1])} SCRIPT")
    try:
        code = subprocess.run(command, check=False).returncode
    except OSError as exc:
        say(f"FAIL  job: {command[0]}: {exc.strerror or exc}")
        raise typer.Exit(2) from None
    if code != 0:
        say(f"FAIL  job: the nodes' checks ended with exit code {code}")
        raise typer.Exit(2)


def _mount_optional() -> None:
    """Subcommands owned by other parts of the package (report, analyze, data)."""
    import importlib

    # module -> the command group it provides (None: the module registers its own commands)
    for module, group in (
        ("pdmctl.report.cli", None),
        ("pdmctl.analysis.cli", None),
        ("pdmctl.backends.verl.cli", "data"),
        ("pdmctl.tune.cli", None),
        ("pdmctl.budget.seeds", None),
        ("pdmctl.preflight.cli", None),
        ("pdmctl.ledger.server_cli", None),
    ):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and module.startswith(exc.name):
                continue
            raise
        if group is None:
            mod.register(app)
        else:
            app.add_typer(mod.app, name=group)


_mount_optional()
usage.register(app)  # init; the flag check and the examples on every command


def main() -> None:
    """The console script: a mistyped option or argument is one line and exit code 2, like any bad input
    (click's own report is a usage block, or a boxed panel under rich)."""
    try:  # typer >= 0.24 carries its own click
        from typer._click import exceptions as click_exceptions
    except ImportError:  # pragma: no cover (older typer: click itself)
        from click import exceptions as click_exceptions

    problem = _resource_dirs_problem()
    if problem:
        try:
            fail(problem)
        except typer.Exit as ended:
            sys.exit(ended.exit_code)
    try:
        code = app(standalone_mode=False)
    except click_exceptions.NoArgsIsHelpError as exc:
        if exc.ctx is not None:
            console.print(exc.ctx.get_help(), highlight=False, markup=False)
        code = 0 if exc.ctx is not None and exc.ctx.invoked_subcommand is None and not sys.argv[1:] else 2
    except click_exceptions.ClickException as exc:  # UsageError, BadParameter, NoSuchOption, FileError
        message = " ".join(exc.format_message().split())
        ctx = getattr(exc, "ctx", None)
        command = f"pdmctl {ctx.info_name}" if ctx is not None and ctx.parent is not None else "pdmctl"
        try:
            fail(f"{command}: {message}", code=exc.exit_code)
        except typer.Exit as ended:
            code = ended.exit_code
    except typer.Abort:  # end of input at a prompt: as typer's own standalone mode ends it
        print("Aborted!", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:  # outside the command (typer turns one inside it into Exit(130))
        interrupted()
    if code == 130:
        interrupted()
    sys.exit(code if isinstance(code, int) else 0)


def _resource_dirs_problem() -> str | None:
    """PDMCTL_CONFIG_DIR and its kin (pdmctl.resources), where set: an absolute path to a directory; a
    relative one would name another folder in each directory pdmctl runs from (and Hydra takes none)."""
    from pdmctl.resources import CONFIG_ROOT, ENV

    for name in ENV.values():
        value = os.environ.get(name)
        if value is None:
            continue
        if not value.strip():
            return f"{name} is set but empty (unset it, or name a directory)"
        path = Path(value).expanduser()
        if not path.is_absolute():
            return f"{name}={value!r}: must be an absolute path"
        if not path.is_dir():
            return f"{name}={value}: {'not a directory' if path.exists() else 'no such directory'}"
        if name == ENV["configs"] and not (path / CONFIG_ROOT).is_file():
            return (f"{name}={value}: no {CONFIG_ROOT} there (a config tree has it at its top; "
                    f"`pdmctl init DIR` writes the shipped tree to DIR/configs)")  # fmt: skip
    return None


def interrupted() -> None:
    """Ctrl-C: one line, the shell's exit code for SIGINT (128 + 2), whenever it comes."""
    print("pdmctl: interrupted", file=sys.stderr)
    sys.exit(130)


if __name__ == "__main__":
    main()
