"""The hours spent beside the prediction (pdmctl.budget.spent): sacct's output read field by field (every time format
it writes, requeued jobs' records, AllocTRES with and without GPUs), garbage or a failing sacct falling back to
the ledger's attempt times, and the time left of a sweep that still runs."""

from __future__ import annotations

import json
import os
import stat
from datetime import UTC, datetime
from pathlib import Path

import pytest

from pdmctl.budget import spent
from pdmctl.budget.cost import Estimate, Span
from pdmctl.ledger.records import RunRecord


@pytest.mark.parametrize(("text", "seconds"), [
    ("1-02:03:04", 93784), ("00:05:06", 306), ("05:06", 306), ("05:06.123", 306.123), ("12-00:00:00", 1_036_800),
    ("00:00:00", 0), (" 01:00:00 ", 3600),
])  # fmt: skip
def test_sacct_elapsed_in_each_of_its_formats(text: str, seconds: float) -> None:
    assert spent.parse_elapsed(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "UNLIMITED", "INVALID", "Partition_Limit", "1-02", "5", "00:61:00", "ab:cd",
                                  "-1:00:00", "00:05:60", "1-2-03:04:05"])  # fmt: skip
def test_what_is_not_a_time_is_none(text: str) -> None:
    assert spent.parse_elapsed(text) is None


def test_alloc_tres_gives_gpus_and_cpus_and_a_missing_gres_is_no_gpu() -> None:
    assert spent.parse_tres("billing=64,cpu=64,gres/gpu=8,mem=512G,node=1") == (8, 64)
    assert spent.parse_tres("billing=8,cpu=8,gres/gpu:h100=4,mem=64G,node=1") == (4, 8)
    assert spent.parse_tres("cpu=8,gres/gpu=4,gres/gpu:h100=4,node=1") == (4, 8)  # the total: not twice
    assert spent.parse_tres("billing=1,cpu=1,node=1") == (0, 1)  # the testbed on SLURM: CPUs only
    assert spent.parse_tres("") == (0, 0) and spent.parse_tres("gres/gpu=x,cpu==,,=") == (0, 0)


def test_sacct_lines_keep_every_record_of_a_requeued_job_and_leave_out_what_is_not_a_record() -> None:
    text = "\n".join([
        "92_0|00:00:57|billing=1,cpu=1,node=1",
        "92_1|00:10:00|billing=8,cpu=8,gres/gpu=4,node=1",  # the first start, then SLURM requeued it (-D)
        "92_1|1-00:00:00|billing=8,cpu=8,gres/gpu=4,node=1",
        "92_[2-9%4]|00:00:00|",  # the array's pending rest
        "93|INVALID|cpu=1", "garbage", "|||", "94|00:01:00", "", "95|00:01:00|cpu=2|extra",
    ])  # fmt: skip
    found = spent.parse_sacct(text)
    assert found == {"92_0": [spent.Usage(57, 0, 1)],
                     "92_1": [spent.Usage(600, 4, 8), spent.Usage(86400, 4, 8)]}  # fmt: skip
    assert spent.parse_sacct("") == {} and spent.parse_sacct("\x00\xff|\n" * 3) == {}


def _stamp(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%S%z")


T0 = 1_800_000_000


def _record(job_ids: list[str], executor: str = "slurm") -> RunRecord:
    attempts = {f"attempt.{i}": json.dumps({"job_id": j, "started": _stamp(T0 + 3600 * (i - 1))})
                for i, j in enumerate(job_ids, 1)}  # fmt: skip
    end = T0 + 3600 * len(job_ids)
    return RunRecord("r", "s", "k", "FINISHED", len(job_ids), job_ids[-1], executor, None, "", None, None,
                     T0 * 1000, end * 1000, provenance=attempts)  # fmt: skip


def _estimate(unit: str, devices: int, expected: float = 100, low: float = 50, high: float = 200) -> Estimate:
    return Estimate(unit, devices, Span(expected, low, high), high, 1, "stated")


def test_a_run_spends_each_sacct_records_time_by_what_it_held_else_its_attempt_times() -> None:
    record = _record(["92_1", "92_1"])  # requeued: one job id, two starts, two records
    usage = spent.parse_sacct("92_1|00:10:00|cpu=8,gres/gpu=4\n92_1|00:20:00|cpu=8,gres/gpu=4\n")
    assert spent.run_spent(record, _estimate("GPU", 8), usage, now=0) == (1800 * 4, spent.FROM_SACCT)
    cpu = spent.parse_sacct("92_1|00:10:00|billing=2,cpu=2,node=1")
    assert spent.run_spent(record, _estimate("CPU", 1), cpu, now=0) == (600 * 2, spent.FROM_SACCT)
    ledger = (2 * 3600 * 8, spent.FROM_LEDGER)  # two attempts of an hour on the estimate's 8 GPUs
    assert spent.run_spent(record, _estimate("GPU", 8), cpu, now=0) == ledger  # sacct names no GPU of it
    for fallback in (None, {}, spent.parse_sacct("garbage"), spent.parse_sacct("77_0|00:01:00|gres/gpu=8")):
        assert spent.run_spent(record, _estimate("GPU", 8), fallback, now=0) == ledger
    unstarted = RunRecord("r", "s", "k", "SCHEDULED", 0, None, None, None, "", None, None, None, None)
    assert spent.run_spent(unstarted, _estimate("GPU", 8), None, now=0) is None


def test_sacct_that_fails_or_writes_garbage_falls_back_and_never_raises(tmp_path: Path, monkeypatch) -> None:
    assert spent.sacct_usage([]) is None
    assert spent.sacct_usage(["pid-12", "first", "1;rm"]) is None  # no SLURM job id among them: no call
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "sacct"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for body, expected in (("echo 'sacct: error: slurmdbd: Connection refused' >&2; exit 1", None),
                           ("head -c 3000 /dev/urandom", {}), ("printf '92_1|bad|cpu=1\\n|||\\n'", {}),
                           ("printf '92_1|00:01:00|cpu=1\\n'", {"92_1": [spent.Usage(60, 0, 1)]})):  # fmt: skip
        fake.write_text(f"#!/bin/sh\n{body}\n")
        fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
        assert spent.sacct_usage(["92_1", "92_3"]) == expected, body


def test_the_time_left_places_the_rest_of_each_running_run_then_the_queued_ones_on_the_slots() -> None:
    running = [(_estimate("GPU", 8), 30.0)]  # 70 s left (20-170)
    queued = [_estimate("GPU", 8), _estimate("GPU", 8)]
    # two slots: 70 and 100 start now, the last 100 where the 70 ends: 170 (low 20+50 = 70; high 170+200 = 370)
    assert spent.time_left(running, queued, 2) == Span(170, 70, 370)
    assert spent.time_left(running, queued, None) == Span(100, 50, 200)  # every run at once
    assert spent.time_left([], queued, 1) == Span(200, 100, 400)
    late = spent.time_left([(_estimate("GPU", 8), 500.0)], [], 4)
    assert late == Span(0, 0, 0) and "past their predicted time" in spent.left_text(late, 4)
    text = spent.left_text(Span(5400, 3600, 9000), 4)
    assert text == "about 1.5 h left (range 1.0 h-2.5 h) at 4 at a time"
