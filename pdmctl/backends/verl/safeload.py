"""VeRL's checkpoint loads unpickle only what a checkpoint holds.

VeRL 0.9.1 reads its own checkpoints with `torch.load(..., weights_only=False)` (the FSDP engine's
model, optimizer and extra-state shards, the dataloader's `data.pt`) and Megatron's checkpoints through
`torch.distributed.checkpoint`, whose `.metadata` file is a plain pickle. A file planted in a run's
checkpoint directory (a shared filesystem, a directory others can write) would run its code in the
next attempt that resumes. Inside a pdmctl job, every load of a file under the run's checkpoint
directory (`PDMCTL_CHECKPOINT_DIR`) is therefore made as weights only:

* `torch.load` gets `weights_only=True` (tensors, DTensors, containers and plain values) and, beside
  torch's own allowlist, the few globals VeRL's extra state holds: numpy's random state, an array of
  uint32 (`ALLOWED_NUMPY`). Loads of other paths are left as they were.
* `torch.distributed.checkpoint`'s metadata is read by an unpickler that builds only containers, torch's
  sizes, dtypes and the checkpoint's own metadata records (classes of `torch.distributed.checkpoint` and
  Megatron's `dist_checkpointing`; never a function).

A file that names anything else is refused before any of it runs: `RefusedCheckpoint`, one line naming
the file and the global, and what to do. `install` (the torch.load guard) runs where the plugin is
imported, in every VeRL process; `install_dcp` in the actor's processes (patches.py), where the
trainer's engine imports torch.distributed.checkpoint anyway.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdmctl.backends.verl.checkpoints import DIR_ENV  # the run's checkpoint directory, for every worker

_INSTALLED: set[str] = set()
_ANNOUNCED: list[str] = []


class RefusedCheckpoint(pickle.UnpicklingError):
    """A file under the run's checkpoint directory holds something a checkpoint does not."""


