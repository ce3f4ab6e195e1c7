"""The `analyze` command (mounted by pdmctl.cli): parses, prints; the logic is in pdmctl.analysis."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated

import typer

from pdmctl.grid import MAX_RUNS
from pdmctl.terminal import check_output, console, fail
from pdmctl.terminal import guard as _guard

MAX_SEEDS = MAX_RUNS  # analyze --seeds: as many as a sweep may have runs
MAX_SEED = 2**63 - 1  # torch.manual_seed takes a signed 64-bit seed
DEFAULT_PROTOCOLS = "counterfactual,carried,fresh-adam,sgd,own-adam,own-grad"


def register(app: typer.Typer) -> None:
    app.command(name="analyze", context_settings={"ignore_unknown_options": True})(analyze)


def analyze(
    overrides: Annotated[
        list[str] | None, typer.Argument(help="Run-config overrides: precision=fp8_rollout k=50")
    ] = None,
    seeds: Annotated[int, typer.Option(help="Fresh seeds to analyse.")] = 20,
    first_seed: Annotated[int, typer.Option(help="The first of the seeds.")] = 1000,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Also write the result as JSON here.")
    ] = None,
    protocols: Annotated[
        str,
        typer.Option(
            help="How the update that ΔD measures is taken, comma-separated; the first is the main table's, "
            "the others are printed beside it: counterfactual (per token, one carried Adam update on the whole batch "
            "with it kept against one with it masked: ΔD = D(keep) − D(mask)), carried (the Adam state the stale mini-batches left), "
            "fresh-adam, sgd, own-adam and own-grad (a token's own effect, first order; see docs/MATH.md)."
        ),
    ] = DEFAULT_PROTOCOLS,
    family: Annotated[
        list[Path] | None,
        typer.Option(
            "--family",
            help="An earlier analyze --json (e.g. the other preset's), repeatable: its secondary comparisons join "
            "this run's in one Holm family.",
        ),
    ] = None,
    csv_out: Annotated[
        Path | None, typer.Option("--csv", help="Also write the per-seed rates as CSV here.")
    ] = None,
    figures: Annotated[
        Path | None,
        typer.Option(help="Also draw the paper's figures (PNG) into this directory (created if missing)."),
    ] = None,
    jobs: Annotated[
        int | None,
        typer.Option(help="Worker processes over the seeds (default: the cores this process may use)."),
    ] = None,
    threads: Annotated[
        int | None,
        typer.Option(
            help="torch threads per process (default 1). A seed's numbers depend on this (the order of "
            "float sums), not on --jobs: the default is the same on every machine."
        ),
    ] = None,
    exact_region: Annotated[
        bool,
        typer.Option(
            "--exact-region",
            help="The counterfactual's region effect (a secondary measure) of every variant by a forward of the "
            "whole region at its weights, about ten times the CPU; by default it is first order, checked against "
            "the exact value on a few variants per seed.",
        ),
    ] = False,
    mismatch_only: Annotated[
        bool,
        typer.Option(
            "--mismatch-only",
            help="The paper's fresh-rollout setting: no stale mini-batch update, D from the rollout weights' "
            "precision alone (precision=bf16, fp8_rollout or fp8_e2e).",
        ),
    ] = False,
    engine: Annotated[
        str | None,
        typer.Option(
            help="verl: analyse VeRL runs' snapshots instead of the testbed (the arguments are the runs' "
            "directories, one run a seed; each wrote its snapshot with PDMCTL_VERL_SNAPSHOT_STEP=N).",
        ),
    ] = None,
    step: Annotated[int | None, typer.Option(help="With --engine: the snapshotted training step.")] = None,
    model_dir: Annotated[
        Path | None,
        typer.Option("--model-dir", help="With --engine: the run's model directory, where it moved since the run."),
    ] = None,
) -> None:
    """The token-level direction analysis (MATH.md): ratio vs predictive direction, on the CPU testbed or on a
    VeRL run's snapshot (--engine verl RUN_DIR --step N)."""
    from pdmctl import grid
    from pdmctl.backends.registry import flat_config

    if engine is not None or step is not None:
        testbed = {"--seeds": seeds != 20, "--first-seed": first_seed != 1000, "--json": json_out is not None,
                   "--protocols": protocols != DEFAULT_PROTOCOLS, "--family": bool(family), "--csv": csv_out is not None,
                   "--figures": figures is not None, "--jobs": jobs is not None, "--exact-region": exact_region,
                   "--mismatch-only": mismatch_only}  # fmt: skip
        if given := [name for name, set_ in testbed.items() if set_]:
            fail(f"{given[0]}: an option of the testbed's analysis; the snapshot analysis (--engine verl) takes the "
                 "run directories, --step, --model-dir and --threads, and prints its tables")  # fmt: skip
        _engine_analysis(engine, overrides or [], step, model_dir, threads)
        return
    if model_dir is not None:
        fail("--model-dir: goes with --engine verl RUN_DIR --step N")

    from pdmctl.extras import refusal

    needed = ("torch", "scipy", *(("matplotlib",) if figures is not None else ()))
    if (line := refusal("pdmctl analyze", "testbed", needed)) is not None:
        fail(line)  # the testbed's runs and the analysis's statistics
    with _guard():
        if not 1 <= seeds <= MAX_SEEDS:
            fail(f"--seeds: must be in [1, {MAX_SEEDS:,}], got {seeds}")
        if not 0 <= first_seed <= MAX_SEED - seeds + 1:  # torch's seeds are 64-bit
            fail(f"--first-seed: must be in [0, {MAX_SEED - seeds + 1}] for {seeds} seed(s), got {first_seed}")
        if json_out is not None:  # before the analysis, not after it
            check_output(json_out, "--json", directory=False)
        if csv_out is not None:
            check_output(csv_out, "--csv", directory=False)
        if figures is not None:
            check_output(figures, "--figures", directory=True)
        earlier = []
        for path in family or []:
            import json as _json

            from pdmctl.analysis.results import AnalysisResult

            try:
                earlier.append(AnalysisResult.from_dict(_json.loads(_read_family(path))))
            except (OSError, ValueError, TypeError, KeyError, RecursionError) as exc:
                fail(f"--family: {path}: not an analyze --json result ({(str(exc) or type(exc).__name__).splitlines()[0][:120]})")
        for name, value in (("--jobs", jobs), ("--threads", threads)):
            if value is not None and value < 1:
                fail(f"{name}: must be >= 1, got {value}")
        specs = grid.expand(overrides or [], sweep="analysis")
        if len(specs) > 1:
            varied = sorted(k for k, v in flat_config(specs[0].config).items()
                            if any(flat_config(s.config).get(k) != v for s in specs[1:]))  # fmt: skip
            fail(f"analyze: one config at a time; the overrides make {len(specs)} ({', '.join(varied)} vary): "
                 "run one analyze per value")  # fmt: skip
        (spec,) = specs
        if spec.backend != "toy":
            fail("analyze: runs on the CPU testbed (backend=toy)")
        from pdmctl.analysis.protocols import PROTOCOLS
        from pdmctl.analysis.regime import render_regime_table
        from pdmctl.analysis.run import default_jobs, run_analysis
        from pdmctl.analysis.tables import (
            render_analysis_table,
            render_assumption_table,
            render_decomposition_table,
            render_difference_table,
            render_protocol_table,
            seed_csv,
        )
        from pdmctl.backends.toy import ToyConfig
        from pdmctl.backends.toy.basemodel import BaseModelError, check_base_model

        chosen = tuple(p.strip() for p in protocols.split(",") if p.strip())
        unknown = [p for p in chosen if p not in PROTOCOLS]
        if unknown or not chosen or len(set(chosen)) != len(chosen):
            fail(f"--protocols: {protocols!r}: name each of {', '.join(PROTOCOLS)} at most once")
        cfg = ToyConfig.from_mapping(flat_config(spec.config))
        try:
            check_base_model(cfg.model)  # the shipped file whole, or a warm-up cache that can take the build
        except BaseModelError as exc:
            fail(str(exc))
    n_jobs = min(jobs or default_jobs(), seeds)
    with console.status(f"analysing {seeds} seed(s) in {n_jobs} process(es) ..."):
        result = run_analysis(
            cfg,
            list(range(first_seed, first_seed + seeds)),
            chosen,
            jobs=n_jobs,
            threads=threads or 1,  # not the cores over the jobs: then --seeds 1 and --seeds 61 differ
            mismatch_only=mismatch_only,
            exact_region=exact_region,
        )
    console.print(render_analysis_table(result))
    console.print(render_regime_table(result))
    console.print(render_difference_table(result))
    if len(chosen) > 1:
        console.print(render_protocol_table(result))
    console.print(render_decomposition_table(result))
    console.print(render_assumption_table(result))
    if result.bands:
        from pdmctl.analysis.bands import render_band_table

        console.print(render_band_table(result.bands, result.k))
    from pdmctl.analysis.inference import (
        channel_lines,
        primary_lines,
        primary_metric,
        primary_test_lines,
        region_check_line,
        render_secondary_table,
        secondary_family,
    )

    console.print(render_secondary_table(secondary_family([*earlier, result])))
    metrics = [primary_metric(r) for r in [*earlier, result]]
    for r, metric in zip([*earlier, result], metrics, strict=True):
        for line in primary_lines(metric) + channel_lines(r):
            console.print(line, highlight=False, markup=False)
    for line in primary_test_lines(metrics):
        console.print(line, highlight=False, markup=False)
    if region_check_line(result):
        console.print(region_check_line(result), highlight=False, markup=False)
    with _kept_on_failure(result) as writing:
        if json_out is not None:
            writing[0] = f"--json {json_out}"
            json_out.write_text(result.to_json())
            console.print(f"wrote {json_out}", highlight=False)
        if csv_out is not None:
            writing[0] = f"--csv {csv_out}"
            csv_out.write_text(seed_csv(result))
            console.print(f"wrote {csv_out}", highlight=False)
        if figures is not None:
            from pdmctl.analysis.figures import write_figures

            writing[0] = f"--figures {figures}"

            for path in write_figures(result, figures):
                console.print(f"wrote {path}", highlight=False)


