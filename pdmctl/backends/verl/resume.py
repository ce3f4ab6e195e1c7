"""VeRL inside a ledger run: it logs no step twice, and it never ends the run.

**No step twice.**
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

**The job ends the run, not VeRL.** VeRL's `finish` (and MLflow's exit handler in
the TaskRunner) end the active run as FINISHED. The ledger reads that status, so
`pdmctl status` and `sweep --wait` would call the run finished while its job is
still copying VeRL's metrics to pdmctl's names, or about to record a failure. The
wrapped adapter detaches from the run leaving it RUNNING; the pdmctl job sets the
final status.

**A test's hold.** `PDMCTL_VERL_HOLD_AT_STEP=N` (tests only) keeps the TaskRunner still after
it has logged step N (its checkpoint is saved before that), in a run that had no step logged
when the job started: a requeue or a lost node then always finds the run mid-training, whatever
this machine's speed, and the resumed attempt never holds. It prints a line every 10 s (the
job's stall watchdog reads silence as a hang) and lets go after `PDMCTL_VERL_HOLD_S` (300 s).
"""

from __future__ import annotations

import functools
import os
from typing import Any

from pdmctl import testhooks
from pdmctl.backends.verl.topk import check_verl_version

_INSTALLED = False
HOLD_ENV = "PDMCTL_VERL_HOLD_AT_STEP"  # tests: hold still after logging this step (a fresh run only)
HOLD_S_ENV = "PDMCTL_VERL_HOLD_S"  # the hold's limit in seconds (300; pdmctl.testhooks)


def hold_seconds() -> float:
    return testhooks.hold_seconds(HOLD_S_ENV)


def hold_if_asked(step: int, fresh_run: bool) -> None:
    """The test's hold (pdmctl.testhooks) after step `HOLD_ENV` of a run that started fresh."""
    testhooks.hold_if_asked(step, fresh_run, HOLD_ENV, HOLD_S_ENV)


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
    original_init = adapter.__init__

    def detach() -> None:
        import mlflow

        if mlflow.active_run() is not None:
            mlflow.end_run(status="RUNNING")  # detach; the pdmctl job sets the final status

    @functools.wraps(original_init)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        import atexit

        original_init(self, *args, **kwargs)
        atexit.register(detach)  # after MLflow's own (registered at start_run), so it runs first

    def finish(self: Any) -> None:
        detach()

    @functools.wraps(original)
    def log(self: Any, data: dict[str, Any], step: int) -> Any:
        import mlflow

        logged = getattr(self, "_pdmctl_logged", None)
        if logged is None:
            active = mlflow.active_run()
            run_id = active.info.run_id if active else os.environ["MLFLOW_RUN_ID"]
            logged = self._pdmctl_logged = logged_steps(mlflow.tracking.MlflowClient(), run_id)
            self._pdmctl_resumed = bool(logged)
            if logged:
                print(f"pdmctl: resumed into MLflow run {run_id}: steps up to "
                      f"{max(logged.values())} already logged are not logged again", flush=True)  # fmt: skip
        fresh = {key: value for key, value in data.items()
                 if step > logged.get(self._sanitize_key(key), -1)}  # fmt: skip
        for key in fresh:
            logged[self._sanitize_key(key)] = step
        if not fresh:
            return None
        result = original(self, fresh, step)
        hold_if_asked(step, fresh_run=not getattr(self, "_pdmctl_resumed", True))
        return result

    adapter.__init__ = init
    adapter.log = log
    adapter.finish = finish
    _INSTALLED = True