def allowed_numpy() -> list[Any]:
    """What `np.random.get_state()` pickles to (VeRL's extra state keeps it under `rng.numpy`): an
    ndarray of uint32, rebuilt by numpy's `_reconstruct`. An object array's items still need their own
    globals, so these admit no code."""
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct  # numpy 2
    except ImportError:  # pragma: no cover - numpy 1
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
    return [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def root() -> Path | None:
    given = os.environ.get(DIR_ENV, "").strip()
    return Path(os.path.abspath(given)) if given else None


def under(path: Any, directory: Path) -> bool:
    """Whether `path` (a str or path-like; a stream is not a path) names a file in `directory`: as given
    (a link planted there that points elsewhere is still there) or once links are resolved."""
    if not isinstance(path, (str, os.PathLike)):
        return False
    try:
        given = os.fspath(path)
        return Path(os.path.abspath(given)).is_relative_to(os.path.abspath(directory)) or Path(
            os.path.realpath(given)
        ).is_relative_to(os.path.realpath(directory))
    except (TypeError, ValueError, OSError):
        return False


def _refusal(path: Any, exc: BaseException) -> RefusedCheckpoint:
    """The one line, printed to stderr as well (torch.distributed.checkpoint 2.11 replaces a failed
    metadata read with its own 'metadata is None'; Ray wraps a worker's exception)."""
    text = str(exc)
    found = re.search(r"GLOBAL (\S+)", text) or re.search(r"global '?([\w.]+)'?", text)
    what = f"it names {found.group(1)}" if found else text.strip().splitlines()[0][:200]
    refused = RefusedCheckpoint(
        f"pdmctl: {path}: refused: {what}, which no checkpoint the trainer writes holds (a checkpoint holds "
        "tensors and plain values); the file was not written by this run's trainer: remove its step "
        "directory, then resume"
    )
    print(refused, file=sys.stderr, flush=True)
    return refused


def safe_load(original: Callable[..., Any], f: Any, *args: Any, **kwargs: Any) -> Any:
    """`original` (torch.load) as weights only, with `allowed_numpy` beside torch's allowlist."""
    import torch

    kwargs["weights_only"] = True
    args = args[:1]  # torch.load(f, map_location, pickle_module, *, ...): weights only takes no pickle module
    kwargs.pop("pickle_module", None)
    with torch.serialization.safe_globals(allowed_numpy()):
        try:
            return original(f, *args, **kwargs)
        except pickle.UnpicklingError as exc:
            raise _refusal(f, exc) from None


def guard(original: Callable[..., Any], directory: Path) -> Callable[..., Any]:
    """`original` (torch.load) that loads a path under `directory` as weights only (`safe_load`)."""

    @functools.wraps(original)
    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        if not under(f, directory):
            return original(f, *args, **kwargs)
        if not _ANNOUNCED:
            _ANNOUNCED.append(str(f))
            print(f"pdmctl: checkpoint files load as weights only (first: {f})", flush=True)
        return safe_load(original, f, *args, **kwargs)

    return load


def install() -> None:
    """Guard `torch.load` in this process: a path under the run's checkpoint directory loads as weights
    only. Idempotent; nothing without `PDMCTL_CHECKPOINT_DIR` (outside a pdmctl job)."""
    directory = root()
    if "torch.load" in _INSTALLED or directory is None:
        return
    import torch

    torch.load = guard(torch.load, directory)
    _INSTALLED.add("torch.load")


# --- torch.distributed.checkpoint's metadata (Megatron's dist_ckpt) ----------------------------------

_DCP_MODULES = ("torch.distributed.checkpoint.", "megatron.core.dist_checkpointing.")
_BUILTINS = {"dict", "list", "tuple", "set", "frozenset", "int", "float", "complex", "bool", "str", "bytes",
             "bytearray", "slice", "NoneType"}  # fmt: skip


class MetadataUnpickler(pickle.Unpickler):
    """Builds containers, torch's Size / dtype / layout / memory format (and the lookup of a layout by
    name), paths, and classes (never functions)
    of torch.distributed.checkpoint and Megatron's dist_checkpointing: what a DCP `.metadata` holds."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module == "builtins" and name in _BUILTINS:
            return getattr(__import__("builtins"), name)
        if module == "collections" and name in ("OrderedDict", "defaultdict"):
            return getattr(__import__("collections"), name)
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch.serialization" and name == "_get_layout":  # a layout by its name: a lookup
            return torch.serialization._get_layout
        if module == "pathlib" and name in ("PosixPath", "PurePosixPath", "Path"):  # a file's name in storage_data
            return getattr(__import__("pathlib"), name)
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        if module.startswith(_DCP_MODULES) or module.rstrip(".") + "." in _DCP_MODULES:
            value = getattr(__import__(module, fromlist=[name]), name, None)
            if isinstance(value, type) and not issubclass(value, BaseException):
                return value
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")


def load_metadata(stream: Any, path: Any = "") -> Any:
    """A DCP `.metadata` read by `MetadataUnpickler`; anything else refused (`RefusedCheckpoint`)."""
    data = stream.read()
    try:
        return MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        raise _refusal(path or getattr(stream, "name", "metadata"), exc) from None


def guard_metadata(original: Callable[..., Any], directory: Path) -> Callable[..., Any]:
    """`FileSystemReader.read_metadata` that reads a checkpoint under `directory` by `load_metadata`."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    @functools.wraps(original)
    def read_metadata(self: Any, *args: Any, **kwargs: Any) -> Any:
        path = self._get_metadata_path(kwargs.get("rank"))
        if not under(path, directory):
            return original(self, *args, **kwargs)
        with self.fs.create_stream(path, "rb") as stream:
            metadata = load_metadata(stream, path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    return read_metadata


def install_dcp() -> None:
    """Guard `FileSystemReader.read_metadata` in this process (`guard_metadata`). Idempotent."""
    directory = root()
    if "dcp" in _INSTALLED or directory is None:
        return
    from torch.distributed.checkpoint import filesystem

    filesystem.FileSystemReader.read_metadata = guard_metadata(filesystem.FileSystemReader.read_metadata, directory)
    _INSTALLED.add("dcp")
