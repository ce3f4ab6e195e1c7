"""A run's VeRL checkpoints bounded across attempts: `checkpoints.plan` on the cases,
`Keeper` on real directory trees laid out as VeRL 0.9.1 writes them, four attempts in a row."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdmctl.backends.verl import checkpoints
from pdmctl.backends.verl.checkpoints import Checkpoint, Keeper, plan


def _complete(*steps: int) -> list[Checkpoint]:
    return [Checkpoint(s, True, True) for s in steps]


def test_plan_keeps_the_newest_complete_ones_and_the_trackers() -> None:
    assert plan(_complete(1, 2, 3, 4, 5), 5, 2, trainer_running=False).delete == (1, 2, 3)
    assert plan(_complete(1, 2, 3, 4, 5), 5, 2, trainer_running=False).keep == (5, 4)
    assert plan(_complete(1, 2), 2, 3, trainer_running=False).delete == ()
    # keep 1: only the tracker's (the one the next attempt resumes from)
    assert plan(_complete(3, 4), 4, 1, trainer_running=True).delete == (3,)


def test_plan_never_deletes_the_trackers_checkpoint_even_when_newer_ones_exist() -> None:
    # killed mid-save of 6 and 7 (no tracker moved): 5 is what resume reads; before an attempt the partial
    # saves go (never kept as the newest), 5 and 4 stay
    found = [*_complete(3, 4, 5), Checkpoint(6, True, False), Checkpoint(7, True, False)]
    decided = plan(found, 5, 2, trainer_running=False)
    assert decided.delete == (3, 6, 7) and decided.keep == (5, 4)
    # a partial one counts for nothing even where its files look complete: the tracker is written last
    assert plan([*_complete(4, 5), Checkpoint(6, True, True)], 5, 2, trainer_running=False).delete == (6,)


def test_plan_while_a_save_is_in_progress_leaves_it_and_makes_room_for_it() -> None:
    found = [*_complete(1, 2, 3), Checkpoint(4, True, False)]
    decided = plan(found, 3, 3, trainer_running=True)
    assert decided.delete == (1,) and decided.keep == (3, 2)  # 3 complete + the save = 3 at the end
    assert plan(found, 3, 1, trainer_running=True).delete == (1, 2)  # keep 1: the tracker's stays (2 meanwhile)


def test_plan_drops_what_veRLs_rotation_half_removed() -> None:
    # VeRL's own rotation removes global_step_K/actor and leaves global_step_K/data.pt
    found = [Checkpoint(1, False, True), Checkpoint(2, False, True), *_complete(3, 4)]
    assert plan(found, 4, 3, trainer_running=True).delete == (1, 2)


def test_plan_deletes_nothing_where_nothing_is_known_complete() -> None:
    assert plan(_complete(1, 2, 3), None, 1, trainer_running=False).delete == ()
    assert "no latest_checkpointed_iteration.txt" in plan(_complete(1), None, 1, trainer_running=False).note
    gone = plan(_complete(1, 2), 3, 1, trainer_running=False)
    assert gone.delete == () and "global_step_3 is absent" in gone.note
    half = plan([*_complete(1), Checkpoint(2, True, False)], 2, 1, trainer_running=False)
    assert half.delete == () and "incomplete" in half.note
    with pytest.raises(ValueError):
        plan([], 1, 0, trainer_running=False)


def _save(root: Path, step: int, *, complete: bool = True) -> None:
    """What VeRL 0.9.1's `_save_checkpoint` writes, in its order: the actor's shards, data.pt, the tracker."""
    actor = root / f"global_step_{step}" / "actor"
    actor.mkdir(parents=True)
    (actor / "model_world_size_1_rank_0.pt").write_bytes(b"w" * 64)
    if complete:
        (actor.parent / "data.pt").write_bytes(b"d")
        (root / checkpoints.TRACKER).write_text(str(step))


def _on_disk(root: Path) -> list[int]:
    return sorted(c.step for c in checkpoints.scan(root))


def test_four_attempts_with_keep_2_end_with_2_and_never_hold_more(tmp_path: Path) -> None:
    """VeRL's in-memory rotation forgets earlier attempts; the keeper does not. Each attempt: prune before it
    starts, saves with a prune at the save's start and end (as the watch thread sees them), one attempt
    killed mid-save. At no point more than 2 `global_step_*`; at the end the 2 newest complete ones."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    said: list[str] = []
    keeper = Keeper(root, 2, say=said.append)
    most = 0
    step = 0
    for attempt in range(4):
        keeper.prune(trainer_running=False)
        most = max(most, len(_on_disk(root)))
        for _ in range(3):
            step += 1
            killed = attempt == 1 and _ == 2
            _save(root, step, complete=False)  # the save begins: its directory appears
            keeper.prune(trainer_running=True)
            most = max(most, len(_on_disk(root)))
            if killed:
                break
            (root / f"global_step_{step}" / "data.pt").write_bytes(b"d")
            (root / checkpoints.TRACKER).write_text(str(step))
            keeper.prune(trainer_running=True)
            most = max(most, len(_on_disk(root)))
        if killed:  # the next attempt resumes from the tracker's step and saves the same step again
            keeper.stop()
            assert checkpoints.read_latest(root) == step - 1 and step in _on_disk(root)
            step -= 1
    keeper.prune(trainer_running=False)
    assert most == 2
    assert _on_disk(root) == [step - 1, step] and checkpoints.read_latest(root) == step
    assert any("removed global_step_" in line for line in said), said
    assert not list(root.glob(".pdmctl-deleting-*"))


