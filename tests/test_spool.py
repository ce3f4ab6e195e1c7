"""No metric lost to a tracking-server outage: the run's spool against the CI's real
MLflow server (PostgreSQL-backed, `.ci/mlflow_server_up.sh`).

The outage is made between the client and the server: the client talks to the server through a TCP
relay in this process, which the test closes (connections refused, open ones cut, as when the server
restarts) and opens again. The server itself is shared with the tests that run beside these (the SLURM
lane's jobs log into it), so it is never stopped here; and a fresh `mlflow server` takes 70-90 s to
answer on this machine under load, where the relay takes milliseconds.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from pdmctl.ledger import load_per_problem
from pdmctl.ledger.spool import Spool, SpoolError, flush_run

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def mlflow_server() -> str:
    if shutil.which("pg_ctlcluster") is None:
        pytest.skip("no PostgreSQL here (pg_ctlcluster absent)")
    pytest.importorskip("psycopg2")
    proc = subprocess.run([str(REPO / ".ci" / "mlflow_server_up.sh")], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"mlflow_server_up.sh failed: {proc.stderr[-2000:]}")
    return f"http://127.0.0.1:{os.environ.get('MLFLOW_PORT', '5055')}"


class Relay:
    """A TCP relay to the server that can be closed (refuses and cuts connections) and opened again."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self._listener: socket.socket | None = None
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        self.up()

    def up(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            if listener is not None:
                with contextlib.suppress(OSError):
                    listener.shutdown(socket.SHUT_RDWR)
                listener.close()
            for conn in self._open:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
                conn.close()
            self._open.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b, a is client), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, request: bool) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if request:
                    self.passing(data)
                sink.sendall(data)
        for s in (source, sink):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


    def passing(self, data: bytes) -> None:
        """Sees each chunk of a request on its way to the server (a subclass may hold it)."""


class HoldingRelay(Relay):
    """A relay that holds the first request whose bytes hold `marker` for `hold_s` before passing it on:
    a server slow to answer that one call."""

    def __init__(self, upstream_port: int, marker: bytes, hold_s: float) -> None:
        self.marker, self.hold_s, self.held = marker, hold_s, 0
        super().__init__(upstream_port)

    def passing(self, data: bytes) -> None:
        with self._lock:
            hold = self.marker in data and not self.held
            self.held += hold
        if hold:
            time.sleep(self.hold_s)


def _history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


