"""What can be checked cheaply on a login node of the weights and data an offline job will read:
that they are there is not enough, an empty or partial copy fails on the cluster after the queue
wait. Headers and footers, and of the tensors a few sampled regions, never the rest or the rows: a 60 GB
model is checked in milliseconds.

`check_model_dir`: config.json and the tokenizer's JSON parse, and every weight file (every shard the
safetensors index names) is a non-empty file, a safetensors file's header whole and within the file, and
its tensor data on disk where `sampled_regions` samples it: a hole there (a sparse file, what an
interrupted or pre-allocated download leaves) or zero bytes at every place sampled fail; given the
preset's shape (`ModelShape`), the config names its architecture and the shards' headers hold its number
of parameters (within 2%): stand-in weights (a `{}` config, a one-tensor file) fail.
`check_parquet`: the file opens as parquet, has the columns VeRL's RL dataset reads and at least one row.
Each raises OfflineFilesError (one line); a file's verdict is cached by its size and modification time,
so a grid of many runs of one model reads it once.
"""

from __future__ import annotations

import errno
import functools
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")
SAFETENSORS_INDEX = "model.safetensors.index.json"
# what VeRL's RLHFDataset and its default reward read of a row (pdmctl.backends.verl.data writes them)
PARQUET_COLUMNS = ("prompt", "data_source", "reward_model")
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on a header
# a safetensors file's tensor data is read at SAMPLES regions of SAMPLE_BYTES each (`sampled_regions`)
SAMPLES = 16
SAMPLE_BYTES = 4096
_REDOWNLOAD = "(an interrupted or pre-allocated download leaves such a file): download it again"


PARAMETER_TOLERANCE = 0.02  # the shards' parameters against the preset's count (a tied head, a bias or two)


class OfflineFilesError(ValueError):
    """A weight or data file that a job could not read; the message is one line."""


@dataclass(frozen=True)
class ModelShape:
    """What a preset's weights are: the architecture its config names and its number of parameters."""

    architecture: str  # config.json's `architectures` (transformers' class), e.g. Qwen3ForCausalLM
    parameters: int  # 0: not checked


def check_model_dir(model: Path, label: str, shape: ModelShape | None = None) -> None:
    """A local model directory as VeRL loads it: a config, a tokenizer, whole weights; of `shape` when given."""
    where = f"model {label}: {model}"
    missing = [what for what, ok in (
        ("config.json", (model / "config.json").exists()),
        (f"a tokenizer ({' or '.join(TOKENIZER_FILES)})", any((model / f).exists() for f in TOKENIZER_FILES)),
        ("weights (*.safetensors or *.bin)", any(any(model.glob(p)) for p in (*WEIGHT_PATTERNS, SAFETENSORS_INDEX))),
    ) if not ok]  # fmt: skip
    if missing:
        raise OfflineFilesError(f"{where} lacks {', '.join(missing)}")
    _check_file(model / "config.json", where, "json")
    for name in TOKENIZER_FILES:
        if (model / name).exists():
            _check_file(model / name, where, "json" if name.endswith(".json") else "bytes")
    index = model / SAFETENSORS_INDEX
    if index.exists():
        _check_file(index, where, "json")
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise OfflineFilesError(f"{where}: {SAFETENSORS_INDEX} has no weight_map naming the shards")
        weights = []
        for shard in sorted(set(map(str, weight_map.values()))):
            if Path(shard).name != shard:
                raise OfflineFilesError(f"{where}: {SAFETENSORS_INDEX} names {shard!r}, not a file in the directory")
            if not (model / shard).exists():
                raise OfflineFilesError(f"{where}: {SAFETENSORS_INDEX} names {shard}, which is not there")
            _check_file(model / shard, where, "safetensors")
            weights.append(model / shard)
    else:
        weights = []
        for pattern in WEIGHT_PATTERNS:
            for path in sorted(model.glob(pattern)):
                _check_file(path, where, "safetensors" if path.suffix == ".safetensors" else "bytes")
                weights.append(path)
    if shape is not None:
        _check_shape(model, where, shape, weights)


def _check_shape(model: Path, where: str, shape: ModelShape, weights: list[Path]) -> None:
    """The config names the preset's architecture; the safetensors shards hold its parameters (within
    PARAMETER_TOLERANCE; .bin/.pt weights are not counted: that would read them whole)."""
    config = json.loads((model / "config.json").read_text())
    named = config.get("architectures") if isinstance(config, dict) else None
    if not isinstance(named, list) or shape.architecture not in named:
        raise OfflineFilesError(
            f"{where}: config.json names {named if isinstance(named, list) else 'no architectures'}, not "
            f"{shape.architecture}: these are not the preset's weights (stage the model's own directory)"
        )
    if shape.parameters <= 0 or not weights or any(p.suffix != ".safetensors" for p in weights):
        return
    counted = sum(_parameters(str(p), st.st_size, st.st_mtime_ns) for p in weights for st in [p.stat()])
    if abs(counted - shape.parameters) > PARAMETER_TOLERANCE * shape.parameters:
        raise OfflineFilesError(
            f"{where}: the weights hold {counted:,} parameters, the preset's model {shape.parameters:,}: "
            "not the preset's weights, or a part of them (stage the model's whole directory)"
        )


