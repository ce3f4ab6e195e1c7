"""The `report` command. Imports nothing heavy at import time: the CLI mounts this module on every start."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pdmctl.shell import complete


def register(app: typer.Typer) -> None:
    app.command(name="report")(report)


def report(
    sweeps: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="SWEEP",
            help="Sweeps to report on (default: the ledger's only sweep).",
            autocompletion=complete.sweeps,
        ),
    ] = None,
    at: Annotated[
        str | None,
        typer.Option("--at", help="Which evaluation: final, best or last-N (default: the definition's)."),
    ] = None,
    baseline: Annotated[
        str | None,
        typer.Option(
            "--baseline",
            help="Mask to compare against (default: the definition's, dppo_topk_kl).",
            autocompletion=complete.masks,
        ),
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Output directory (default: reports/<sweep>/).")
    ] = None,
    interval: Annotated[
        str | None,
        typer.Option(
            "--interval",
            help="Seed interval: t (Student's; Welch's unpaired), percentile or bca (bootstrap over seeds; "
            "undercovers with few seeds). Default: the definition's, t.",
        ),
    ] = None,
    two_level: Annotated[
        bool,
        typer.Option("--two-level", help="Bootstrap over seeds and problems where per-problem scores exist."),
    ] = False,
    panels: Annotated[
        str | None,
        typer.Option(
            "--panels",
            help="Figures to draw, comma-separated: eval (learning curves), dynamics, mismatch (the "
            "rollout/trainer gap, out-of-region fraction, disagreements); none for no figure. Default: all.",
        ),
    ] = None,
    definition: Annotated[
        str,
        typer.Option(
            "--definition",
            "-d",
            help="Report definition: reports/NAME.yaml or a path.",
            autocompletion=complete.report_definitions,
        ),
    ] = "default",
    analysis: Annotated[
        Path | None,
        typer.Option(
            "--analysis", help="A direction analysis to include (the JSON of `pdmctl analyze --json`)."
        ),
    ] = None,
    tune: Annotated[
        str | None, typer.Option("--tune", help="A study of pdmctl tune: trials, history, importances.")
    ] = None,
    cluster: Annotated[
        str,
        typer.Option(
            "--cluster",
            "-c",
            help="Cluster profile under clusters/ (or a path).",
            autocompletion=complete.clusters,
        ),
    ] = "local",
    tracking_uri: Annotated[
        str | None,
        typer.Option(
            "--tracking-uri", help="MLflow store (default: $MLFLOW_TRACKING_URI, the profile's, ./mlflow.db)."
        ),
    ] = None,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="The tables as one JSON document on stdout (docs/JSON.md); the report is "
            "written as without it, and its lines go to stderr.",
        ),
    ] = False,
) -> None:
    """Tables of avg@16 with seed confidence intervals, comparisons with the baseline, learning curves."""
    from pdmctl.extras import REPORT, refusal
    from pdmctl.terminal import fail

    if (line := refusal("pdmctl report", "report", ("matplotlib",) if tune is not None else REPORT)) is not None:
        fail(line)  # before the report's modules, which import them
    from rich.text import Text

    from pdmctl.ledger import ledger_exists, login_notes, open_ledger, tracking_login
    from pdmctl.orchestrate import make_context
    from pdmctl.report.build import build_report, load_analysis, pooling_notes
    from pdmctl.report.definition import ReportError, load_definition
    from pdmctl.report.tables import (
        comparison_table,
        cost_table,
        excluded_table,
        methods,
        power_table,
        results_table,
        to_rich,
    )
    from pdmctl.report.write import log_to_sweep_run, write_report
    from pdmctl.terminal import check_output, console, err, fail, guard

    if tune is not None:  # a study's page (pdmctl.tune.page), not a sweep report
        from pdmctl.tune.cli import report_study

        if as_json:
            with guard():
                fail("--json: prints a sweep report's tables; a study's page (--tune) has none")

        report_study(tune, out, cluster, tracking_uri)
        return
    with guard():
        if out is not None:
            check_output(out, "--out", directory=True)
        try:
            spec = load_definition(definition).with_options(at=at, baseline=baseline, interval=interval,
                                                            panels=panels)  # fmt: skip
            if analysis is not None:  # whole, before the store is opened
                load_analysis(analysis)
        except ReportError as exc:
            fail(str(exc))
        ctx = make_context(cluster, tracking_uri)
        if not ledger_exists(ctx.tracking_uri):
            fail(f"no ledger at {ctx.tracking_uri}: run a sweep first, or pass --tracking-uri")
        ledger = open_ledger(ctx.tracking_uri)
        known = ledger.sweeps()
        chosen = _choose_sweeps(sweeps or [], known, ctx.tracking_uri)
        if isinstance(chosen, str):
            fail(chosen)
        out_dir = out or Path("reports") / "+".join(chosen)
        check_output(out_dir, "--out" if out else "report directory", directory=True)
        try:
            result = build_report(ledger, chosen, spec, two_level=two_level, analysis=analysis)
        except ReportError as exc:
            fail(str(exc))
        records = [r for sweep in result.sweeps for r in ledger.runs(sweep)]
        result = with_cost(result, records, ctx)
    if baseline is not None and not result.baseline_present:
        fail(f"--baseline: mask {baseline!r} has no runs in {', '.join(chosen)}")
    written = write_report(result, out_dir)
    logged = log_to_sweep_run(ledger, chosen, out_dir, written)  # its files into the sweep's parent run
    if as_json:
        _print_json(result, out_dir, written, records)
        err.print(logged, highlight=False, markup=False, soft_wrap=True)
        return
    console.print(to_rich(results_table(result)))
    console.print(to_rich(comparison_table(result)))
    if result.comparisons:
        console.print(to_rich(power_table(result)))
    for line in pooling_notes(result):
        console.print(f"provenance: {line}", highlight=False)
    console.print(Text("Methods: " + " ".join(methods(result))))
    if any(not isinstance(c, str) for c in result.cost):
        console.print(to_rich(cost_table(result)))
    if result.excluded:
        console.print(to_rich(excluded_table(result)))
    for line in login_notes(records, tracking_login()):  # runs another login than their sweep's owner wrote
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    console.print(logged, highlight=False, markup=False)
    console.print(f"wrote {len(written)} files to {out_dir}/ — open {written[-1]}", highlight=False)


def _print_json(result, out_dir: Path, written: list[Path], records) -> None:
    """The tables as one document on stdout; the lines the report prints besides them, on stderr."""
    from pdmctl.ledger import login_notes, tracking_login
    from pdmctl.report.document import report_document
    from pdmctl.shell import print_document
    from pdmctl.terminal import err

    print_document(report_document(result, out_dir, written))
    for line in login_notes(records, tracking_login()):
        err.print(line, highlight=False, markup=False, soft_wrap=True)
    err.print(f"wrote {len(written)} files to {out_dir}/ — open {written[-1]}", highlight=False, markup=False,
              soft_wrap=True)  # fmt: skip


def with_cost(result, records, ctx):
    """The report with each sweep's hours spent beside the prediction (pdmctl.budget.spent), per setting, from the
    ledger's `records` of its sweeps."""
    import dataclasses
    import time

    from pdmctl.budget.spent import sweep_costs

    return dataclasses.replace(result, cost=sweep_costs(records, ctx, time.time()))


def _choose_sweeps(asked: list[str], known: list[str], uri: str) -> list[str] | str:
    """The sweeps to report on, or the one-line reason there are none."""
    if not known:
        return f"no sweeps in {uri}"
    if not asked:
        if len(known) > 1:
            return f"{len(known)} sweeps in {uri}: name one or more ({', '.join(known)})"
        return known
    unknown = [s for s in asked if s not in known]
    if unknown:
        return f"sweep {unknown[0]!r}: no runs in {uri} (known: {', '.join(known)})"
    return list(dict.fromkeys(asked))