def _engine_analysis(engine: str | None, args: list[str], step: int | None, model_dir: Path | None,
                     threads: int | None) -> None:
    """`analyze --engine verl RUN_DIR --step N` (pdmctl.analysis.engine)."""
    with _guard():
        if engine != "verl":
            fail(f"--engine: {engine!r}: the snapshot analysis runs on VeRL runs (--engine verl)" if engine
                 else "--step: goes with --engine verl RUN_DIR")  # fmt: skip
        if not args:
            fail("analyze --engine verl: name the run directory (or several: one run a seed)")
        if step is None or step < 1:
            fail(f"--step: the snapshotted training step (an integer >= 1), got {step}")
        if threads is not None and threads < 1:
            fail(f"--threads: must be >= 1, got {threads}")
        run_dirs = [Path(a) for a in args]
        named: dict[Path, Path] = {}
        for run_dir in run_dirs:
            if (first := named.setdefault(run_dir.resolve(), run_dir)) is not run_dir:
                fail(f"{run_dir}: named twice (as {first} too); each run directory is one seed, given once")
        from pdmctl.analysis.engine.replay import SnapshotError, snapshot_paths

        for run_dir in run_dirs:
            if not run_dir.is_dir():
                fail(f"{run_dir}: not a run directory")
            try:
                snapshot_paths(run_dir, step)
            except SnapshotError as exc:
                fail(str(exc))
    from pdmctl.analysis.engine.replay import SnapshotError
    from pdmctl.analysis.engine.report import analyse_runs, lines_of, regime_table

    with _guard():
        try:
            with console.status(f"replaying step {step} of {len(run_dirs)} run(s) ..."):
                analysis = analyse_runs(run_dirs, step, str(model_dir) if model_dir else None, threads)
        except SnapshotError as exc:
            fail(str(exc))
    for line in lines_of(analysis):
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    console.print(regime_table(analysis))


