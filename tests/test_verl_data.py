"""`pdmctl data prepare` on local fixtures: VeRL's dataset class loads it, VeRL's math reward scores it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("verl")

import pyarrow as pa
import pyarrow.parquet as pq
from omegaconf import OmegaConf
from typer.testing import CliRunner
from verl.utils.reward_score import default_compute_score

from pdmctl.backends.verl import data
from pdmctl.backends.verl.cli import app

pytestmark = pytest.mark.verl


def write_fixtures(tmp: Path) -> tuple[Path, Path, Path]:
    # DAPO-Math-17k is VeRL-shaped on the hub, with each problem repeated
    dapo = [
        {
            "data_source": "math_dapo",
            "prompt": [
                {"role": "user", "content": data.PROMPT_TEMPLATE.format(problem=f"What is {i} + {i}?")}
            ],
            "ability": "MATH",
            "reward_model": {"style": "rule-lighteval/MATH_v2", "ground_truth": str(2 * i)},
            "extra_info": {"index": f"id-{i}"},
        }
        for i in (1, 2, 3, 1, 2)
    ]
    train = tmp / "dapo.parquet"
    pq.write_table(pa.Table.from_pylist(dapo), train)
    aime24 = tmp / "aime24.jsonl"
    aime24.write_text("\n".join(json.dumps({"problem": f"Find {n}^2.", "answer": n * n}) for n in (11, 12)))
    aime25 = tmp / "aime25.json"
    aime25.write_text(json.dumps([{"question": "Compute 7*6.", "answer": "42"}]))
    return train, aime24, aime25


def tiny_tokenizer():
    """A word-level tokenizer with a chat template: VeRL's dataset needs one, the network is not needed."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "[PAD]", "<eos>", *"abcdefghijklmnopqrstuvwxyz0123456789"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]", eos_token="<eos>"
    )
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    return tok


def test_prepare_gives_parquet_that_verl_loads_and_scores(tmp_path: Path) -> None:
    from verl.utils.dataset.rl_dataset import RLHFDataset

    train, aime24, aime25 = write_fixtures(tmp_path)
    written = data.prepare_data(tmp_path / "out", str(train), str(aime24), str(aime25))
    assert [(w.path.name, w.data_source, w.rows) for w in written] == [
        ("dapo_math_17k.parquet", "math_dapo", 3),  # deduplicated
        ("aime24.parquet", "aime24", 2),
        ("aime25.parquet", "aime25", 1),
    ]
    config = OmegaConf.create(
        {"prompt_key": "prompt", "max_prompt_length": 4096, "filter_overlong_prompts": True}
    )
    for item in written:
        dataset = RLHFDataset(str(item.path), tiny_tokenizer(), config)
        assert len(dataset) == item.rows
        row = dataset[0]
        assert row["data_source"] == item.data_source
        assert row["raw_prompt"][0]["role"] == "user" and "Answer:" in row["raw_prompt"][0]["content"]
        truth = row["reward_model"]["ground_truth"]
        right = default_compute_score(item.data_source, f"Some work.\nAnswer: {truth}", truth)
        wrong = default_compute_score(item.data_source, "Some work.\nAnswer: 99999", truth)
        assert right["acc"] is True and right["score"] == 1.0
        assert wrong["acc"] is False and wrong["score"] < 0


def test_cli_prepare(tmp_path: Path) -> None:
    train, aime24, aime25 = write_fixtures(tmp_path)
    out = tmp_path / "cli"
    args = ["prepare", str(out), "--train", str(train), "--aime24", str(aime24), "--aime25", str(aime25)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert (out / "aime25.parquet").exists()


def test_cli_bad_source_is_one_line_and_nonzero(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["prepare", str(tmp_path), "--train", str(tmp_path / "missing.csv")])
    assert result.exit_code == 1
    assert "error:" in result.output and "Traceback" not in result.output
