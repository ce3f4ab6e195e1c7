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
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
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


@dataclass(frozen=True)
class PreparedFile:
    path: Path
    data_source: str
    rows: int


class DataSourceError(ValueError):
    """A source that cannot be read or has rows without a problem or an answer."""


def prepare_data(
    out_dir: Path | str,
    train_source: str = TRAIN_SOURCE,
    aime24_source: str = AIME24_SOURCE,
    aime25_source: str = AIME25_SOURCE,
) -> list[PreparedFile]:
    """Write `dapo_math_17k.parquet`, `aime24.parquet`, `aime25.parquet` into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plan = [
        ("dapo_math_17k.parquet", train_source, "math_dapo", "train"),
        ("aime24.parquet", aime24_source, "aime24", "test"),
        ("aime25.parquet", aime25_source, "aime25", "test"),
    ]
    written = []
    for filename, source, data_source, split in plan:
        rows = _dedupe(to_verl_rows(read_records(source), data_source, split))
        path = out / filename
        _write_parquet(rows, path)
        written.append(PreparedFile(path, data_source, len(rows)))
    return written


def read_records(source: str) -> Iterator[Mapping[str, Any]]:
    """Records from a local .jsonl/.json/.parquet file, or from the datasets hub."""
    path = Path(source).expanduser()
    if path.exists():
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            with path.open() as f:
                yield from (json.loads(line) for line in f if line.strip())
        elif suffix == ".json":
            data = json.loads(path.read_text())
            yield from (data if isinstance(data, list) else data.get("data", []))
        elif suffix == ".parquet":
            import pyarrow.parquet as pq

            yield from pq.read_table(path).to_pylist()
        else:
            raise DataSourceError(
                f"{source}: unsupported file type {suffix!r} (use .jsonl, .json or .parquet)"
            )
        return
    if source.count("/") != 1 or source.startswith((".", "/")):
        raise DataSourceError(f"{source}: no such file, and not a datasets-hub id (owner/name)")
    yield from _hub_records(source)


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
                "extra_info": {"split": split, "index": index, "problem": problem},
            }
        )
    return rows


def _problem_and_answer(record: Mapping[str, Any], index: int) -> tuple[str, str]:
    if isinstance(record.get("prompt"), list) and isinstance(record.get("reward_model"), Mapping):
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


def _dedupe(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """DAPO-Math-17k on the hub repeats each of its ~17k problems; keep the first of each."""
    seen: set[str] = set()
    unique = []
    for row in rows:
        key = row["prompt"][0]["content"]
        if key not in seen:
            seen.add(key)
            row["extra_info"]["index"] = len(unique)
            unique.append(row)
    return unique


def _write_parquet(rows: list[dict[str, Any]], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not rows:
        raise DataSourceError(f"{path.name}: no rows to write")
    pq.write_table(pa.Table.from_pylist(rows), path)
