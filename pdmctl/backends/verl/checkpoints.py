"""A run's VeRL checkpoints bounded across attempts.

VeRL 0.9.1 keeps the list of the checkpoints it saved in memory only (`BaseCheckpointManager.
previous_saved_paths`), so a resumed attempt never deletes what earlier attempts kept: with
`max_actor_ckpt_to_keep=3` a run requeued three times holds 12. Its rotation also removes only
`global_step_K/actor`, never `global_step_K/` itself (the dataloader's `data.pt` stays). pdmctl's job
process therefore prunes the run's checkpoint directory itself: before each attempt starts and, while
the trainer runs, each time a save begins or ends (`Keeper.watch`, a thread polling every few seconds).

What VeRL writes (verl/trainer/ppo/ray_trainer.py `_save_checkpoint`): `global_step_K/actor/` (the
engine's shards: FSDP's model/optimizer/extra per rank, Megatron's dist_ckpt trees), then
`global_step_K/data.pt` (the dataloader's state), then `latest_checkpointed_iteration.txt` = K. The
tracker is written last, and resume (`trainer.resume_mode=auto`, `find_latest_ckpt_path`) reads only
it: a checkpoint is complete when its step is at most the tracker's and it has both `actor/` and
`data.pt`; one newer than the tracker is a save in progress (the trainer runs) or a save that was
killed (it does not: such a one is removed before the next attempt, never kept as the newest).

`plan` is the decision, a pure function of what is on disk; `Keeper` reads the disk and deletes.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TRACKER = "latest_checkpointed_iteration.txt"  # VeRL's: the last complete checkpoint's step, written last
STEP_DIR = re.compile(r"^global_step_(\d+)$")
_DELETING = ".pdmctl-deleting-"  # a checkpoint being removed is renamed first: its name goes at once
WATCH_S = 2.0  # how often the keeper looks while the trainer runs
SIZE_EVERY_S = 10.0  # how often it sums a save in progress's bytes (a walk of its files: thousands at scale)


@dataclass(frozen=True)
class Checkpoint:
    """One `global_step_K` directory as found on disk."""

    step: int
    has_actor: bool  # global_step_K/actor/ (the engine's shards)
    has_data: bool  # global_step_K/data.pt (written after the shards)


@dataclass(frozen=True)
class Plan:
    delete: tuple[int, ...]  # steps whose directories go
    keep: tuple[int, ...]  # complete checkpoints kept (the newest first)
    note: str = ""  # why nothing could be decided, where that is the case


def plan(found: Iterable[Checkpoint], latest: int | None, keep: int, *, trainer_running: bool) -> Plan:
    """Which `global_step_*` directories to delete so that at most `keep` are on disk.

    `latest`: the tracker's step (None: no tracker). The checkpoint at `latest` is never deleted: it is the
    last complete one and the one an attempt resumes from. Older complete ones are kept newest first up to
    `keep` in all; incomplete older ones (a rotation by VeRL that removed `actor/` and left `data.pt`) go.
    Newer than `latest`: while the trainer runs, a save in progress, left alone, and the complete ones are
    trimmed to `keep - 1` meanwhile (so the save makes `keep`, not `keep + 1`); before an attempt, a save
    that was killed midway: deleted. Without a tracker, or with a tracker naming a step whose directory is
    absent or incomplete, nothing is deleted (nothing on disk is known to be complete).
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    by_step = {c.step: c for c in found}
    if latest is None:
        return Plan((), (), f"no {TRACKER}: no checkpoint is known to be complete" if by_step else "")
    current = by_step.get(latest)
    if current is None or not (current.has_actor and current.has_data):
        return Plan((), (), f"{TRACKER} names step {latest}, and global_step_{latest} is "
                            f"{'absent' if current is None else 'incomplete'}")  # fmt: skip
    newer = sorted(s for s in by_step if s > latest)
    saving = trainer_running and bool(newer)
    limit = max(1, keep - 1) if saving else keep
    complete = sorted((s for s, c in by_step.items() if s < latest and c.has_actor and c.has_data), reverse=True)
    kept = (latest, *complete[: limit - 1])
    delete = [s for s in by_step if s < latest and s not in kept]
    if not trainer_running:
        delete += newer
    return Plan(tuple(sorted(delete)), kept)


