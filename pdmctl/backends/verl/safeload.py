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
* What `torch.distributed.checkpoint` reads from a checkpoint under that directory loads the same way,
  streams included: Megatron keeps each `ShardedObject` (VeRL's RNG states) as bytes inside a `.distcp`
  file, which the load planner unpickles from a stream (`DefaultLoadPlanner.load_bytes`, with
  `weights_only=False`). While a reader of such a checkpoint reads its data (`FileSystemReader.read_data`),
  every `torch.load` in the process is weights only.
* `torch.distributed.checkpoint`'s metadata is read by an unpickler that knows the records such a file
  holds one class at a time (`METADATA_CLASSES`), plus containers and torch's sizes, dtypes and layouts;
  never a function, nor anything else a module of those classes imports. It reads the file twice: first
  with an inert stand-in for every allowed class, so that a file naming anything else is refused before
  any object of it is built, then for real.

A file that names anything else is refused before any of it runs: `RefusedCheckpoint`, one line naming
the file and the global, and what to do. `install` (the torch.load guard) runs where the plugin is
imported, in every VeRL process; `install_dcp` in the actor's processes (patches.py), where the
trainer's engine imports torch.distributed.checkpoint anyway.

Not covered: Transformer Engine's FP8 extra state, which its modules unpickle themselves
(`set_extra_state`) from a tensor of bytes; it is read only from a checkpoint this guard has loaded as
weights only, but its bytes are a pickle of their own.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import pickle
import pickletools
import re
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pdmctl.backends.verl.checkpoints import DIR_ENV  # the run's checkpoint directory, for every worker

_INSTALLED: set[str] = set()
_ANNOUNCED: list[str] = []
# how many reads of a checkpoint under the directory are under way in this process (any thread: a reader's
# planner may load in a pool), and the first one's path for the refusal's line
_READING: list[str] = []
_READING_LOCK = threading.Lock()


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


_OPCODES = {ord(op.code): op.name for op in pickletools.opcodes}


def _refusal(path: Any, exc: BaseException) -> RefusedCheckpoint:
    """The one line, printed to stderr as well (torch.distributed.checkpoint 2.11 replaces a failed
    metadata read with its own 'metadata is None'; Ray wraps a worker's exception)."""
    text = str(exc)
    found = re.search(r"GLOBAL (\S+)", text) or re.search(r"global '?([\w.]+)'?", text)
    operand = re.search(r"Unsupported operand (\d+)", text)  # torch's weights-only reader: an instruction it has not
    if found:
        what = f"it names {found.group(1)}"
    elif operand and 0 <= int(operand.group(1)) < 256 and _OPCODES.get(int(operand.group(1))):
        what = f"it uses pickle's {_OPCODES[int(operand.group(1))]} instruction"
    else:
        what = text.strip().splitlines()[0][:200]
    refused = RefusedCheckpoint(
        f"pdmctl: {path}: refused: {what}, which no checkpoint the trainer writes holds (a checkpoint holds "
        "tensors and plain values); the file was not written by this run's trainer: remove its step "
        "directory, then resume"
    )
    print(refused, file=sys.stderr, flush=True)
    return refused


def safe_load(original: Callable[..., Any], f: Any, *args: Any, _name: str | None = None, **kwargs: Any) -> Any:
    """`original` (torch.load) as weights only, with `allowed_numpy` beside torch's allowlist."""
    import torch

    kwargs["weights_only"] = True
    args = args[:1]  # torch.load(f, map_location, pickle_module, *, ...): weights only takes no pickle module
    kwargs.pop("pickle_module", None)
    with torch.serialization.safe_globals(allowed_numpy()):
        try:
            return original(f, *args, **kwargs)
        except pickle.UnpicklingError as exc:
            raise _refusal(_name or f, exc) from None


def guard(original: Callable[..., Any], directory: Path) -> Callable[..., Any]:
    """`original` (torch.load) that loads a path under `directory`, and anything while a checkpoint under it
    is being read (`reading`), as weights only (`safe_load`)."""

    @functools.wraps(original)
    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        with _READING_LOCK:
            inside = _READING[0] if _READING else None
        if inside is not None and not under(f, directory):
            name = getattr(f, "name", None)
            where = f"{inside} (an object stored in it)" if not isinstance(name, str) else name
            return safe_load(original, f, *args, _name=where, **kwargs)
        if not under(f, directory):
            return original(f, *args, **kwargs)
        if not _ANNOUNCED:
            _ANNOUNCED.append(str(f))
            print(f"pdmctl: checkpoint files load as weights only (first: {f})", flush=True)
        return safe_load(original, f, *args, **kwargs)

    return load


@contextlib.contextmanager
def reading(path: Any) -> Iterator[None]:
    """While a checkpoint at `path` is read, every `torch.load` of this process loads as weights only."""
    with _READING_LOCK:
        _READING.append(str(path))
    try:
        yield
    finally:
        with _READING_LOCK:
            _READING.remove(str(path))


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

# The records a `.metadata` holds, one class at a time (torch 2.11-2.13, megatron-core 0.13-0.16): what
# torch's planner and file system writer put there, and Megatron's subclasses of them. Nothing else of
# those modules: they import functools.partial, a TCP store, thread pools and more.
METADATA_CLASSES: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo", "_StoragePrefix"}),
    "torch.distributed.checkpoint.planner": frozenset({
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "LoadPlan", "ReadItem", "LoadItemType"}),
    "megatron.core.dist_checkpointing.strategies.torch": frozenset({"MCoreMetadata", "MCoreSavePlan"}),
    # containers and plain values (never bytes(n) or bytearray(n): a call that size decides)
    "builtins": frozenset({"dict", "list", "tuple", "set", "frozenset", "int", "float", "complex", "bool", "str",
                           "slice"}),
    "collections": frozenset({"OrderedDict"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "Path"}),  # a file's name in storage_data
    "torch": frozenset({"Size"}),
    "torch.serialization": frozenset({"_get_layout"}),  # a layout by its name: a lookup
}  # fmt: skip


