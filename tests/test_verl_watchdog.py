"""The stall watchdog judges progress, not prints: `jobbody._run_trainer` on real child
processes that stand for the trainer, with a limit of 2 s in place of a preset's minutes."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from pdmctl.backends.verl import checkpoints, jobbody, launch, progress

LIMIT_S = 2.0
REPO = Path(__file__).resolve().parents[1]


def _child(tmp_path: Path, body: str) -> list[str]:
    script = tmp_path / "trainer.py"
    script.write_text(f"import sys, time\nsys.path.insert(0, {str(REPO)!r})\n{body}")
    return [sys.executable, str(script)]


def _env() -> dict[str, str]:
    return {progress.EVERY_ENV: "0.2"}  # a worker reports at most every 0.2 s here (30 s by default)


def test_a_rollout_silent_for_longer_than_the_limit_is_not_ended_while_it_generates(tmp_path: Path) -> None:
    """A vLLM server prints nothing of its own while it generates (VeRL's disable_log_stats); the tokens it
    generates are its progress (`progress.add`, as topk's patch counts them): 3x the limit, not ended."""
    command = _child(tmp_path, "from pdmctl.backends.verl import progress\n"
                               "print('start-up', flush=True)\n"
                               "end = time.monotonic() + 4.5\n"
                               "while time.monotonic() < end:\n"
                               "    progress.add('tokens', 7)\n"
                               "    time.sleep(0.05)\n")  # fmt: skip
    seen: list[str] = []
    started = time.monotonic()
    jobbody._run_trainer(command, _env(), on_line=seen.append, stall_s=LIMIT_S)
    assert time.monotonic() - started >= 4.5  # over twice the limit without a line of its own
    reports = [line for line in seen if line.startswith(f"{progress.PREFIX} tokens=")]
    assert len(reports) >= 10 and not [line for line in seen if not line.startswith((progress.PREFIX, "start-up"))]


def test_a_checkpoint_written_in_silence_is_progress(tmp_path: Path) -> None:
    """A save prints nothing for minutes at scale: its files growing on disk count (the keeper sees them)."""
    root = tmp_path / "checkpoints"
    command = _child(tmp_path, f"from pathlib import Path\n"
                               f"actor = Path({str(root)!r}) / 'global_step_1' / 'actor'\n"
                               f"actor.mkdir(parents=True)\n"
                               f"print('step:0 - val:1', flush=True)\n"
                               f"for i in range(35):\n"
                               f"    (actor / f'shard-{{i}}.pt').write_bytes(b'x' * 100)\n"
                               f"    time.sleep(0.1)\n")  # fmt: skip
    keeper = checkpoints.Keeper(root, 2, say=lambda _: None)
    keeper_watch = keeper.watch  # it looks every 0.3 s here (2 s, and sums a save's bytes every 10 s, in a job)
    keeper.watch = lambda interval_s=checkpoints.WATCH_S, on_progress=None: keeper_watch(0.3, on_progress, 0.3)  # type: ignore[method-assign]
    jobbody._run_trainer(command, _env(), stall_s=LIMIT_S, keeper=keeper)  # 3.5 s of silence: not ended


@pytest.mark.parametrize(
    ("case", "body"),
    [
        # prints all the time (Ray's warnings about resources it waits for), and makes no progress
        ("chatter", "print('step:1 - x:1', flush=True)\n"
                    "while True:\n"
                    "    print('(autoscaler) Warning: the following resource request cannot be scheduled', flush=True)\n"
                    "    time.sleep(0.1)\n"),
        # reports the same count again and again: no progress (a report counts where its count moved)
        ("same count", "while True:\n"
                       "    print('pdmctl-progress tokens=40 host=h pid=1', flush=True)\n"
                       "    time.sleep(0.1)\n"),
        # a worker died inside a collective: silence after its last progress
        ("hang", "from pdmctl.backends.verl import progress\n"
                 "progress.add('microbatches')\n"
                 "print('RuntimeError: a worker died', flush=True)\n"
                 "time.sleep(600)\n"),
    ],
    ids=["chatter", "same count", "hang"],
)  # fmt: skip
def test_a_real_hang_is_ended_within_the_limit(tmp_path: Path, case: str, body: str) -> None:
    started = time.monotonic()
    with pytest.raises(jobbody.EngineJobError, match=r"made no progress for 2 s \(the last: ") as raised:
        jobbody._run_trainer(_child(tmp_path, body), _env(), stall_s=LIMIT_S)
    elapsed = time.monotonic() - started
    assert elapsed < LIMIT_S + 3, f"{case}: ended after {elapsed:.1f} s"
    if case == "hang":
        assert "the last: microbatches=1 on " in str(raised.value) and "RuntimeError: a worker died" in str(raised.value)


def test_start_up_lines_count_until_the_first_progress_and_silence_then_ends_it(tmp_path: Path) -> None:
    command = _child(tmp_path, "for i in range(15):\n"
                               "    print(f'loading weights {i}', flush=True)\n"
                               "    time.sleep(0.2)\n"
                               "time.sleep(600)\n")  # fmt: skip
    started = time.monotonic()
    with pytest.raises(jobbody.EngineJobError, match=r"\(in start-up: no progress yet, and no line either\)"):
        jobbody._run_trainer(command, _env(), stall_s=LIMIT_S)
    assert 3 <= time.monotonic() - started < 3 + LIMIT_S + 3  # 3 s of start-up lines were not a stall


def test_the_limit_is_the_presets_unless_the_profile_or_the_user_says(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(jobbody.STALL_ENV, raising=False)
    assert jobbody.stall_seconds(launch.MODEL_PRESETS["qwen3-30b-a3b-base"]) == 2400
    assert jobbody.stall_seconds(launch.MODEL_PRESETS["qwen3-4b-base"]) == 1200
    assert jobbody.stall_seconds() == jobbody.DEFAULT_STALL_S
    monkeypatch.setenv(jobbody.STALL_ENV, "90")  # what the profile's engine_stall_s exports
    assert jobbody.stall_seconds(launch.MODEL_PRESETS["qwen3-30b-a3b-base"]) == 90


def test_the_watchdog_reads_reports_through_rays_prefix_and_dedup() -> None:
    now = [0.0]
    dog = progress.Watchdog(10, clock=lambda: now[0])
    now[0] = 5
    assert dog.line("(pid=1) loading") is False and not dog.started  # start-up: the line resets the clock
    assert dog.line("(AsyncvLLMServer pid=7, ip=10.0.0.2) pdmctl-progress tokens=100 host=n1 pid=7") is True
    assert dog.line("(AsyncvLLMServer pid=8) pdmctl-progress tokens=50 host=n2 pid=8 [repeated 3x across cluster]")
    assert dog.line("(AsyncvLLMServer pid=7) pdmctl-progress tokens=100 host=n1 pid=7") is False
    assert dog.line("\x1b[36m(TaskRunner pid=3)\x1b[0m step:4 - actor/loss:0.1") is True  # Ray's colours
    assert dog.line("(TaskRunner pid=3) step:4 - val-core/aime24/acc/mean@16:0.2") is False
    now[0] = 14
    assert not dog.stalled()
    now[0] = 16
    assert dog.line("(raylet) Warning: resource demand not satisfied") is False and dog.stalled()
