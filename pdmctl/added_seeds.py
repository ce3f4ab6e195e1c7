"""The look mark of the seeds `pdmctl seeds --submit` adds, whole whatever interrupts it.

The runs a look adds are registered in the ledger, then each is marked with the look (provenance field
`look`, which the report's group-sequential interval reads: `report.sequential.run_look`), then submitted.
Registering and marking are two writes: a Ctrl-C, a kill or a dropped SSH connection between them would
leave runs that `resume` submits as ordinary ones, and the report would give them a fixed-size interval (too
narrow: the seeds were added after looking). So, under the ledger's submission lock, the journal (the
sweep, the look, the keys of the runs it adds) is written before they are registered, and removed only
once every one of them is marked (`complete`). `seeds`, `sweep` and `resume` complete a journal that an
interrupted `seeds --submit` left, under the same lock, before they read or submit anything.

The journal lies beside the submission lock (`mlflow.db.pdmctl.seeds.json` beside a SQLite file, else in
pdmctl's cache under the tracking URI's digest): whoever shares the lock finds it.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from pdmctl.ledger import Ledger, LedgerError

LOOK_FIELD = "look"  # provenance field (ledger tag pdmctl.look; pdmctl.prov.look before) of a run added after that look


def journal_path(uri: str) -> Path:
    from pdmctl.ledger import _lock_path

    lock = _lock_path(uri)
    return lock.with_name(lock.name.removesuffix(".lock") + ".seeds.json")


def write(uri: str, sweep: str, look: int, keys: Sequence[str]) -> None:
    """Record (atomically) that the runs of `keys` are being added to `sweep` after look `look`: call it
    under the ledger's lock, before registering them."""
    path = journal_path(uri)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        json.dump({"sweep": sweep, "look": look, "keys": list(keys)}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def complete(ledger: Ledger, *, take_lock: bool = False) -> list[str]:
    """Mark every run a journal names that the ledger holds and that has no look mark yet, then remove the
    journal; the run ids marked (none when there is no journal). Call it under the ledger's lock, or with
    `take_lock` (the lock is then taken only when a journal exists)."""
    try:
        path = journal_path(ledger.uri)
        if not path.exists():
            return []
    except (LedgerError, OSError):
        if take_lock:  # no lock could be taken there either, so no journal was written: nothing to complete
            return []
        raise
    if take_lock:
        with ledger.lock():
            return complete(ledger)
    try:
        entry = json.loads(path.read_text())
        sweep, look, keys = str(entry["sweep"]), int(entry["look"]), set(map(str, entry["keys"]))
    except FileNotFoundError:  # completed by another process meanwhile
        return []
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise LedgerError(f"{path}: not a journal of added seeds as pdmctl writes it "
                          f"({type(exc).__name__}); it names the runs an interrupted `pdmctl seeds "
                          "--submit` was adding after a look: remove it to go on (any of them left unmarked "
                          "then counts as a seed of the first look)") from None
    unmarked = [r.run_id for r in ledger.runs(sweep) if r.key in keys and LOOK_FIELD not in r.provenance]
    mark(ledger.uri, unmarked, look)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    return unmarked


@contextlib.contextmanager
def marks_completed(ledger: Ledger, *, write: bool = True) -> Iterator[None]:
    """The ledger's submission lock, and under it, first, the marks a journal left undone (`complete`; not
    where nothing may be written, a dry run): how `sweep` and `resume` hold the lock."""
    with ledger.lock():
        if write:
            complete(ledger)
        yield


def mark(uri: str, run_ids: Sequence[str], look: int) -> None:
    """Tag each run as added after `look` (`pdmctl.look`, read as the provenance field `look`)."""
    if not run_ids:
        return
    from mlflow.entities import RunTag
    from mlflow.tracking import MlflowClient

    from pdmctl.ledger import TAG_LOOK

    client = MlflowClient(uri)
    for run_id in run_ids:
        client.log_batch(run_id, tags=[RunTag(TAG_LOOK, str(look))])