def read_latest(directory: Path) -> int | None:
    """The tracker's step, or None where there is none (or it does not hold a step: a write cut short)."""
    try:
        text = (directory / TRACKER).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def scan(directory: Path) -> list[Checkpoint]:
    """The `global_step_*` directories in `directory`."""
    found = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    for entry in entries:
        match = STEP_DIR.match(entry.name)
        if match and entry.is_dir(follow_symlinks=False):
            path = Path(entry.path)
            found.append(Checkpoint(int(match.group(1)), (path / "actor").is_dir(), (path / "data.pt").is_file()))
    return found


class Keeper:
    """Prunes one run's checkpoint directory to `keep` checkpoints (`plan`), and says what it removed."""

    def __init__(self, directory: Path | str, keep: int, say: Callable[[str], None] = print) -> None:
        self.directory = Path(directory)
        self.keep = keep
        self.say = say
        self._last_note = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def prune(self, *, trainer_running: bool) -> list[int]:
        """Delete what `plan` says; the steps deleted."""
        for leftover in self.directory.glob(f"{_DELETING}*"):  # a removal cut short (the job was killed)
            shutil.rmtree(leftover, ignore_errors=True)
        decided = plan(scan(self.directory), read_latest(self.directory), self.keep, trainer_running=trainer_running)
        if decided.note and decided.note != self._last_note and not trainer_running:  # (a save races a look)
            self.say(f"pdmctl: checkpoints: nothing pruned in {self.directory}: {decided.note}")
        self._last_note = decided.note
        removed = []
        for step in decided.delete:
            source = self.directory / f"global_step_{step}"
            target = self.directory / f"{_DELETING}global_step_{step}"
            try:
                source.rename(target)
            except FileNotFoundError:  # VeRL's own rotation removed it meanwhile
                continue
            except OSError as exc:
                self.say(f"pdmctl: checkpoints: could not remove {source}: {exc.strerror or exc}")
                continue
            shutil.rmtree(target, ignore_errors=True)
            removed.append(step)
        if removed:
            kept = ", ".join(f"global_step_{s}" for s in sorted(decided.keep))
            why = "a save is in progress" if trainer_running and len(decided.keep) < self.keep else ""
            self.say(f"pdmctl: checkpoints: removed {', '.join(f'global_step_{s}' for s in removed)}; kept {kept} "
                     f"(at most {self.keep} a run{'; ' + why if why else ''})")  # fmt: skip
        return removed

    def saving(self) -> tuple[int, int] | None:
        """The save in progress (a checkpoint newer than the tracker): (its step, bytes written so far)."""
        latest = read_latest(self.directory)
        newer = [c.step for c in scan(self.directory) if latest is None or c.step > latest]
        if not newer:
            return None
        step = max(newer)
        written = 0
        for root, _, files in os.walk(self.directory / f"global_step_{step}"):
            for name in files:
                with contextlib.suppress(OSError):  # removed meanwhile
                    written += os.stat(os.path.join(root, name)).st_size
        return step, written

    def watch(self, interval_s: float = WATCH_S, on_progress: Callable[[str], None] | None = None,
              size_every_s: float = SIZE_EVERY_S) -> None:  # fmt: skip
        """Prune every `interval_s` seconds in a thread while the trainer runs, until `stop`; `on_progress`
        is told when a save in progress has written more (the stall watchdog counts it as progress)."""
        seen: list[tuple[int, int] | None] = [None]
        every = max(1, round(size_every_s / interval_s)) if interval_s > 0 else 1
        ticks = [0]

        def loop() -> None:
            while not self._stop.wait(interval_s):
                ticks[0] += 1
                try:
                    self.prune(trainer_running=True)
                    if on_progress is not None and ticks[0] % every == 0:  # a walk of the save's files
                        now = self.saving()
                        if now is not None and now != seen[0] and (seen[0] is None or now > seen[0]):
                            on_progress(f"checkpoint global_step_{now[0]}: {now[1]:,} bytes written")
                        seen[0] = now
                except Exception as exc:  # never end the job for a failed prune; say it
                    self.say(f"pdmctl: checkpoints: pruning failed: {type(exc).__name__}: {exc}")

        self._thread = threading.Thread(target=loop, name="pdmctl-checkpoints", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching, then prune once more as if the trainer still ran (its processes may still be
        ending: a save newer than the tracker is left to the next attempt's prune)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        try:
            self.prune(trainer_running=True)
        except Exception as exc:  # never hide how the trainer ended behind a failed prune
            self.say(f"pdmctl: checkpoints: pruning failed: {type(exc).__name__}: {exc}")


# ---------------------------------------------------------------------------
# Inside VeRL's actor processes: its own rotation, told what earlier attempts kept
# ---------------------------------------------------------------------------

_PATCHED: set[str] = set()
DIR_ENV = "PDMCTL_CHECKPOINT_DIR"  # the run's checkpoint directory (trainer.default_local_dir), for every worker


def _earlier(root: Path, step: int) -> list[str]:
    """The `actor` paths of the complete checkpoints before `step` in `root`, oldest first (what VeRL's
    in-memory list would hold had this process saved them)."""
    latest = read_latest(root)
    if latest is None:
        return []
    complete = sorted(c.step for c in scan(root) if c.step < step and c.step <= latest and c.has_actor and c.has_data)
    return [str(root / f"global_step_{s}" / "actor") for s in complete]


def install() -> None:
    """Patch VeRL 0.9.1's checkpoint managers (in the actor processes: `patches`' wrapper of the actor's
    `init_model` installs it, where the job exported the run's checkpoint directory as PDMCTL_CHECKPOINT_DIR):

    * before a process's first rotation, its list of saved checkpoints (`previous_saved_paths`) is seeded
      with the complete ones on disk, so that VeRL's own rotation deletes before a save what earlier
      attempts kept: at most `max_actor_ckpt_to_keep` on disk at any time (VeRL trims to N - 1 before
      a save when N >= 2);
    * a rotation removes `global_step_K/` whole, not only its `actor/` (VeRL leaves `data.pt`), and never
      the checkpoint the tracker names (with N = 1 VeRL removes the old one before the tracker moves to
      the new one: a job killed between the two would resume from nothing; the keeper removes it after).
    """
    root_given = os.environ.get(DIR_ENV, "").strip()
    if "managers" in _PATCHED or not root_given:
        return
    try:
        from verl.utils.checkpoint import checkpoint_manager
    except ImportError:
        return
    root = Path(os.path.abspath(root_given))
    base = checkpoint_manager.BaseCheckpointManager
    original_ensure = base.ensure_checkpoint_capacity
    original_register = base.register_checkpoint
    original_remove = base.remove_previous_save_local_path

    def seed(self: Any) -> None:
        step = getattr(self, "previous_global_step", None)  # the step being saved (set before the rotation)
        if getattr(self, "_pdmctl_seeded", False) or step is None:
            return
        self._pdmctl_seeded = True
        known = list(self.previous_saved_paths)
        self.previous_saved_paths = [p for p in _earlier(root, int(step)) if p not in known] + known

    def ensure_checkpoint_capacity(self: Any, max_ckpt_to_keep: Any) -> Any:
        seed(self)
        return original_ensure(self, max_ckpt_to_keep)

    def register_checkpoint(self: Any, new_path: str, max_ckpt_to_keep: Any) -> Any:
        seed(self)
        return original_register(self, new_path, max_ckpt_to_keep)

    def remove_previous_save_local_path(self: Any, path: Any) -> Any:
        others = []
        for p in [path] if isinstance(path, str) else list(path):
            actor = Path(os.path.abspath(p))
            match = STEP_DIR.match(actor.parent.name)
            if actor.name != "actor" or not match or actor.parent.parent != root:
                others.append(p)
                continue
            step = int(match.group(1))
            if read_latest(root) == step:  # the last complete checkpoint: kept (the keeper removes it later)
                continue
            target = root / f"{_DELETING}global_step_{step}"
            try:
                actor.parent.rename(target)
            except OSError:
                continue
            print(f"pdmctl: checkpoints: VeRL's rotation removed global_step_{step} (whole)", flush=True)
            shutil.rmtree(target, ignore_errors=True)
        return original_remove(self, others) if others else None

    base.ensure_checkpoint_capacity = ensure_checkpoint_capacity
    base.register_checkpoint = register_checkpoint
    base.remove_previous_save_local_path = remove_previous_save_local_path
    _PATCHED.add("managers")
