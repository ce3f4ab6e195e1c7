"""A trial's side inside its job: each evaluation goes to the Optuna trial, a pruned trial stops there.

The driver writes `tune.json` into a trial's run directory before it submits
the run. The job (pdmctl.job) wraps its tracker with `trial_tracker`; at every
point where the objective's metrics are logged, the wrapper reports the value
to the trial and asks the study's pruner, and raises `Pruned` when the trial
should stop. The decision is made inside the job, against the study's storage,
so it works wherever the job runs (a SLURM node included); the driver never
has to reach the process. Nothing here imports Optuna unless a run is a trial.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

TRIAL_FILE = "tune.json"
PRUNERS = ("median", "hyperband", "none")
OPTUNA_SCHEMA = "pdmctl_optuna"  # PostgreSQL: Optuna's tables (and its alembic version) apart from MLflow's


class Pruned(Exception):
    """Raised from a trial's tracker at an evaluation point: the study's pruner stopped the trial."""


@dataclass(frozen=True)
class TrialLink:
    """What a job needs to report to its trial (the run directory's tune.json)."""

    storage: str
    study: str
    trial_id: int
    objective: tuple[str, ...]  # the metrics whose mean is the objective at an evaluation point
    pruner: str
    reports: bool = True  # the trial's first seed reports; its other seeds only stop once it is pruned
    final_step: int | None = None  # the run's last step: its evaluation there is reported, not pruned

    def write(self, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = run_dir / f"{TRIAL_FILE}.tmp{os.getpid()}"
        tmp.write_text(json.dumps(asdict(self)))
        os.replace(tmp, run_dir / TRIAL_FILE)

    @classmethod
    def read(cls, run_dir: Path) -> TrialLink | None:
        path = run_dir / TRIAL_FILE
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        return cls(**{**data, "objective": tuple(data["objective"])})


def open_storage(url: str):
    """Optuna's RDB storage; SQLite waits for the jobs' writes, PostgreSQL keeps to its own schema."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if url.startswith("sqlite"):
        kwargs: dict[str, Any] = {"connect_args": {"timeout": 60}}
    elif url.startswith("postgresql"):
        kwargs = {"connect_args": {"options": f"-csearch_path={OPTUNA_SCHEMA}"}}
    else:
        kwargs = {}
    return optuna.storages.RDBStorage(url, engine_kwargs=kwargs)


def make_pruner(name: str):
    """The study's pruner. The job builds the same one from the name, so both decide alike."""
    import optuna

    if name == "median":
        # step 0 is the base model's evaluation: the same for every trial, so no evidence yet
        return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1)
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=1, reduction_factor=3)
    return optuna.pruners.NopPruner()


def objective_value(metrics: Mapping[str, float], names: Sequence[str]) -> float | None:
    """The objective at one point: the mean of its metrics, when all of them are there."""
    if not names or any(n not in metrics for n in names):
        return None
    return sum(float(metrics[n]) for n in names) / len(names)


class TrialTracker:
    """The job's tracker with the trial's reporting on top (everything else passes through)."""

    def __init__(self, inner: Any, link: TrialLink) -> None:
        self.inner = inner
        self.link = link
        self._trial: Any = None

    def __getattr__(self, name: str) -> Any:  # uri, run_id, copy_metrics ...: the ledger tracker's
        return getattr(self.inner, name)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.inner.log_metrics(metrics, step)
        value = objective_value(metrics, self.link.objective)
        if value is not None:
            self._report(value, step)

    def report_evaluation(self, metrics: Mapping[str, float], step: int) -> None:
        """An evaluation a backend logs by itself (VeRL into MLflow): reported to the trial, not logged."""
        value = objective_value(metrics, self.link.objective)
        if value is not None:
            self._report(value, step)

    def log_per_problem(self, dataset: str, step: int, accuracies: Sequence[float], **samples: Any) -> None:
        self.inner.log_per_problem(dataset, step, accuracies, **samples)

    def _report(self, value: float, step: int) -> None:
        import optuna

        if self._trial is None:
            study = optuna.load_study(
                study_name=self.link.study,
                storage=open_storage(self.link.storage),
                pruner=make_pruner(self.link.pruner),
                sampler=optuna.samplers.RandomSampler(),  # the job samples nothing
            )
            self._trial = optuna.trial.Trial(study, self.link.trial_id)
        state = self._trial.study._storage.get_trial(self.link.trial_id).state
        if state == optuna.trial.TrialState.PRUNED:
            raise Pruned(f"step {step}: the trial was pruned")
        if state != optuna.trial.TrialState.RUNNING or not self.link.reports:
            return  # told already (a run resumed by hand after its trial ended), or another seed reports
        self._trial.report(value, step)
        if self.link.final_step is not None and step >= self.link.final_step:
            return  # the run has trained to its end: its value is the trial's, whatever a rung says
        if self._trial.should_prune():
            raise Pruned(f"step {step}: objective {value:.4g}")


def trial_tracker(tracker: Any, run_dir: Path) -> Any:
    """The tracker a job hands its backend: the ledger's, reporting to the trial where the run is one."""
    link = TrialLink.read(run_dir)
    return tracker if link is None else TrialTracker(tracker, link)
