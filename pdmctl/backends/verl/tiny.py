"""The tiny Qwen3 and its data, made on this machine (no model hub): what `model=qwen3-tiny` trains.

    python -m pdmctl.backends.verl.tiny DIR        (or `pdmctl data prepare --tiny DIR`)

writes, deterministically (fixed seeds, one thread):

    DIR/model/   a 2-layer Qwen3 (hidden 128, 4 heads / 2 KV heads) with a byte-level BPE
                 tokenizer trained on the task's own text, a chat template, and a short
                 supervised warm-up so the rollout's rewards are neither all 0 nor all 1
    DIR/data/    train.parquet (data_source math_dapo), aime24.parquet and aime25.parquet:
                 one-digit sums in VeRL's parquet layout. The held-out sources are named
                 aime24/aime25 so VeRL's validation reports `val-core/aime24/acc/mean@16`,
                 which the ledger stores as eval/aime24 and eval/aime25 like a real run's.

The answer line is "Answer: N", the form VeRL's `math_dapo` scorer (the default for
these data sources) reads. `ensure(DIR)` builds once and reuses: a finished build
leaves a stamp naming the recipe, concurrent jobs wait on a lock, a half-written
build (a killed job) is thrown away and made again.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import random
import shutil
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

RECIPE_VERSION = 2  # bump when anything below changes what is written
STAMP = "pdmctl-tiny.json"
TRAIN_FILE = "train.parquet"
VAL_FILES = ("aime24.parquet", "aime25.parquet")
EOS = "<|endoftext|>"
# Qwen's ChatML markers: VeRL's agent loop (its Qwen continuous-token builder) requires <|im_end|>
CHATML = ("<|im_start|>", "<|im_end|>")
# The chat template renders a conversation as its user turns, then the generation prompt " ".
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ ' ' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyRecipe:
    hidden_size: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    vocab_size: int = 400  # BPE target; the embedding is padded to a multiple of 64
    warmup_steps: int = 150  # supervised steps on correct answers (~10 s on one core)
    warmup_lr: float = 3e-3
    seed: int = 0
    version: int = RECIPE_VERSION


def problems(split: str) -> list[tuple[str, str]]:
    """(question, answer) pairs: "a+b=" over one-digit a, b; each split its own disjoint pairs."""
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(1234).shuffle(pairs)
    ranges = {"train": pairs[:68], "aime24": pairs[68:84], "aime25": pairs[84:100]}
    return [(f"{a}+{b}=", str(a + b)) for a, b in ranges[split]]


def verl_rows(split: str, data_source: str) -> list[dict[str, Any]]:
    return [
        {
            "data_source": data_source,
            "prompt": [{"role": "user", "content": question}],
            "ability": "MATH",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": index, "problem": question},
        }
        for index, (question, answer) in enumerate(problems(split))
    ]


def completion(answer: str) -> str:
    return f"Answer: {answer}"


def build(out_dir: Path, recipe: TinyRecipe = TinyRecipe()) -> None:
    """Write model/ and data/ under `out_dir` (which must not hold a finished build)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data_dir = out_dir / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(verl_rows("train", "math_dapo")), data_dir / TRAIN_FILE)
    for filename in VAL_FILES:
        source = filename.removesuffix(".parquet")
        pq.write_table(pa.Table.from_pylist(verl_rows(source, source)), data_dir / filename)
    tokenizer = _train_tokenizer(recipe)
    model = _init_model(recipe, tokenizer)
    _warm_up(model, tokenizer, recipe)
    model_dir = out_dir / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    model.generation_config.save_pretrained(model_dir)


def _corpus() -> Iterator[str]:
    for split in ("train", "aime24", "aime25"):
        for question, answer in problems(split):
            yield f"{question} {completion(answer)}"
    # digits and the answer line in every combination, so sums the train set lacks still tokenize the same
    for n in range(19):
        yield completion(str(n))


def _train_tokenizer(recipe: TinyRecipe) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.vocab_size,
        special_tokens=[EOS, *CHATML],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # any byte stays representable
        show_progress=False,
    )
    bpe.train_from_iterator(list(_corpus()), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, pad_token=EOS)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _init_model(recipe: TinyRecipe, tokenizer: Any) -> Any:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(recipe.seed)
    config = Qwen3Config(
        vocab_size=(len(tokenizer) + 63) // 64 * 64,  # vLLM and FSDP like aligned embeddings
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.layers,
        num_attention_heads=recipe.heads,
        num_key_value_heads=recipe.kv_heads,
        head_dim=recipe.head_dim,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        torch_dtype="float32",
    )
    model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def _warm_up(model: Any, tokenizer: Any, recipe: TinyRecipe) -> None:
    """Supervised steps on the train set's correct completions: the answer format and some sums."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same float sums in the same order: the same weights everywhere
    try:
        generator = torch.Generator().manual_seed(recipe.seed)
        texts = [
            (tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True), completion(a) + EOS)
            for q, a in problems("train")
        ]  # fmt: skip
        prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p, _ in texts]
        answers = [tokenizer(c, add_special_tokens=False)["input_ids"] for _, c in texts]
        width = max(len(p) + len(a) for p, a in zip(prompts, answers, strict=True))
        ids = torch.full((len(texts), width), tokenizer.pad_token_id)
        labels = torch.full((len(texts), width), -100)
        attention = torch.zeros((len(texts), width), dtype=torch.long)
        for row, (p, a) in enumerate(zip(prompts, answers, strict=True)):
            ids[row, : len(p) + len(a)] = torch.tensor(p + a)
            labels[row, len(p) : len(p) + len(a)] = torch.tensor(a)  # loss on the completion only
            attention[row, : len(p) + len(a)] = 1
        optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.warmup_lr)
        model.train()
        for _ in range(recipe.warmup_steps):
            batch = torch.randperm(len(texts), generator=generator)[:16]
            loss = model(input_ids=ids[batch], attention_mask=attention[batch], labels=labels[batch]).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        model.eval()
    finally:
        torch.set_num_threads(threads)


def is_built(out_dir: Path, recipe: TinyRecipe = TinyRecipe()) -> bool:
    stamp = out_dir / STAMP
    return stamp.is_file() and json.loads(stamp.read_text()) == asdict(recipe)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def ensure(out_dir: Path, recipe: TinyRecipe = TinyRecipe()) -> Path:
    """Build the tiny model and data at `out_dir` unless a finished build of this recipe is there."""
    out_dir = out_dir.resolve()
    with _locked(out_dir.with_name(out_dir.name + ".lock")):
        if is_built(out_dir, recipe):
            return out_dir
        partial = out_dir.with_name(out_dir.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        build(partial, recipe)
        (partial / STAMP).write_text(json.dumps(asdict(recipe)))
        shutil.rmtree(out_dir, ignore_errors=True)
        partial.rename(out_dir)  # a reader sees a whole build or none
    return out_dir


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m pdmctl.backends.verl.tiny DIR", file=sys.stderr)
        sys.exit(2)
    print(ensure(Path(args[0])))


if __name__ == "__main__":
    main()
