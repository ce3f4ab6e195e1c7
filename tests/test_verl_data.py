"""`pdmctl data prepare` on local fixtures: VeRL's dataset class loads it, VeRL's math reward scores it."""

from __future__ import annotations

import hashlib
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


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _fixture_args(tmp: Path) -> list[str]:
    train, aime24, aime25 = write_fixtures(tmp)
    return ["--train", str(train), "--aime24", str(aime24), "--aime25", str(aime25)]


def test_prepare_writes_a_manifest_whose_digest_says_what_the_data_is(tmp_path: Path) -> None:
    """Each source's SHA-256, the filter, rows in and out (and what removed them), each output's SHA-256; the
    digest is the same for the same data prepared from another path, and differs with the filter."""
    train, aime24, aime25 = write_fixtures(tmp_path)
    data.prepare_data(tmp_path / "a", str(train), str(aime24), str(aime25))
    manifest = data.read_manifest(tmp_path / "a")
    files = manifest["files"]
    assert set(files) == {"dapo_math_17k.parquet", "aime24.parquet", "aime25.parquet", } and manifest["format"] == "pdmctl-data/1"
    dapo = files["dapo_math_17k.parquet"]
    assert dapo["source"] == str(train) and dapo["source_sha256"] == _sha256(train)
    assert (dapo["rows_in"], dapo["rows_out"], dapo["removed"]["duplicate"]) == (5, 3, 2)
    assert all(e["sha256"] == _sha256(tmp_path / "a" / name) for name, e in files.items())
    assert manifest["filter"] == {"dedupe": True, "answer_format": "any", "max_prompt_chars": None,
                                  "max_prompt_tokens": None, "tokenizer": None, "ids": None}
    assert manifest["digest"] == data.manifest_digest(manifest) and len(manifest["digest"]) == 64
    elsewhere = tmp_path / "copy"
    elsewhere.mkdir()
    copies = [elsewhere / p.name for p in (train, aime24, aime25)]
    for src, dst in zip((train, aime24, aime25), copies, strict=True):
        dst.write_bytes(src.read_bytes())
    data.prepare_data(tmp_path / "b", *map(str, copies))
    assert data.read_manifest(tmp_path / "b")["digest"] == manifest["digest"]
    data.prepare_data(tmp_path / "c", str(train), str(aime24), str(aime25), data.DataFilter(dedupe=False))
    undeduped = data.read_manifest(tmp_path / "c")
    assert undeduped["digest"] != manifest["digest"] and undeduped["files"]["dapo_math_17k.parquet"]["rows_out"] == 5


def test_the_filters_and_what_each_removed(tmp_path: Path) -> None:
    """Answer format, prompt length in characters and in tokens of a local tokenizer, a user's id list."""
    rows = [{"problem": f"Problem {i}{' padded' * (i * 10)}", "answer": a, "id": f"p{i}"}
            for i, a in enumerate(["3", "1/2", "17", "-4", "x+1"])]
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(json.dumps(r) for r in rows))
    _, aime24, aime25 = write_fixtures(tmp_path)
    ids = tmp_path / "ids.txt"
    ids.write_text("# the ids to keep\np0\np2\n\np4\n")
    tok_dir = tmp_path / "tokenizer"
    tiny_tokenizer().save_pretrained(tok_dir)

    def prepare(name: str, **chosen) -> dict:
        data.prepare_data(tmp_path / name, str(train), str(aime24), str(aime25), data.DataFilter(**chosen))
        return data.read_manifest(tmp_path / name)["files"]["dapo_math_17k.parquet"]

    integer = prepare("int", answer_format="integer")
    assert (integer["rows_out"], integer["removed"]["answer_format"]) == (3, 2)
    truths = pq.read_table(tmp_path / "int" / "dapo_math_17k.parquet").to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in truths] == ["3", "17", "-4"]
    assert [r["extra_info"]["index"] for r in truths] == [0, 1, 2]  # re-indexed
    limit = len(data.PROMPT_TEMPLATE.format(problem=rows[2]["problem"]))
    short = prepare("chars", max_prompt_chars=limit)
    assert (short["rows_out"], short["removed"]["prompt_length"]) == (3, 2)
    kept = prepare("ids", ids_file=str(ids))
    assert (kept["rows_out"], kept["removed"]["ids"]) == (3, 2)
    assert [r["extra_info"]["source_id"] for r in pq.read_table(tmp_path / "ids" / "dapo_math_17k.parquet").to_pylist()] == ["p0", "p2", "p4"]
    tok = tiny_tokenizer()
    lengths = [data.prompt_tokens(tok, [{"role": "user", "content": data.PROMPT_TEMPLATE.format(problem=r["problem"])}])
               for r in rows]
    assert lengths == sorted(lengths) and lengths[0] < lengths[1] < lengths[2]
    tokens = prepare("tokens", max_prompt_tokens=lengths[1], tokenizer=str(tok_dir))
    assert tokens["rows_out"] == 2 and tokens["removed"]["prompt_length"] == 3
    manifest = data.read_manifest(tmp_path / "tokens")
    assert manifest["filter"]["max_prompt_tokens"] == lengths[1] and len(manifest["filter"]["tokenizer"]) == 64
    assert data.read_manifest(tmp_path / "ids")["filter"]["ids"]["count"] == 3