MAX_FAMILY_BYTES = 64 * 2**20  # an analyze --json is a few MB; a bigger --family is the wrong file


def _read_family(path: Path) -> str:
    """An earlier analyze --json's text: a regular file (not a FIFO or a device that never ends), bounded."""
    import os
    import stat

    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise ValueError("not a regular file")
    with open(path, "rb") as fh:
        data = fh.read(MAX_FAMILY_BYTES + 1)
    if len(data) > MAX_FAMILY_BYTES:
        raise ValueError(f"larger than {MAX_FAMILY_BYTES // 2**20} MiB")
    return data.decode()


@contextlib.contextmanager
def _kept_on_failure(result):
    """A write after the analysis that fails (a full disk, a directory gone) is one line, and what was
    computed is kept: the whole result as JSON in the temporary directory, named in that line."""
    writing = ["analyze"]  # what is being written, set by the caller
    try:
        yield writing
    except OSError as exc:
        import tempfile

        where = f"{writing[0]}: " + (f"{exc.filename}: " if exc.filename and str(exc.filename) not in writing[0] else "")
        try:
            fd, kept = tempfile.mkstemp(prefix="pdmctl-analysis-", suffix=".json")
            with open(fd, "w") as fh:
                fh.write(result.to_json())
        except OSError as again:
            fail(f"{where}cannot be written ({exc.strerror or exc}); the result could not be kept either "
                 f"({again.strerror or again}): the tables above are all there is")  # fmt: skip
        fail(f"{where}cannot be written ({exc.strerror or exc}); the result is kept in {kept} "
             "(report --analysis reads it)")  # fmt: skip