def _torch_value(module: str, name: str) -> Any:
    """torch's dtypes, layouts and memory formats, as values (`torch.float32`): never a callable."""
    import torch

    if module != "torch" or name.startswith("_"):
        return None
    value = getattr(torch, name, None)
    return value if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)) else None


class _Inert:
    """What every allowed global is in the first reading: takes any arguments and state, builds nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


class MetadataUnpickler(pickle.Unpickler):
    """Builds containers, torch's Size / dtype / layout / memory format (and the lookup of a layout by
    name), paths, and the DCP metadata records of `METADATA_CLASSES`: what a `.metadata` holds. With
    `inert`, every allowed global is `_Inert`: a reading that only checks the names."""

    def __init__(self, file: Any, *, inert: bool = False) -> None:
        super().__init__(file)
        self.inert = inert

    def find_class(self, module: str, name: str) -> Any:
        value = _torch_value(module, name)
        if value is None and name not in METADATA_CLASSES.get(module, ()):
            raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")
        if self.inert:
            return _Inert
        return value if value is not None else getattr(__import__(module, fromlist=[name]), name)


def load_metadata(stream: Any, path: Any = "") -> Any:
    """A DCP `.metadata` read by `MetadataUnpickler`; anything else refused (`RefusedCheckpoint`)."""
    data = stream.read()
    try:
        MetadataUnpickler(io.BytesIO(data), inert=True).load()  # names checked; nothing of the file built
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


def guard_read_data(original: Callable[..., Any], directory: Path) -> Callable[..., Any]:
    """`FileSystemReader.read_data` that, for a checkpoint under `directory`, reads `reading` it: the objects
    stored as bytes in its data files (Megatron's `ShardedObject`s) load as weights only."""

    @functools.wraps(original)
    def read_data(self: Any, *args: Any, **kwargs: Any) -> Any:
        path = getattr(self, "path", None)
        if path is None or not under(str(path), directory):
            return original(self, *args, **kwargs)
        with reading(path):
            future = original(self, *args, **kwargs)
            result = getattr(future, "result", None)  # torch's reader reads before it returns; wait for any other
            if callable(result):
                result()
            return future

    return read_data


def install_dcp() -> None:
    """Guard torch.distributed.checkpoint's reads in this process: `FileSystemReader.read_metadata`
    (`guard_metadata`) and `read_data` (`guard_read_data`), with torch.load (`install`). Idempotent."""
    directory = root()
    if "dcp" in _INSTALLED or directory is None:
        return
    install()
    from torch.distributed.checkpoint import filesystem

    reader = filesystem.FileSystemReader
    reader.read_metadata = guard_metadata(reader.read_metadata, directory)  # type: ignore[method-assign]
    reader.read_data = guard_read_data(reader.read_data, directory)  # type: ignore[method-assign]
    _INSTALLED.add("dcp")