@pytest.mark.postgres
def test_what_the_server_did_not_confirm_is_kept_on_disk_and_sent_in_order_once(mlflow_server: str,
                                                                                 tmp_path: Path) -> None:  # fmt: skip
    from mlflow.tracking import MlflowClient

    server = MlflowClient(mlflow_server)  # the checks read the server directly, never through the relay
    run_id = server.create_run(server.create_experiment(f"spool-{uuid.uuid4().hex[:12]}")).info.run_id
    relay = Relay(int(mlflow_server.rsplit(":", 1)[1]))
    uri = f"http://127.0.0.1:{relay.port}"
    run_dir = tmp_path / "run"
    spool = Spool(run_dir / "spool", uri, run_id)
    try:
        spool.add_metrics({"train/reward": 0.0, "eval/aime24": 0.5}, 0)
        assert spool.send() == 0 and _history(server, run_id, "train/reward") == [(0, 0.0)]

        relay.down()  # the server goes away for steps 1-3 and a validation's per-problem record
        started = time.monotonic()
        for step in (1, 2, 3):
            spool.add_metrics({"train/reward": float(step)}, step)
            assert spool.send(force=True) == step, spool.last_error  # kept, in order, none dropped
        spool.add_metrics({"eval/aime24": 0.75}, 3)
        spool.add_artifact("per_problem/aime24/step_0000003.json", {"step": 3, "accuracies": [0.75]})
        assert spool.send(force=True) == 5
        assert time.monotonic() - started < 20, "a refused send is quick: MLflow's own retries are off"
        assert spool.send() == 5  # within the backoff: not even tried
        assert _history(server, run_id, "train/reward") == [(0, 0.0)]
        print(f"while the server was away: {len(spool.pending())} entries kept ({spool.last_error})")

        # the next attempt (a new process: a new Spool on the same disk) waits, with backoff, until it answers
        threading.Timer(3.0, relay.up).start()
        started = time.monotonic()
        Spool(run_dir / "spool", uri, run_id).flush(limit_s=120)
        print(f"sent {time.monotonic() - started:.1f} s after the server went away for 3 s")
        assert _history(server, run_id, "train/reward") == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0)]
        assert _history(server, run_id, "eval/aime24") == [(0, 0.5), (3, 0.75)]
        assert load_per_problem(mlflow_server, run_id, "aime24") == {3: [0.75]}  # what the report reads

        # once: a process that died after the server confirmed and before it wrote how far it got sends
        # everything again; each metric keeps its timestamp, so the server holds each point once
        (run_dir / "spool" / "sent").unlink()
        assert len(Spool(run_dir / "spool", uri, run_id).pending()) == 6
        assert flush_run(run_dir, uri, run_id, limit_s=30) == 6
        assert _history(server, run_id, "train/reward") == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0)]
        assert _history(server, run_id, "eval/aime24") == [(0, 0.5), (3, 0.75)]
        assert flush_run(run_dir, uri, run_id) == 0  # nothing left

        # bounded: a server that does not come back fails the flush, in one line, and keeps the entry
        relay.down()
        spool.add_metrics({"train/reward": 4.0}, 4)
        started = time.monotonic()
        with pytest.raises(SpoolError, match=r"1 entries of run \w+ not confirmed after [23] s .* kept in .*journal"):
            spool.flush(limit_s=2)
        assert time.monotonic() - started < 15
        relay.up()  # `pdmctl resume` (flush_run) or the next attempt sends it
        assert flush_run(run_dir, uri, run_id, limit_s=60) == 1
        assert _history(server, run_id, "train/reward")[-1] == (4, 4.0)
    finally:
        relay.down()


VERL_TRACKING = """
from verl.utils import tracking
from pdmctl.backends.verl import resume

resume.install()
logger = tracking.Tracking("p", "e", ["mlflow"], config={"trainer": {"total_epochs": 1, "project_name": "p"}})
print("loggers:", sorted(logger.logger))
"""


