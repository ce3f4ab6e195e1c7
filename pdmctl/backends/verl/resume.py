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

**Live progress.** Each step's `val-core/<source>/acc/mean@16` and
`critic/score/mean` are logged under pdmctl's names too (`eval/aime24`, `train/reward`, ...,
`metrics.pdmctl_metric_name`) as VeRL logs them, so `pdmctl status` (step, avg@16) and `report` see a
VeRL run while it trains; the job's copy at the end (`RunLogger.copy_metrics`) then finds every step
already there and adds none. With each validation's mean goes its per-problem record (`perproblem.py`).

**Nothing lost to a tracking-server outage.** Where the job names the run's spool
(`PDMCTL_SPOOL_DIR`), a step is not sent by VeRL's adapter (three tries without a wait, then dropped):
it is appended to the spool on the run's disk and sent from there, in order (`ledger.spool`); what the
server does not confirm stays there and goes out with a later step, at VeRL's `finish`, by the job after
the trainer, by the next attempt or by `pdmctl resume`. VeRL's `Tracking` does not start until the server
answers (backoff, for `PDMCTL_TRACKING_WAIT_S`, 900 s), and a VeRL whose MLflow logger did not start
anyway ("Proceeding without MLflow tracking") is stopped with that reason: a run never trains untracked.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pdmctl import preflight, testhooks, wayout
from pdmctl.backends.verl import perproblem
from pdmctl.backends.verl.checkpoints import DIR_ENV
from pdmctl.backends.verl.metrics import pdmctl_metric_name
from pdmctl.backends.verl.topk import check_verl_version
from pdmctl.ledger.spool import SPOOL_DIR_ENV, Spool, SpoolError, quick_http, wait_seconds

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


def _spool() -> Any:
    """The run's spool (`ledger.spool.Spool`) where the job named one, else None."""
    directory = os.environ.get(SPOOL_DIR_ENV)
    if not directory:
        return None
    return Spool(directory, os.environ.get("MLFLOW_TRACKING_URI", ""), os.environ["MLFLOW_RUN_ID"])


def wait_for_tracking(uri: str, run_id: str, limit_s: float | None = None) -> None:
    """Until the tracking server answers for the run (backoff 1 s doubling to 60 s), for at most
    `limit_s` (`PDMCTL_TRACKING_WAIT_S`); RuntimeError naming the server and the last error after that."""
    import time

    from pdmctl.ledger.store import _mlflow_client
    from pdmctl.ledger.uris import _first_line, _redact

    limit = wait_seconds() if limit_s is None else limit_s
    started, wait, said = time.monotonic(), 1.0, False
    while True:
        try:
            with quick_http():
                _mlflow_client(uri).get_run(run_id)
            if said:
                print(f"pdmctl: tracking server {_redact(uri)} answers", flush=True)
            return
        except Exception as exc:
            error = _first_line(exc)[:300]
        waited = time.monotonic() - started
        if waited >= limit:
            raise RuntimeError(f"pdmctl: tracking server {_redact(uri)} did not answer for {waited:.0f} s "
                               f"({error}); VeRL does not train without tracking")  # fmt: skip
        if not said:
            print(f"pdmctl: tracking server {_redact(uri)} does not answer ({error}); waiting up to "
                  f"{limit:.0f} s before the trainer starts", flush=True)  # fmt: skip
            said = True
        time.sleep(min(wait, max(0.0, limit - waited)))
        wait = min(wait * 2, 60.0)


