"""DAPO-Math-17k and AIME24/AIME25 in VeRL's parquet layout.

VeRL's RL dataset reads `prompt` (chat messages), `data_source`, `ability`,
`reward_model{style, ground_truth}` and `extra_info`; its default reward routes
`math_dapo` and `aime*` data sources to `utils/reward_score/math_dapo.py`, which
reads the last "Answer: ..." line, hence the DAPO prompt template below. The
validation data sources `aime24` and `aime25` become VeRL's
`val-core/aime24/acc/mean@16` metrics (launch.py maps them to the report).

A source is a local file (.jsonl, .json, .parquet) or a datasets-hub id
(`BytedTsinghua-SIA/DAPO-Math-17k`, `HuggingFaceH4/aime_2024`, ...). Rows may
already be in VeRL's layout (DAPO-Math-17k is) or plain `{problem|question,
answer}` records (the AIME sets are).

Every preparation writes `manifest.json` beside the parquet files: each source (a local file's SHA-256, a
hub dataset's resolved revision), the filter applied to the training set, the rows in and out (and how many
each filter step removed), each output's SHA-256, and a `digest` over all of that but the sources'
locations (the same data prepared from another path has the same digest). A run carries the digest
(`backend.data_manifest`, in its run key; pinned at submit) and `pdmctl report` refuses to pool runs whose
digests differ. Nothing is written until every source has been read and every filter value checked.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# DAPO's prompt (verl recipe/dapo): the math_dapo scorer reads the final "Answer:" line.
PROMPT_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
TRAIN_SOURCE = "BytedTsinghua-SIA/DAPO-Math-17k"
AIME24_SOURCE = "HuggingFaceH4/aime_2024"
AIME25_SOURCE = "yentinglin/aime_2025"
REWARD_STYLE = "rule-lighteval/MATH_v2"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "pdmctl-data/1"
TRAIN_FILE, AIME24_FILE, AIME25_FILE = "dapo_math_17k.parquet", "aime24.parquet", "aime25.parquet"
ANSWER_FORMATS = ("any", "integer")  # integer: the ground truth is a whole number (as every AIME answer)
_INTEGER = re.compile(r"^[+-]?\d+$")


@dataclass(frozen=True)
class PreparedFile:
    path: Path
    data_source: str
    rows: int


class DataSourceError(ValueError):
    """A source that cannot be read or has rows without a problem or an answer."""


class ManifestError(ValueError):
    """A manifest that is missing, unreadable, or does not match the files beside it; one line."""


@dataclass(frozen=True)
class DataFilter:
    """What `prepare` keeps of the training set, in this order: de-duplication (the first of each prompt),
    the answer's format, the prompt's length (characters of the templated prompt; tokens of the chat-templated
    prompt with a local tokenizer, as VeRL's `filter_overlong_prompts` counts them), a list of ids to keep
    (a source row's id: `extra_info.index` where it has one, else `id`, else its position). The held-out
    sets are only de-duplicated: the report's avg@16 reads all of AIME."""

    dedupe: bool = True
    answer_format: str = "any"
    max_prompt_chars: int | None = None
    max_prompt_tokens: int | None = None
    tokenizer: str | None = None  # a local tokenizer directory, for max_prompt_tokens
    ids_file: str | None = None
    _ids: frozenset[str] | None = field(default=None, repr=False, compare=False)

    def checked(self) -> DataFilter:
        """This filter with its id list read, or DataSourceError naming the bad value (before any writing)."""
        if self.answer_format not in ANSWER_FORMATS:
            raise DataSourceError(f"--answer-format: {self.answer_format!r} is not one of {', '.join(ANSWER_FORMATS)}")
        for name, value in (("--max-prompt-chars", self.max_prompt_chars), ("--max-prompt-tokens", self.max_prompt_tokens)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise DataSourceError(f"{name}: must be a whole number >= 1, got {value!r}")
        if (self.max_prompt_tokens is None) != (self.tokenizer is None):
            raise DataSourceError("--max-prompt-tokens and --tokenizer go together (tokens are counted by that tokenizer)")
        if self.tokenizer is not None and not Path(self.tokenizer).expanduser().is_dir():
            raise DataSourceError(f"--tokenizer: {self.tokenizer}: not a directory (a local tokenizer, never downloaded)")
        ids = None
        if self.ids_file is not None:
            ids = frozenset(_read_ids(Path(self.ids_file).expanduser()))
        return DataFilter(self.dedupe, self.answer_format, self.max_prompt_chars, self.max_prompt_tokens,
                          self.tokenizer, self.ids_file, ids)

    def describe(self) -> dict[str, Any]:
        """The filter as the manifest records it (the id list by its count and SHA-256, not its path)."""
        out: dict[str, Any] = {"dedupe": self.dedupe, "answer_format": self.answer_format,
                               "max_prompt_chars": self.max_prompt_chars, "max_prompt_tokens": self.max_prompt_tokens,
                               "tokenizer": _tokenizer_digest(self.tokenizer) if self.tokenizer else None, "ids": None}
        if self._ids is not None:
            text = "\n".join(sorted(self._ids))
            out["ids"] = {"count": len(self._ids), "sha256": hashlib.sha256(text.encode()).hexdigest()}
        return out


def _read_ids(path: Path) -> list[str]:
    """Ids, one a line (blank lines and `#` comments skipped), or a JSON list."""
    if not path.is_file():
        raise DataSourceError(f"--ids: {path}: no such file")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise DataSourceError(f"--ids: {path}: cannot be read ({exc})") from None
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataSourceError(f"--ids: {path}: not a JSON list ({exc.msg}, line {exc.lineno})") from None
        if not isinstance(data, list) or not all(isinstance(i, str | int) and not isinstance(i, bool) for i in data):
            raise DataSourceError(f"--ids: {path}: a JSON list of ids must hold strings or whole numbers")
        ids = [str(i) for i in data]
    else:
        ids = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not ids:
        raise DataSourceError(f"--ids: {path}: no ids (it would keep no row)")
    return ids


def _tokenizer_digest(directory: str) -> str:
    """SHA-256 over a tokenizer directory's files (names and bytes): which tokenizer counted the tokens."""
    root = Path(directory).expanduser()
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(root)).encode() + b"\0" + _sha256(path).encode())
    return h.hexdigest()


def prepare_data(
    out_dir: Path | str,
    train_source: str = TRAIN_SOURCE,
    aime24_source: str = AIME24_SOURCE,
    aime25_source: str = AIME25_SOURCE,
    data_filter: DataFilter | None = None,
) -> list[PreparedFile]:
    """Write `dapo_math_17k.parquet`, `aime24.parquet`, `aime25.parquet` and `manifest.json` into `out_dir`.
    Every source is read and filtered before anything is written; the files are written under temporary
    names and renamed into place, the manifest last."""
    chosen = (data_filter or DataFilter()).checked()
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise DataSourceError(f"{out}: exists and is not a directory")
    plan = [
        (TRAIN_FILE, train_source, "math_dapo", "train", chosen),
        (AIME24_FILE, aime24_source, "aime24", "test", DataFilter(dedupe=chosen.dedupe)),
        (AIME25_FILE, aime25_source, "aime25", "test", DataFilter(dedupe=chosen.dedupe)),
    ]
    prepared = []
    for filename, source, data_source, split, step in plan:
        origin, records = _source(source)
        try:
            rows = to_verl_rows(records, data_source, split)
        except DataSourceError as exc:
            raise DataSourceError(f"{source}: {exc}") from None
        kept, removed = apply_filter(rows, step)
        if not kept:
            raise DataSourceError(f"{filename}: the filter keeps no row of {source} ({len(rows)} in; removed {removed})")
        prepared.append((filename, source, data_source, origin, rows, kept, removed))
    out.mkdir(parents=True, exist_ok=True)
    files, written = {}, []
    for filename, source, data_source, origin, rows, kept, removed in prepared:
        path = out / filename
        tmp = out / f".{filename}.tmp-{os.getpid()}"
        _write_parquet(kept, tmp)
        os.replace(tmp, path)
        where = str(Path(source).expanduser().resolve()) if Path(source).expanduser().is_file() else source
        files[filename] = {"data_source": data_source, "source": where, **origin, "rows_in": len(rows),
                           "rows_out": len(kept), "removed": removed, "sha256": _sha256(path)}
        written.append(PreparedFile(path, data_source, len(kept)))
    manifest = {"format": MANIFEST_FORMAT, "filter": chosen.describe(), "files": files}
    manifest["digest"] = manifest_digest(manifest)
    tmp = out / f".{MANIFEST}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, out / MANIFEST)
    return written


def _source(source: str) -> tuple[dict[str, Any], list[Mapping[str, Any]]]:
    """(what pins the source: a local file's SHA-256 or a hub dataset's revision, its records)."""
    path = Path(source).expanduser()
    if path.is_file():
        return {"source_sha256": _sha256(path)}, list(read_records(source))
    records = list(read_records(source))
    return {"source_revision": _hub_revision(source)}, records


def _hub_revision(repo_id: str) -> str:
    """The commit of a hub dataset as `datasets` resolved it (the hub's answer; "unknown" offline)."""
    try:
        from huggingface_hub import HfApi

        return str(HfApi().dataset_info(repo_id).sha)
    except Exception:  # offline, or an old hub client: the outputs' SHA-256 still pin the data
        return "unknown"


def apply_filter(rows: list[dict[str, Any]], step: DataFilter) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The rows `step` keeps (re-indexed from 0) and how many each part of it removed, in the order applied."""
    removed = {"duplicate": 0, "answer_format": 0, "prompt_length": 0, "ids": 0}
    seen: set[str] = set()
    count = _token_counter(step.tokenizer) if step.max_prompt_tokens is not None else None
    kept = []
    for row in rows:
        content = row["prompt"][0]["content"]
        if step.dedupe:
            if content in seen:
                removed["duplicate"] += 1
                continue
            seen.add(content)
        if step.answer_format == "integer" and not _INTEGER.match(str(row["reward_model"]["ground_truth"])):
            removed["answer_format"] += 1
            continue
        too_long = step.max_prompt_chars is not None and len(content) > step.max_prompt_chars
        if not too_long and count is not None and step.max_prompt_tokens is not None:
            too_long = count(row["prompt"]) > step.max_prompt_tokens
        if too_long:
            removed["prompt_length"] += 1
            continue
        if step._ids is not None and str(row["extra_info"]["source_id"]) not in step._ids:
            removed["ids"] += 1
            continue
        row["extra_info"]["index"] = len(kept)
        kept.append(row)
    return kept, removed


def _token_counter(tokenizer: str | None):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(Path(str(tokenizer)).expanduser()), local_files_only=True)
    except Exception as exc:
        raise DataSourceError(f"--tokenizer: {tokenizer}: not a tokenizer ({str(exc).splitlines()[0][:200]})") from None

    def count(messages: list[dict[str, str]]) -> int:
        return prompt_tokens(tok, messages)

    return count


def prompt_tokens(tok: Any, messages: list[dict[str, str]]) -> int:
    """Tokens of the chat-templated prompt with the generation prompt (what VeRL's overlong filter counts)."""
    if not getattr(tok, "chat_template", None):
        return len(tok(messages[-1]["content"])["input_ids"])
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return len(ids)


def manifest_digest(manifest: Mapping[str, Any]) -> str:
    """SHA-256 of the canonical JSON of the manifest's filter and files, each file without its source's
    location: the same inputs, filter and outputs give the same digest wherever they were read from."""
    files = {name: {k: v for k, v in entry.items() if k != "source"} for name, entry in manifest["files"].items()}
    body = {"format": manifest["format"], "filter": manifest["filter"], "files": files}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def read_manifest(data_dir: Path | str, verify: bool = True) -> dict[str, Any]:
    """The manifest of a prepared data directory, its digest recomputed and (verify) every file's SHA-256
    checked against the file beside it; ManifestError (one line) where any of it fails."""
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise ManifestError(f"{path}: no manifest (prepare the data with `pdmctl data prepare {data_dir}`)")
    try:
        manifest = json.loads(path.read_text())
    except RecursionError:
        raise ManifestError(f"{path}: corrupt manifest (nested too deeply); prepare the data again") from None
    except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ManifestError(f"{path}: corrupt manifest ({exc}); prepare the data again") from None
    if (not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT
            or not isinstance(manifest.get("files"), dict) or not isinstance(manifest.get("filter"), dict)
            or not all(isinstance(e, dict) and isinstance(e.get("sha256"), str) for e in manifest["files"].values())):
        raise ManifestError(f"{path}: corrupt manifest (not a {MANIFEST_FORMAT} manifest); prepare the data again")
    outside = next((name for name in manifest["files"] if name != Path(name).name or name in ("", ".", "..")), None)
    if outside is not None:  # a hand-edited manifest (its digest recomputed) naming a file elsewhere
        raise ManifestError(f"{path}: names {outside[:80]!r}, not a file of {Path(data_dir)}; prepare the data again")
    if manifest.get("digest") != manifest_digest(manifest):
        raise ManifestError(f"{path}: corrupt manifest (its digest does not match its content); prepare the data again")
    if verify:
        for name, entry in sorted(manifest["files"].items()):
            file = Path(data_dir) / name
            if not file.is_file():
                raise ManifestError(f"{file}: listed in {path.name} but missing")
            if _sha256(file) != entry["sha256"]:
                raise ManifestError(f"{file}: changed since it was prepared (SHA-256 differs from {path.name}); "
                                    "prepare the data again")
    return manifest


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_records(source: str) -> Iterator[Mapping[str, Any]]:
    """Records from a local .jsonl/.json/.parquet file, or from the datasets hub."""
    path = Path(source).expanduser()
    suffix = path.suffix.lower()
    if path.exists():
        if not path.is_file():
            raise DataSourceError(f"{source}: not a regular file")
        if suffix == ".jsonl":
            yield from _jsonl_records(path, source)
        elif suffix == ".json":
            yield from _json_records(path, source)
        elif suffix == ".parquet":
            yield from _parquet_records(path, source)
        else:
            raise DataSourceError(
                f"{source}: unsupported file type {suffix!r} (use .jsonl, .json or .parquet)"
            )
        return
    if source.count("/") != 1 or source.startswith((".", "/", "~")) or suffix in LOCAL_SUFFIXES \
            or Path(source.split("/")[0]).is_dir():  # fmt: skip
        raise DataSourceError(f"{source}: no such file, and not a datasets-hub id (owner/name)")
    yield from _hub_records(source)


LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")


def _record(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise DataSourceError(f"{where}: a record must be a JSON object, got {type(value).__name__} {str(value)[:40]!r}")
    return value


def _jsonl_records(path: Path, source: str) -> Iterator[Mapping[str, Any]]:
    """One JSON object a line; a damaged line is DataSourceError naming the file and the line."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            where = f"{source}, line {number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataSourceError(f"{where}: not UTF-8 (byte {raw[exc.start]:#04x} at column {exc.start + 1})") from None
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataSourceError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
            except RecursionError:
                raise DataSourceError(f"{where}: nested too deeply to be a record") from None
            yield _record(value, where)


def _json_records(path: Path, source: str) -> Iterator[Mapping[str, Any]]:
    """A list of records, or {"data": [...]}; damage is DataSourceError naming the file and the line."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise DataSourceError(f"{source}, line {line}: not UTF-8 (byte {data[exc.start]:#04x})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataSourceError(f"{source}, line {exc.lineno}: not JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise DataSourceError(f"{source}: nested too deeply to be a list of records") from None
    records = value.get("data") if isinstance(value, dict) else value
    if not isinstance(records, list):
        raise DataSourceError(f"{source}: must be a list of records or {{\"data\": [...]}}, got "
                              f"{type(value).__name__} {str(value)[:40]!r}")  # fmt: skip
    for index, record in enumerate(records):
        yield _record(record, f"{source}, record {index}")


def _parquet_records(path: Path, source: str) -> Iterator[Mapping[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise DataSourceError(f"{source}: not a readable parquet file ({str(exc).strip().splitlines()[0][:160]})") from None
    for index, record in enumerate(table.to_pylist()):
        yield _record(record, f"{source}, row {index}")


def _hub_records(repo_id: str) -> Iterator[Mapping[str, Any]]:
    try:
        import datasets
    except ImportError as err:
        raise DataSourceError(f"{repo_id}: reading from the hub needs the `datasets` package") from err
    try:
        dataset = datasets.load_dataset(repo_id)
    except Exception as err:  # network, auth, name: one clear line for the user
        raise DataSourceError(
            f"{repo_id}: could not load from the datasets hub ({err}); pass a local file"
        ) from err
    for split in dataset.values():
        yield from split


def to_verl_rows(records: Iterable[Mapping[str, Any]], data_source: str, split: str) -> list[dict[str, Any]]:
    rows = []
    for index, record in enumerate(records):
        problem, answer = _problem_and_answer(record, index)
        rows.append(
            {
                "data_source": data_source,
                "prompt": [{"role": "user", "content": PROMPT_TEMPLATE.format(problem=problem)}],
                "ability": "MATH",
                "reward_model": {"style": REWARD_STYLE, "ground_truth": answer},
                "extra_info": {"split": split, "index": index, "problem": problem,
                               "source_id": _source_id(record, index)},
            }
        )
    return rows


def _source_id(record: Mapping[str, Any], index: int) -> str:
    """A row's id in its source: DAPO-Math-17k's `extra_info.index`, else an `id` field, else its position."""
    extra = record.get("extra_info")
    if isinstance(extra, Mapping) and extra.get("index") not in (None, ""):
        return str(extra["index"])
    for key in ("id", "ID", "problem_id"):
        if record.get(key) not in (None, ""):
            return str(record[key])
    return str(index)


def _problem_and_answer(record: Mapping[str, Any], index: int) -> tuple[str, str]:
    prompt = record.get("prompt")
    if (isinstance(prompt, list) and prompt and isinstance(prompt[-1], Mapping)
            and isinstance(record.get("reward_model"), Mapping)):  # fmt: skip
        # Already VeRL-shaped (DAPO-Math-17k): recover the bare problem to re-apply one template.
        content = str(record["prompt"][-1]["content"])
        problem = (record.get("extra_info") or {}).get("problem") or _strip_template(content)
        answer = record["reward_model"].get("ground_truth")
    else:
        problem = next(
            (record[k] for k in ("problem", "question", "prompt", "Problem") if record.get(k)), None
        )
        answer = next(
            (record[k] for k in ("answer", "ground_truth", "Answer") if record.get(k) is not None), None
        )
    if not problem or answer is None or str(answer).strip() == "":
        raise DataSourceError(f"record {index}: needs a problem (problem/question/prompt) and an answer")
    return str(problem).strip(), str(answer).strip()


def _strip_template(content: str) -> str:
    _, sep, rest = content.partition("where $Answer is the answer to the problem.\n\n")
    body = rest if sep else content
    return body.split('\n\nRemember to put your answer on its own line after "Answer:"')[0].strip()


def _write_parquet(rows: list[dict[str, Any]], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not rows:
        raise DataSourceError(f"{path.name}: no rows to write")
    pq.write_table(pa.Table.from_pylist(rows), path)