@pytest.mark.parametrize(("extra", "message"), [
    (["--train", "MISSING"], "no such file"),
    (["--answer-format", "words"], "--answer-format: 'words' is not one of any, integer"),
    (["--max-prompt-chars", "0"], "--max-prompt-chars: must be a whole number >= 1, got 0"),
    (["--max-prompt-tokens", "10"], "--max-prompt-tokens and --tokenizer go together"),
    (["--max-prompt-tokens", "10", "--tokenizer", "NOWHERE"], "nowhere: not a directory"),
    (["--ids", "IDS_EMPTY"], "no ids (it would keep no row)"),
    (["--ids", "IDS_BAD"], "not a JSON list"),
    (["--ids", "IDS_MISSING"], "no such file"),
    (["--ids", "IDS_OTHER"], "the filter keeps no row"),
])  # fmt: skip
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path: Path, extra: list[str], message: str) -> None:
    args = _fixture_args(tmp_path)
    (tmp_path / "empty.txt").write_text("# nothing\n")
    (tmp_path / "bad.json").write_text("[1, 2")
    (tmp_path / "other.txt").write_text("id-999\n")
    names = {"MISSING": str(tmp_path / "gone" / "missing.parquet"), "NOWHERE": str(tmp_path / "nowhere"),
             "IDS_EMPTY": str(tmp_path / "empty.txt"), "IDS_BAD": str(tmp_path / "bad.json"),
             "IDS_MISSING": str(tmp_path / "none.txt"), "IDS_OTHER": str(tmp_path / "other.txt")}
    extra = [names.get(e, e) for e in extra]
    if extra[0] == "--train":
        args = args[2:]
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["prepare", str(out), *args, *extra])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output
    assert not out.exists()


def test_a_corrupt_or_changed_manifest_is_refused(tmp_path: Path) -> None:
    train, aime24, aime25 = write_fixtures(tmp_path)
    out = tmp_path / "out"
    data.prepare_data(out, str(train), str(aime24), str(aime25))
    manifest = out / data.MANIFEST
    good = manifest.read_text()
    with pytest.raises(data.ManifestError, match="no manifest"):
        data.read_manifest(tmp_path)
    manifest.write_text(good[:40])
    with pytest.raises(data.ManifestError, match="corrupt manifest"):
        data.read_manifest(out)
    manifest.write_text(good.replace('"rows_out": 3', '"rows_out": 4'))
    with pytest.raises(data.ManifestError, match="its digest does not match its content"):
        data.read_manifest(out)
    manifest.write_text(good)
    pq.write_table(pa.Table.from_pylist([{"x": 1}]), out / "aime25.parquet")
    with pytest.raises(data.ManifestError, match=r"aime25\.parquet: changed since it was prepared"):
        data.read_manifest(out)


def test_the_run_config_carries_the_data_digest_and_it_is_in_the_run_key(tmp_path: Path, monkeypatch) -> None:
    """`pdmctl sweep` pins the data directory's manifest digest into each VeRL run (backend.data_manifest):
    the same data, the same key; other data, another key; a run naming other data than its directory holds,
    files without a manifest, a corrupt one: one line, exit 2, nothing written."""
    from pdmctl import grid, orchestrate
    from pdmctl.cli import app as main_app
    from pdmctl.executors.base import ExecutorError

    train, aime24, aime25 = write_fixtures(tmp_path)
    one, two = tmp_path / "one", tmp_path / "two"
    data.prepare_data(one, str(train), str(aime24), str(aime25))
    data.prepare_data(two, str(train), str(aime24), str(aime25), data.DataFilter(dedupe=False))
    monkeypatch.chdir(tmp_path)
    ctx = orchestrate.make_context("local", f"sqlite:///{tmp_path / 'mlflow.db'}")

    def pinned(*overrides: str):
        return orchestrate.pin_data(grid.expand(["backend=verl", "model=qwen3-4b-base", *overrides], sweep="s"), ctx)

    (a,) = pinned(f"backend.data_dir={one}")
    (b,) = pinned(f"backend.data_dir={two}")
    digest_a, digest_b = (data.read_manifest(d)["digest"] for d in (one, two))
    assert a.config["backend"]["data_manifest"] == digest_a and b.config["backend"]["data_manifest"] == digest_b
    assert a.key != b.key and pinned(f"backend.data_dir={one}")[0].key == a.key
    assert pinned(f"backend.data_dir={one}", f"backend.data_manifest={digest_a}")[0].key == a.key
    with pytest.raises(ExecutorError, match=r"backend\.data_manifest=.* asks for other data than its data directory holds"):
        pinned(f"backend.data_dir={one}", f"backend.data_manifest={digest_b}")
    from pdmctl.backends.registry import _verl_check_data, flat_config

    _verl_check_data(flat_config(a.config), tmp_path / "run")  # in the job: the data it was submitted on
    with pytest.raises(ValueError, match=r"holds data [0-9a-f]{16}, and this run was submitted on data"):
        _verl_check_data({**flat_config(a.config), "data_dir": str(two)}, tmp_path / "run")
    (tiny,) = orchestrate.pin_data(grid.expand(["backend=verl", "model=qwen3-tiny"], sweep="s"), ctx)  # own data
    assert tiny.config["backend"]["data_manifest"] is None
    (two / data.MANIFEST).write_text("{")
    res = CliRunner().invoke(main_app, ["sweep", "backend=verl", "model=qwen3-4b-base", f"backend.data_dir={two}",
                                        "--dry-run", "--tracking-uri", ctx.tracking_uri])  # fmt: skip
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1, res.output
    assert "manifest.json: corrupt manifest" in res.stderr and not (tmp_path / "mlflow.db").exists()
    (two / data.MANIFEST).unlink()
    with pytest.raises(ExecutorError, match="no manifest"):  # files prepared before manifests: prepared again
        pinned(f"backend.data_dir={two}")