@pytest.mark.postgres
def test_verls_mlflow_start_survives_a_log_batch_past_the_timeout(mlflow_server: str, tmp_path: Path) -> None:
    """Seen in CI: VeRL's `Tracking` started MLflow's run, then its `log_params` (one `log-batch`) went
    past the 5 s timeout the `pdmctl sweep` had set for itself and its job inherited; VeRL's two further
    tries then failed on "run already active" and the trainer would have gone on without MLflow. With the
    same settings and the server's first `log-batch` held 6 s, VeRL's next try now succeeds; and a trainer
    started by a pdmctl job gets MLflow's own retries, not the command's (`without_quick_http`)."""
    pytest.importorskip("verl")
    from mlflow.tracking import MlflowClient

    server = MlflowClient(mlflow_server)
    run_id = server.create_run(server.create_experiment(f"slow-{uuid.uuid4().hex[:12]}")).info.run_id
    relay = HoldingRelay(int(mlflow_server.rsplit(":", 1)[1]), b"/runs/log-batch", 6.0)
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{relay.port}", "MLFLOW_RUN_ID": run_id,
           "PDMCTL_SPOOL_DIR": str(tmp_path / "spool"), "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
           "MLFLOW_HTTP_REQUEST_TIMEOUT": "2"}  # fmt: skip
    try:
        proc = subprocess.run([sys.executable, "-c", VERL_TRACKING], env=env, capture_output=True, text=True,
                              timeout=300)  # fmt: skip
    finally:
        relay.down()
    assert relay.held == 1, "the first log-batch was held"
    assert "MLflow initialization attempt 1/3 failed" in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loggers: ['mlflow']" in proc.stdout
    run = server.get_run(run_id)
    assert run.data.params.get("trainer/total_epochs") == "1", run.data.params

    from pdmctl.ledger.client import QUICK_HTTP_ENV, quick_http_for_this_process, without_quick_http

    names = ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT", QUICK_HTTP_ENV)
    saved = {name: os.environ.pop(name, None) for name in names}
    try:
        os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = "30"  # the user's own
        quick_http_for_this_process()  # what a ClientLedger does in a pdmctl command
        assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "0" and os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "30"
        inherited = without_quick_http(dict(os.environ))
        assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in inherited and QUICK_HTTP_ENV not in inherited
        assert inherited["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "30"
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


def test_pdmctl_resume_sends_what_a_run_kept_on_its_disk(tmp_path: Path) -> None:
    """`pdmctl resume` first sends each run's unconfirmed spool (a job that ended while the server was
    down), whether or not the run is resubmitted."""
    from pdmctl import grid, orchestrate
    from pdmctl.ledger import SqlLedger
    from pdmctl.ledger.spool import spool_of
    from tests.conftest import sqlite_uri

    uri = sqlite_uri(tmp_path)
    specs = grid.expand(["seed=0,1"], sweep="kept")
    ledger = SqlLedger(uri)
    ledger.register(specs, {s.key: str(tmp_path / "runs" / s.key) for s in specs})
    first, second = ledger.runs("kept")
    Spool(spool_of(first.run_dir), uri, first.run_id).add_metrics({"train/reward": 0.5, "eval/toy24": 0.25}, 7)
    ctx = orchestrate.make_context("local", uri)
    assert orchestrate.send_spools(ctx, "kept") == [f"{first.key}: sent 1 entries its run kept while the "
                                                    "tracking server was down"]  # fmt: skip
    (record,) = [r for r in ledger.runs("kept") if r.run_id == first.run_id]
    assert record.latest == {"train/reward": (7, 0.5), "eval/toy24": (7, 0.25)}  # status shows them
    assert orchestrate.send_spools(ctx, "kept") == []  # sent once
    assert not spool_of(second.run_dir).exists()


@pytest.mark.postgres
def test_sweep_wait_rides_out_a_tracking_server_outage(mlflow_server: str, tmp_path: Path) -> None:
    """`pdmctl sweep --wait` while the tracking server goes away for 15 s mid-run: it says the server is not
    answering and keeps waiting, as the job keeps what the server does not confirm; once the server answers
    again the sweep ends with exit 0, its run finished, every step logged once."""
    from mlflow.tracking import MlflowClient

    server = MlflowClient(mlflow_server)
    relay = Relay(int(mlflow_server.rsplit(":", 1)[1]))
    name = f"wait-{uuid.uuid4().hex[:12]}"
    cmd = [sys.executable, "-m", "pdmctl.cli", "sweep", "backend=synthetic", "model=synthetic", "backend.steps=8",
           "backend.eval_every=4", "backend.step_s=2", "--name", name, "--wait",
           "--tracking-uri", f"http://127.0.0.1:{relay.port}"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env={**env, "COLUMNS": "200"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        run_id = None
        while run_id is None or len(_history(server, run_id, "train/reward")) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            exp = server.get_experiment_by_name(name)
            runs = server.search_runs([exp.experiment_id], "tags.`pdmctl.sweep` LIKE '%'") if exp else []
            run_id = runs[0].info.run_id if runs else None
            time.sleep(0.5)
        relay.down()
        time.sleep(15)
        relay.up()
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        relay.down()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stdout + stderr
    assert "waiting for it" in stdout and "the tracking server answers again after" in stdout, stdout
    assert server.get_run(run_id).info.status == "FINISHED"
    assert [step for step, _ in _history(server, run_id, "train/reward")] == list(range(1, 9))
