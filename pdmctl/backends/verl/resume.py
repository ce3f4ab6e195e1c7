"""A resumed VeRL job logs no step twice into its MLflow run.

VeRL saves a checkpoint *before* it logs that step's metrics, and on resume it
validates again at the checkpoint's step. A job killed between checkpoint N and
checkpoint N + save_freq has logged steps N+1.. that the resumed job runs again, and
the resumed job's first validation repeats step N's. MLflow appends a second value at
the same step (its history keeps both), so the report would average a lost
trajectory with the resumed one.

`install()` (run by the plugin on `import verl` in every process; only the
TaskRunner logs) wraps VeRL's MLflow adapter: the first time it logs into a run,
it reads the last step of every metric already there, and from then on drops a
metric at a step not after that one. What was logged first stays: a step the
killed job logged (up to `save_freq - 1` of them) keeps that job's value.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from pdmctl.backends.verl.topk import check_verl_version

_INSTALLED = False


def logged_steps(client: Any, run_id: str) -> dict[str, int]:
    """metric key -> the last step already logged in the run (empty for a new run)."""
    run = client.get_run(run_id)
    return {key: max((m.step for m in client.get_metric_history(run_id, key)), default=-1)
            for key in run.data.metrics}  # fmt: skip


def install() -> None:
    """Wrap `verl.utils.tracking._MlflowLoggingAdapter.log` (written against VeRL 0.9.1)."""
    global _INSTALLED
    if _INSTALLED or not os.environ.get("MLFLOW_RUN_ID"):
        return
    check_verl_version()
    from verl.utils import tracking

    adapter = tracking._MlflowLoggingAdapter
    original = adapter.log

    @functools.wraps(original)
    def log(self: Any, data: dict[str, Any], step: int) -> Any:
        import mlflow

        logged = getattr(self, "_pdmctl_logged", None)
        if logged is None:
            active = mlflow.active_run()
            run_id = active.info.run_id if active else os.environ["MLFLOW_RUN_ID"]
            logged = self._pdmctl_logged = logged_steps(mlflow.tracking.MlflowClient(), run_id)
            if logged:
                print(f"pdmctl: resumed into MLflow run {run_id}: steps up to "
                      f"{max(logged.values())} already logged are not logged again", flush=True)  # fmt: skip
        fresh = {key: value for key, value in data.items()
                 if step > logged.get(self._sanitize_key(key), -1)}  # fmt: skip
        for key in fresh:
            logged[self._sanitize_key(key)] = step
        if not fresh:
            return None
        return original(self, fresh, step)

    adapter.log = log
    _INSTALLED = True
