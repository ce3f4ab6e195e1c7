"""The `tune` command (mounted by pdmctl.cli): parses, prints; the logic is in pdmctl.tune.study."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from pdmctl.shell import complete

_FILE_OPTIONS = ("trials", "parallel", "objective", "direction", "at", "sampler", "pruner",
                 "seeds_per_trial", "max_attempts", "seed")  # fmt: skip
_INT_OPTIONS = ("trials", "parallel", "seeds_per_trial", "max_attempts", "seed")


def register(app: typer.Typer) -> None:
    app.command(name="tune", context_settings={"ignore_unknown_options": True})(tune)


def tune(
    overrides: Annotated[
        list[str] | None,
        typer.Argument(
            help="Search space and fixed settings: delta=interval(0.02,0.3) "
            "backend.lr=tag(log,interval(1e-4,3e-3)) k=choice(10,20,50) backend.steps=20; "
            "or `status [NAME]`."
        ),  # fmt: skip
    ] = None,
    file: Annotated[
        str | None,
        typer.Option(
            "--file", "-f", help="A sweep file with a tune: section.", autocompletion=complete.sweep_files
        ),
    ] = None,
    trials: Annotated[int | None, typer.Option(help="Trials in the study, all invocations together.")] = None,
    parallel: Annotated[
        int | None, typer.Option("--parallel", "-p", help="Trials in flight at once (default: 1).")
    ] = None,
    objective: Annotated[
        str | None, typer.Option(help="Metric to optimise (default: avg@16: the mean of the held-out sets).")
    ] = None,
    direction: Annotated[str | None, typer.Option(help="maximize | minimize (default: maximize).")] = None,
    at: Annotated[
        str | None, typer.Option("--at", help="Which evaluation: final | best (default: final).")
    ] = None,
    sampler: Annotated[str | None, typer.Option(help="tpe | cmaes | random | grid (default: tpe).")] = None,
    pruner: Annotated[str | None, typer.Option(help="median | hyperband | none (default: median).")] = None,
    seeds_per_trial: Annotated[
        int | None, typer.Option(help="Seeds per trial, averaged (default: 1).")
    ] = None,
    max_attempts: Annotated[
        int | None, typer.Option(help="Attempts of a failing run before its trial fails (default: 2).")
    ] = None,
    seed: Annotated[int | None, typer.Option(help="The sampler's seed (reproducible suggestions).")] = None,
    name: Annotated[
        str | None,
        typer.Option("--name", "-n", help="Study (and sweep) name (default: the file's, or 'tune')."),
    ] = None,
    cluster: Annotated[
        str,
        typer.Option(
            "--cluster", "-c", help="Cluster profile under clusters/.", autocompletion=complete.clusters
        ),
    ] = "local",
    tracking_uri: Annotated[str | None, typer.Option("--tracking-uri", help="MLflow store.")] = None,
    storage: Annotated[
        str | None,
        typer.Option(
            help="Optuna storage (default: beside the ledger: mlflow.optuna.db, or its PostgreSQL)."
        ),
    ] = None,
    wait: Annotated[
        bool,
        typer.Option("--wait", "-w", help="On a cluster: stay until the study ends (default: submit, exit)."),
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the space and the plan; write nothing.")
    ] = False,
) -> None:
    """An Optuna study whose trials are ordinary runs: ask, submit, prune through the jobs, tell.

    The same command again continues the study (--trials is the study's total)."""
    from pdmctl.terminal import fail, guard

    args = list(overrides or [])
    if args and args[0] == "status":
        if len(args) > 2:
            fail("tune status: takes at most one study name")
        with guard():
            _status(args[1] if len(args) == 2 else None, cluster, tracking_uri, storage)
        return
    from pdmctl import orchestrate
    from pdmctl.tune import study as tune_study

    with guard():
        try:
            given = dict(trials=trials, parallel=parallel, objective=objective, direction=direction, at=at,
                         sampler=sampler, pruner=pruner, seeds_per_trial=seeds_per_trial,
                         max_attempts=max_attempts, seed=seed)  # fmt: skip
            file_name, file_overrides, file_options = _read_file(file) if file else (None, [], {})
            values = {k: v if v is not None else file_options.get(k) for k, v in given.items()}
            if values["trials"] is None:
                fail("--trials: required (the number of trials in the study)")
            cli_keys = {o.split("=", 1)[0].lstrip("+~") for o in args}
            all_overrides = [
                o for o in file_overrides if o.split("=", 1)[0].lstrip("+~") not in cli_keys
            ] + args
            request = tune_study.Request(
                overrides=tuple(all_overrides),
                **{k: values[k] for k in ("objective", "direction", "at", "pruner", "seeds_per_trial")
                   if values[k] is not None},
            )  # fmt: skip
            options = tune_study.Options(**{k: values[k] for k in ("trials", "parallel", "sampler", "seed",
                                                                   "max_attempts") if values[k] is not None})  # fmt: skip
            study_name = name or file_name or "tune"
            ctx = orchestrate.make_context(cluster, tracking_uri)
            plan = tune_study.check(study_name, request, options, ctx, storage)
            if dry_run:
                from pdmctl.testhooks import check_environment

                check_environment()  # what the real tune would refuse
                orchestrate.check_profile(ctx)
                _print_plan(plan, options, ctx)
                return
            driver = tune_study.Driver(plan, options, ctx)
            driver.open()
        except tune_study.TuneError as exc:
            fail(str(exc))
        _print_space(plan)
        stay = wait or ctx.profile.executor == "local"
        try:
            result = driver.run(stay, _progress_printer())
        except tune_study.TuneError as exc:
            fail(str(exc))
        except KeyboardInterrupt:  # the trials in flight are runs of their own: they go on
            _interrupted(plan.name, ctx, cluster)
    _print_summary(plan.name, plan.storage, ctx, result, stay)


def _interrupted(study: str, ctx, cluster: str) -> None:
    """A Ctrl-C while driving a study: one line (its trials in flight go on; no new one starts until `pdmctl
    tune` drives the study again), exit 130."""
    import sys

    from pdmctl.shell.waiting import EXIT_INTERRUPTED, follow_options

    where = follow_options(ctx, cluster)
    print(f"pdmctl: stopped driving study {study}; its trials in flight go on (pdmctl status {study}{where} "
          "--watch follows them), and the same pdmctl tune command again continues the study", file=sys.stderr,
          flush=True)  # fmt: skip
    sys.exit(EXIT_INTERRUPTED)


def _read_file(path_or_name: str) -> tuple[str, list[str], dict[str, Any]]:
    from pdmctl.grid import GridError, _hydra_value
    from pdmctl.resources import search_path
    from pdmctl.tune.study import TuneError
    from pdmctl.yamlfiles import load_named

    path, data = load_named(path_or_name, search_path("sweeps"), "sweep file", GridError)
    section = data.get("tune")
    if not isinstance(section, dict):
        raise TuneError(f"sweep file: {path}: no tune: section (a mapping with space: and options)")
    unknown = sorted(set(section) - {"space", *_FILE_OPTIONS})
    if unknown:
        raise TuneError(f"sweep file: {path}: tune: unknown field {unknown[0]!r} "
                        f"(known: space, {', '.join(_FILE_OPTIONS)})")  # fmt: skip
    where = f"sweep file: {path}"
    for name, value in (("grid", data.get("grid")), ("tune: space", section.get("space"))):
        if value is not None and not isinstance(value, dict):
            raise TuneError(f"{where}: {name}: must be a mapping of key: value, got {value!r:.60}")
    overrides = [f"{k}={_hydra_value(v, f'{where}: grid: {k}')}" for k, v in (data.get("grid") or {}).items()]
    overrides += [f"{k}={_hydra_value(v, f'{where}: tune: space: {k}')}"
                  for k, v in (section.get("space") or {}).items()]  # fmt: skip
    options = {k: section[k] for k in _FILE_OPTIONS if k in section}
    for key, value in options.items():  # what the command line's options would have typed
        wanted = int if key in _INT_OPTIONS else str
        if value is not None and (not isinstance(value, wanted) or isinstance(value, bool)):
            kind = "an integer" if wanted is int else "a string"
            raise TuneError(f"{where}: tune: {key}: must be {kind}, got {value!r:.60}")
    return str(data.get("name") or path.stem), overrides, options


def _print_space(plan) -> None:
    from rich.table import Table

    from pdmctl.terminal import console

    table = Table(title=f"study {plan.name}: optimise {plan.request.objective} ({plan.request.direction}, "
                        f"{plan.request.at})")  # fmt: skip
    table.add_column("parameter")
    table.add_column("distribution")
    for param, text in plan.space.describe():
        table.add_row(param, text)
    for fixed in plan.space.fixed:
        table.add_row(fixed.split("=", 1)[0], f"fixed: {fixed.split('=', 1)[1]}")
    console.print(table)


def _print_plan(plan, options, ctx) -> None:
    from pdmctl.terminal import console
    from pdmctl.tune.study import TuneError, load_study, storage_exists

    _print_space(plan)
    done = 0
    if storage_exists(plan.storage):
        try:
            done = len(load_study(plan.name, plan.storage).trials)
        except TuneError:
            done = 0
    console.print(f"study {plan.name}: {done} trial(s) so far; would run up to {max(options.trials - done, 0)} "
                  f"more, {options.parallel} at a time, {options.sampler} sampler, {plan.request.pruner} pruner",
                  highlight=False)  # fmt: skip
    from pdmctl.ledger.uris import redact

    console.print(f"storage: {redact(plan.storage)}  tracking: {redact(ctx.tracking_uri)}  (dry run: nothing written)",
                  highlight=False)  # fmt: skip


def _progress_printer():
    from pdmctl.terminal import console

    last: list[str] = []

    def show(result) -> None:
        line = ", ".join(f"{n} {s.lower()}" for s, n in sorted(result.states.items())) or "no trials"
        if [line] != last:
            last[:] = [line]
            console.print(f"trials: {line}  (in flight {result.in_flight})", highlight=False)

    return show


def _print_summary(name: str, storage: str, ctx, result, stayed: bool) -> None:
    from pdmctl.terminal import console
    from pdmctl.tune.study import study_view

    view = study_view(name, storage, ctx)
    if view.best is not None:
        params = " ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in view.best.params.items()
        )
        console.print(f"best: trial {view.best.number}, {view.best.value:.4f}  {params}", highlight=False)
    if not stayed and result.in_flight:
        console.print(f"{result.in_flight} trial(s) in flight: run the same command again to continue the study "
                      f"(or [bold]pdmctl tune status {name}[/])", highlight=False)  # fmt: skip