@functools.lru_cache(maxsize=1024)
def _parameters(path: str, size: int, mtime_ns: int) -> int:
    """The parameters a safetensors file's header declares (its tensors' shapes); size and mtime: the cache's key."""
    with open(path, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
    return sum(math.prod(int(n) for n in entry.get("shape", ())) for name, entry in header.items()
               if name != "__metadata__" and isinstance(entry, dict))  # fmt: skip


def check_parquet(path: Path) -> None:
    """A data file VeRL's dataset can read: parquet, its columns, a row at least."""
    if not path.exists():
        raise OfflineFilesError(f"data_dir: {path} does not exist (`pdmctl data prepare {path.parent}` writes it)")
    _check_file(path, "data_dir", "parquet", str(path))


def _check_file(path: Path, where: str, kind: str, shown: str | None = None) -> None:
    label = f"{where}: {shown or path.name}"
    try:
        stat = path.stat()
    except OSError as exc:
        raise OfflineFilesError(f"{label}: {exc.strerror or exc}") from None
    if not path.is_file():
        raise OfflineFilesError(f"{label} is not a file")
    problem = _problem(str(path), kind, stat.st_size, stat.st_mtime_ns)
    if problem:
        raise OfflineFilesError(f"{label} {problem}")


@functools.lru_cache(maxsize=1024)
def _problem(path: str, kind: str, size: int, mtime_ns: int) -> str | None:
    """What is wrong with the file (None: nothing); size and mtime are the cache's key."""
    if size == 0:
        return "is empty (0 bytes)"
    try:
        if kind == "json":
            with open(path, "rb") as fh:
                json.loads(fh.read())
        elif kind == "safetensors":
            return _safetensors_problem(path, size)
        elif kind == "parquet":
            return _parquet_problem(path)
    except (OSError, ValueError) as exc:
        return f"cannot be read as {kind.upper()}: {' '.join(str(exc).split())[:120]}"
    return None


def _safetensors_problem(path: str, size: int) -> str | None:
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return "is not a safetensors file (shorter than its header's length)"
        (length,) = struct.unpack("<Q", head)
        if not 0 < length <= min(_MAX_HEADER, size - 8):
            return f"is not a safetensors file (a header of {length} bytes in a file of {size})"
        header = json.loads(fh.read(length))
    if not isinstance(header, dict):
        return "is not a safetensors file (its header is not a JSON object)"
    ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"
            and isinstance(entry, dict) and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2]  # fmt: skip
    if len(ends) != len([n for n in header if n != "__metadata__"]):
        return "is not a safetensors file (a tensor without data_offsets)"
    if ends and 8 + length + max(ends) > size:
        return f"is cut short: its tensors need {8 + length + max(ends)} bytes, the file has {size}"
    return _tensor_data_problem(path, size, 8 + length, 8 + length + max(ends, default=0))


def sampled_regions(data_start: int, data_end: int) -> list[tuple[int, int]]:
    """Where the weights' check reads a safetensors file's tensor data (bytes data_start to data_end of
    the file): SAMPLES regions of SAMPLE_BYTES, (start, end) in the file, evenly spaced from the data's
    first byte to its last, both included (fewer and shorter where the data is shorter than that)."""
    span = data_end - data_start
    if span <= 0:
        return []
    length = min(SAMPLE_BYTES, span)
    starts = sorted({data_start + (span - length) * i // (SAMPLES - 1) for i in range(SAMPLES)})
    return [(start, start + length) for start in starts]


def _tensor_data_problem(path: str, size: int, data_start: int, data_end: int) -> str | None:
    """The tensor data is on disk (no hole) and not all zeros where `sampled_regions` samples it."""
    regions = sampled_regions(data_start, data_end)
    if not regions:
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        for start, end in regions:
            try:
                data = os.lseek(fd, start, os.SEEK_DATA) if hasattr(os, "SEEK_DATA") else start
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # no data from there to the end of the file
                    data = size
                elif exc.errno == errno.EINVAL:  # a filesystem that does not say where its holes are
                    on_disk = os.fstat(fd).st_blocks * 512
                    if on_disk < size // 2:
                        return f"is sparse: {on_disk} of its {size} bytes are on disk {_REDOWNLOAD}"
                    break
                else:
                    raise
            if data >= end:
                return f"is sparse: no data on disk at byte {start - data_start} of its tensors {_REDOWNLOAD}"
        if not any(os.pread(fd, end - start, start).strip(b"\0") for start, end in regions):
            return f"holds only zero bytes in its tensors at the {len(regions)} places sampled {_REDOWNLOAD}"
    finally:
        os.close(fd)
    return None


def _parquet_problem(path: str) -> str | None:
    from pdmctl.backends.verl.parquet_footer import read_footer  # no pyarrow on a login node

    try:
        footer = read_footer(path)
    except (OSError, ValueError) as exc:
        return f"is not a parquet file ({' '.join(str(exc).split())[:120]})"
    names = set(footer.names)
    lacking = [c for c in PARQUET_COLUMNS if c not in names]
    if lacking:
        return f"lacks the column(s) VeRL reads: {', '.join(lacking)} (has {', '.join(sorted(names)) or 'none'})"
    if footer.num_rows < 1:
        return "has no rows"
    return None
