"""`pdmctl preflight`: prove every setting of a sweep reaches its first step, checkpoints, requeues and
resumes, in one short job each, before the sweep's array goes out (pdmctl.preflight)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from typing import Annotated, Any

import typer

from pdmctl import preflight
from pdmctl.shell import complete
from pdmctl.spec import RunSpec
from pdmctl.terminal import console, fail
from pdmctl.terminal import guard as _guard


def register(app: typer.Typer) -> None:
    app.command(name="preflight")(preflight_command)


def representatives(specs: Sequence[RunSpec]) -> list[RunSpec]:
    """One run per distinct engine path: the backend's setting (VeRL: model, precision, strategy; the
    testbed: model, precision) and the mask's method (GRPO's ratio, DPPO's and PDM's top-K masks run
    different code; the masks of one method differ only in what that code reads). The first of each in grid
    order, whatever its seed."""
    from pdmctl.backends.registry import flat_config, get_backend

    seen: set[tuple[str, str, str]] = set()
    out = []
    for spec in specs:
        path = (spec.backend, get_backend(spec.backend).setting(flat_config(spec.config)),
                str(spec.config["mask"]["method"]))  # fmt: skip
        if path not in seen:
            seen.add(path)
            out.append(spec)
    return out


# the backend fields a preflight run sets: a few steps, a checkpoint after each, one evaluation at the end
def _preflight_fields(backend: str, steps: int) -> dict[str, Any]:
    if backend == "toy":
        return {"steps": steps, "checkpoint_every": 1, "eval_every": steps}
    if backend == "verl":
        return {"total_training_steps": steps, "save_freq": 1, "test_freq": steps, "val_before_train": False}
    return {}


def preflight_spec(spec: RunSpec, steps: int) -> RunSpec:
    """`spec` as its preflight run: in `<sweep>.preflight`, `steps` steps, a checkpoint after every step."""
    config = json.loads(spec.config_json)
    config["backend"] = {**config["backend"], **_preflight_fields(spec.backend, steps)}
    return RunSpec.from_config(preflight.preflight_sweep(spec.sweep), config)


def preflight_command(
    overrides: Annotated[
        list[str] | None,
        typer.Argument(
            help="Grid overrides, as `pdmctl sweep` takes them.", autocompletion=complete.overrides
        ),
    ] = None,
    file: Annotated[
        str | None,
        typer.Option(
            "--file",
            "-f",
            help="A sweep file (sweeps/NAME.yaml or NAME).",
            autocompletion=complete.sweep_files,
        ),
    ] = None,
    name: Annotated[str | None, typer.Option("--name", "-n", help="The sweep's name (default: the file's).")] = None,
    cluster: Annotated[str, typer.Option("--cluster", "-c", help="A SLURM cluster profile (clusters/NAME.yaml "
                                         "or a path): the preflight proves its requeue path.",
                                         autocompletion=complete.clusters)] = "local",  # fmt: skip
    tracking_uri: Annotated[str | None, typer.Option("--tracking-uri", help="MLflow tracking URI (default: the "
                                                     "profile's, else ./mlflow.db).")] = None,  # fmt: skip
    steps: Annotated[int, typer.Option("--steps", min=2, max=50, help="Steps of each preflight run; the first "
                                       "attempt requeues itself after step 1's checkpoint.")] = preflight.STEPS,  # fmt: skip
    offline: Annotated[bool, typer.Option("--offline", help="With --dry-run: plan without asking SLURM (as where "
                                          "no sinfo is found): the profile's partition and nodes as stated.")] = False,  # fmt: skip
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print each setting's preflight job and its cost; "
                                          "submit and write nothing.")] = False,  # fmt: skip
    wait: Annotated[bool, typer.Option("--wait", "-w", help="Wait until every preflight run has ended, then print "
                                       "each setting's verdict.")] = False,  # fmt: skip
) -> None:
    """Run one short job per distinct setting of a sweep: it trains a few steps, checkpoints, requeues itself
    through SLURM's time-limit signal and resumes from that checkpoint. Prints per setting the time to the
    first step, the step time beside the cost model's, the peak memory, the checkpoint's size and write
    time, and the resume; exits 2 naming each setting's first error. Run it again to see where they stand."""
    from pdmctl import grid, orchestrate
    from pdmctl.budget import costing
    from pdmctl.preflight import summary

    with _guard():
        sweep_file = grid.load_sweep_file(file) if file else None
        ctx = orchestrate.make_context(cluster, tracking_uri)
        if not dry_run:
            orchestrate.check_placeholders(ctx.profile)
        specs = grid.expand(overrides or [], sweep_file, name)
        if offline and not dry_run:
            fail("--offline: plans without SLURM; give --dry-run too")
        if specs[0].sweep.endswith(preflight.SUFFIX):
            fail(f"preflight: sweep {specs[0].sweep!r} ends in {preflight.SUFFIX!r}, the name of preflight runs; "
                 "name the sweep itself")  # fmt: skip
        chosen = [preflight_spec(s, steps) for s in representatives(specs)]
        chosen = orchestrate.pin_data(chosen, ctx)
        if dry_run:
            executor, unchecked = costing.plan_profile(ctx, offline)
        else:
            executor, unchecked = orchestrate.check_profile(ctx), None
        if executor.name != "slurm":
            fail(f"preflight: cluster {ctx.profile.name!r} runs local processes; a preflight proves a SLURM "
                 "profile's jobs and its requeue path: give --cluster a SLURM profile")  # fmt: skip
        orchestrate.check_runs(chosen, ctx, executor, storage=unchecked is None)
        if dry_run:
            if unchecked:
                console.print(unchecked, highlight=False, markup=False, soft_wrap=True)
            for line in summary.plan_lines(chosen, ctx, executor, steps, len(specs)):
                console.print(line, highlight=False, markup=False, soft_wrap=True)
            return
        for spec in chosen:  # each run's first attempt requeues itself after this step's checkpoint
            mark = ctx.run_dir_parent(spec) / preflight.MARK
            mark.parent.mkdir(parents=True, exist_ok=True)
            if not mark.exists():
                mark.write_text(json.dumps({"requeue_at_step": preflight.REQUEUE_AT_STEP}) + "\n")
        _, job_ids = orchestrate.sweep(chosen, ctx, order="setting")
        sweep_name = chosen[0].sweep
        console.print(f"preflight {sweep_name}: {len(chosen)} setting(s); submitted {len(job_ids)} job(s)",
                      highlight=False, markup=False)  # fmt: skip
        if wait:
            from pdmctl.shell.waiting import wait as wait_for_runs

            with contextlib.suppress(typer.Exit):  # a run that did not finish: the verdicts below say why
                wait_for_runs(ctx, sweep_name, cluster=cluster)
        lines, failed, pending = summary.verdicts(chosen, ctx, executor)
    for line in lines:
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    if failed:
        raise typer.Exit(2)
    if pending and not wait:
        console.print(f"follow with pdmctl preflight {' '.join(_args(file, overrides, name, cluster))} (again: "
                      "each setting's verdict once its run has ended)", highlight=False, markup=False, soft_wrap=True)  # fmt: skip


def _args(file: str | None, overrides: list[str] | None, name: str | None, cluster: str) -> list[str]:
    return [*(["--file", file] if file else []), *(overrides or []), *(["--name", name] if name else []),
            "--cluster", cluster]  # fmt: skip