def test_the_keeper_resumes_a_removal_that_was_cut_short_and_counts_a_save_as_progress(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        _save(root, step)
    (root / ".pdmctl-deleting-global_step_0").mkdir()  # a job killed while it removed one
    keeper = Keeper(root, 2, say=lambda _: None)
    assert keeper.prune(trainer_running=False) == [1]
    assert sorted(p.name for p in root.iterdir()) == ["global_step_2", "global_step_3", checkpoints.TRACKER]
    assert keeper.saving() is None
    _save(root, 4, complete=False)
    assert keeper.saving() == (4, 64)


@pytest.mark.verl  # imports VeRL's checkpoint manager (seconds, shared with the other VeRL tests of the process)
def test_veRLs_own_rotation_learns_what_earlier_attempts_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """VeRL 0.9.1's real `BaseCheckpointManager` rotation, patched (`checkpoints.install`), in a resumed
    attempt: it deletes what the attempt before kept before it saves (at most N at any moment), removes
    `global_step_K/` whole, and with N = 1 never the tracker's checkpoint."""
    base = pytest.importorskip("verl.utils.checkpoint.checkpoint_manager").BaseCheckpointManager
    for name in ("ensure_checkpoint_capacity", "register_checkpoint", "remove_previous_save_local_path"):
        monkeypatch.setattr(base, name, getattr(base, name))  # restored after the test
    monkeypatch.setattr(checkpoints, "_PATCHED", set())
    root = tmp_path / "checkpoints"
    monkeypatch.setenv(checkpoints.DIR_ENV, str(root))
    checkpoints.install()

    def attempt(keep: int, steps: range) -> int:
        manager = object.__new__(base)  # a new process's manager: its list starts empty
        manager.previous_saved_paths, most = [], 0
        for step in steps:  # as FSDPCheckpointManager.save_checkpoint, then the trainer's tracker
            manager.previous_global_step = step
            manager.ensure_checkpoint_capacity(keep)
            _save(root, step, complete=False)
            most = max(most, len(_on_disk(root)))
            manager.register_checkpoint(str(root / f"global_step_{step}" / "actor"), keep)
            (root / f"global_step_{step}" / "data.pt").write_bytes(b"d")
            (root / checkpoints.TRACKER).write_text(str(step))
            most = max(most, len(_on_disk(root)))
        return most

    keeper = Keeper(root, 2, say=lambda _: None)
    for first in (1, 4, 7, 10):  # an attempt and three requeues, 3 saves each, N = 2
        keeper.prune(trainer_running=False)
        assert attempt(2, range(first, first + 3)) == 2 and _on_disk(root) == [first + 1, first + 2]
    # unpatched VeRL: 2, 3, 5, 6, 8, 9, 11, 12 (and global_step_K/data.pt of every step)
    assert sorted(p.name for p in root.iterdir()) == ["global_step_11", "global_step_12", checkpoints.TRACKER]
    attempt(1, range(13, 14))  # N = 1: the old one goes at register, before the tracker moves
    assert _on_disk(root) == [12, 13]  # 11 went; 12, the tracker's then, stayed
    Keeper(root, 1, say=lambda _: None).prune(trainer_running=False)
    assert _on_disk(root) == [13]