def _status(name: str | None, cluster: str, tracking_uri: str | None, storage: str | None) -> None:
    from pdmctl.orchestrate import make_context
    from pdmctl.terminal import fail
    from pdmctl.tune.study import TuneError, storage_exists, storage_url, study_names, study_view

    ctx = make_context(cluster, tracking_uri)
    try:
        url = storage_url(ctx.tracking_uri, storage)
        if not storage_exists(url):
            fail(f"no studies: {url} does not exist")
        if name is None:
            names = study_names(url)
            if not names:
                fail(f"no studies in {url}")
            for n in names:
                _print_study(study_view(n, url, ctx))
            return
        _print_study(study_view(name, url, ctx))
    except TuneError as exc:
        fail(str(exc))


def _print_study(view) -> None:
    from rich.table import Table

    from pdmctl.terminal import console

    counts = view.counts()
    caption = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no trials"
    table = Table(title=f"study {view.name} ({view.direction})", caption=caption)
    for col in ("#", "state", "value", "params", "runs"):
        table.add_column(col, justify="right" if col in ("#", "value") else "left")
    for t in view.trials:
        state = t.state + (f" (run {t.run_state})" if t.state == "running" and t.run_state else "")
        params = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in t.params.items())
        table.add_row(
            str(t.number), state, "" if t.value is None else f"{t.value:.4f}", params, " ".join(t.keys)
        )
    console.print(table)
    if view.best is not None:
        params = " ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in view.best.params.items()
        )
        console.print(
            f"best: trial {view.best.number}, value {view.best.value:.4f}: {params}", highlight=False
        )


def report_study(name: str, out: Path | None, cluster: str, tracking_uri: str | None) -> None:
    """`pdmctl report --tune NAME`: the study's page under reports/tune-NAME/ (or --out)."""
    from pdmctl.orchestrate import make_context
    from pdmctl.terminal import console, fail, guard
    from pdmctl.tune.page import write_study_report
    from pdmctl.tune.study import TuneError, storage_exists, storage_url

    with guard():
        try:
            ctx = make_context(cluster, tracking_uri)
            if not storage_exists(storage_url(ctx.tracking_uri, None)):
                from pdmctl.ledger.uris import redact

                fail(f"study {name!r}: no study storage beside {redact(ctx.tracking_uri)}")
            page = write_study_report(name, ctx, out or Path("reports") / f"tune-{name}")
        except TuneError as exc:
            fail(str(exc))
    console.print(f"wrote {page}", highlight=False)