def _numbers(data: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in data.items():
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            continue  # what MLflow's log_metrics would refuse too
    return out


@contextlib.contextmanager
def _params_stay_the_first_attempts(run_id: str) -> Iterator[None]:
    """VeRL's `Tracking` logs the trainer's whole config as the run's params at every start, and MLflow
    refuses a param whose value changed: a resumed attempt whose command differs (pdmctl sets
    `trainer.val_before_train=false` where the validation before training would add nothing) would lose
    its tracking. Here only the keys the run does not hold yet are logged; the first attempt's values
    stay, and the keys whose value differs are named once."""
    import mlflow

    original = mlflow.log_params

    @functools.wraps(original)
    def log_params(params: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        logged = mlflow.tracking.MlflowClient().get_run(run_id).data.params
        changed = sorted(k for k, v in params.items() if k in logged and str(v) != logged[k])
        if changed:
            print(f"pdmctl: this attempt's config differs from the run's params in {', '.join(changed)}: "
                  "the params stay the first attempt's", flush=True)  # fmt: skip
        fresh = {k: v for k, v in params.items() if k not in logged}
        return original(fresh, *args, **kwargs) if fresh else None

    mlflow.log_params = log_params
    try:
        yield
    finally:
        mlflow.log_params = original


@contextlib.contextmanager
def _start_run_reuses_the_active_run() -> Iterator[None]:
    """VeRL's `Tracking` tries MLflow's start three times (`start_run(run_id)`, then `log_params`): when a
    try fails after its `start_run` (a `log-batch` of the config past the timeout), the run is active and
    every later `start_run(run_id)` fails with "already active", so VeRL trains on without MLflow (pdmctl
    then ends it). Here a `start_run` for the run already active in this process returns that run."""
    import mlflow

    original = mlflow.start_run

    @functools.wraps(original)
    def start_run(*args: Any, **kwargs: Any) -> Any:
        active = mlflow.active_run()
        if active is not None and kwargs.get("run_id") == active.info.run_id and not args:
            return active
        return original(*args, **kwargs)

    mlflow.start_run = start_run
    try:
        yield
    finally:
        mlflow.start_run = original


def _checkpointed(checkpoint_dir: Path) -> int | None:
    """The step of VeRL's newest checkpoint (its tracker file), None where there is none."""
    try:
        return int((checkpoint_dir / "latest_checkpointed_iteration.txt").read_text().strip())
    except (OSError, ValueError):
        return None


def _wait_for_the_end(limit_s: float = 600.0) -> None:
    """Hold the trainer still while its job requeues (the job ends it); said if the job never does."""
    import time

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        time.sleep(1.0)
    print(f"pdmctl: the job did not requeue within {limit_s:.0f} s of the checkpoint on the way out", flush=True)


def _save_on_the_way_out() -> None:
    """In the trainer: VeRL's check for a checkpoint before its instance expires also answers the job's signal
    (pdmctl.wayout), so that VeRL saves at the end of the step under way (the V0 trainer, ray_trainer)."""
    import sys

    trainer = sys.modules.get("verl.trainer.ppo.ray_trainer")
    checkpoint_dir = os.environ.get(DIR_ENV)
    if trainer is None or not checkpoint_dir or not hasattr(trainer, "should_save_ckpt_esi"):
        return
    if not getattr(trainer.should_save_ckpt_esi, "_pdmctl", False):
        check = wayout.save_before_expiry(trainer.should_save_ckpt_esi, Path(checkpoint_dir).parent)
        check._pdmctl = True  # type: ignore[attr-defined]
        trainer.should_save_ckpt_esi = check


def install() -> None:
    """Wrap `verl.utils.tracking`'s `Tracking` and `_MlflowLoggingAdapter` (written against VeRL 0.9.1)."""
    global _INSTALLED
    if _INSTALLED or not os.environ.get("MLFLOW_RUN_ID"):
        return
    check_verl_version()
    from verl.utils import tracking

    adapter = tracking._MlflowLoggingAdapter
    original = adapter.log
    original_init = adapter.__init__
    original_tracking_init = tracking.Tracking.__init__

    @functools.wraps(original_tracking_init)
    def tracking_init(self: Any, project_name: Any, experiment_name: Any, default_backend: Any = "console",
                      config: Any = None) -> None:  # fmt: skip
        wanted = "mlflow" in default_backend
        if wanted:
            wait_for_tracking(os.environ.get("MLFLOW_TRACKING_URI", ""), os.environ["MLFLOW_RUN_ID"])
            perproblem.install()  # the trainer's module is imported by now (fit() makes this logger)
            _save_on_the_way_out()
        with _start_run_reuses_the_active_run(), _params_stay_the_first_attempts(os.environ["MLFLOW_RUN_ID"]):
            original_tracking_init(self, project_name, experiment_name, default_backend, config)
        if wanted and "mlflow" not in getattr(self, "logger", {}):
            detach()  # a run MLflow started here stays as the job leaves it (MLflow's exit would end it FINISHED)
            raise RuntimeError("pdmctl: VeRL's MLflow logger did not start (VeRL would proceed without MLflow "
                               "tracking); the run does not train untracked")  # fmt: skip

    def detach() -> None:
        """Leave the run without a word to the store: the pdmctl job sets the final status. A status written
        here could land after the job's (a TaskRunner slow to exit, on a busy machine: a failed run read
        RUNNING in CI), so MLflow's `end_run` is kept from its one write while it pops the active run."""
        import mlflow
        from mlflow.tracking import MlflowClient

        if mlflow.active_run() is None:
            return
        set_terminated = MlflowClient.set_terminated
        MlflowClient.set_terminated = lambda *args, **kwargs: None  # type: ignore[method-assign]
        try:
            mlflow.end_run()
        finally:
            MlflowClient.set_terminated = set_terminated  # type: ignore[method-assign]

    def send_spool(self: Any, wait: bool) -> None:
        spool = getattr(self, "_pdmctl_spool", None)
        if spool is None:
            return
        try:  # the job waits the whole PDMCTL_TRACKING_WAIT_S after the trainer; VeRL's end waits a minute
            spool.flush(min(60.0, wait_seconds())) if wait else spool.send(force=True)
        except SpoolError as exc:  # the job sends it after the trainer (and fails with this if it cannot)
            print(f"pdmctl: {exc}", flush=True)

    @functools.wraps(original_init)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        import atexit

        original_init(self, *args, **kwargs)
        self._pdmctl_spool = _spool()
        atexit.register(detach)  # after MLflow's own (registered at start_run), so it runs first
        atexit.register(send_spool, self, False)  # before detach (atexit runs last-registered first)

    def finish(self: Any) -> None:
        send_spool(self, True)
        detach()

    @functools.wraps(original)
    def log(self: Any, data: dict[str, Any], step: int) -> Any:
        import mlflow

        spool = getattr(self, "_pdmctl_spool", None)
        logged = getattr(self, "_pdmctl_logged", None)
        if logged is None:
            if spool is not None:  # what an earlier attempt left unsent goes first, and counts as logged
                spool.flush()
            active = mlflow.active_run()
            run_id = active.info.run_id if active else os.environ["MLFLOW_RUN_ID"]
            logged = self._pdmctl_logged = logged_steps(mlflow.tracking.MlflowClient(), run_id)
            self._pdmctl_resumed = bool(logged)
            if logged:
                print(f"pdmctl: resumed into MLflow run {run_id}: steps up to "
                      f"{max(logged.values())} already logged are not logged again", flush=True)  # fmt: skip
        fresh = {self._sanitize_key(key): value for key, value in data.items()
                 if step > logged.get(self._sanitize_key(key), -1)}  # fmt: skip
        for key, value in list(fresh.items()):  # pdmctl's names as they are logged: status reads them live
            name = pdmctl_metric_name(key)
            if name is not None and step > logged.get(name, -1):
                fresh[name] = value
        fresh = _numbers(fresh)
        if step >= 1 and fresh and not getattr(self, "_pdmctl_timed", False):  # this attempt's first step
            self._pdmctl_timed = True
            fresh.update(preflight.timings(None, first=True))
        if not fresh:
            return None
        per_problem = [(name.removeprefix("eval/"), record) for name in fresh if name.startswith("eval/")
                       and (record := perproblem.take(name.removeprefix("eval/"))) is not None]  # fmt: skip
        if spool is None:
            result = original(self, fresh, step)
            client = mlflow.tracking.MlflowClient()
            for dataset, record in per_problem:
                client.log_dict(os.environ["MLFLOW_RUN_ID"], {"step": step, **record},
                                perproblem.artifact_path(dataset, step))  # fmt: skip
        else:
            result = None
            spool.add_metrics(fresh, step)
            for dataset, record in per_problem:
                spool.add_artifact(perproblem.artifact_path(dataset, step), {"step": step, **record})
            behind = spool.send()
            if behind and not getattr(self, "_pdmctl_behind", 0):
                print(f"pdmctl: tracking server does not confirm ({spool.last_error}); {behind} entries kept in "
                      f"{spool.journal}, sent when it answers", flush=True)  # fmt: skip
            elif not behind and getattr(self, "_pdmctl_behind", 0):
                print("pdmctl: tracking server answers again; every kept entry is sent", flush=True)
            self._pdmctl_behind = behind
        for key in fresh:  # on disk (spool) or confirmed (VeRL's own call): a later log skips the step
            logged[key] = step
        hold_if_asked(step, fresh_run=not getattr(self, "_pdmctl_resumed", True))
        if os.environ.get(DIR_ENV):  # a preflight run's requeue, after the checkpoint of its step
            run_dir = Path(os.environ[DIR_ENV]).parent
            preflight.requeue_if_asked(step, not getattr(self, "_pdmctl_resumed", True), run_dir)
            if wayout.answer_if_flagged(step, run_dir, _checkpointed(Path(os.environ[DIR_ENV]))):
                _wait_for_the_end()  # the job requeues on the line just printed, and ends this trainer
        return result

    tracking.Tracking.__init__ = tracking_init
    adapter.__init__ = init
    adapter.log = log
    adapter.finish = finish
    _INSTALLED = True
