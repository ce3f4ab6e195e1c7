"""The base model: a short, deterministic supervised warm-up, cached on disk by its preset.

The warm-up is stopped early on purpose, so that held-out avg@16 starts low
but not at zero and RL has something to sharpen. The forms of the answer's first
digit give that position a long tail (task.py), and label smoothing keeps a
little mass on the whole vocabulary everywhere: the tails the masks must see.

The cache is shared by every run on the machine: eight jobs may ask for the
same base model at once, so one builds it under an exclusive file lock while
the others wait, and the file appears by an atomic rename, whole or not at all.

The cache key is everything that decides the weights: the preset, the source
of the modules that build and train the model (this one, `model`, `task`) and
the torch version. A base built by other code therefore gets another file
instead of being reused, and an entry that does not load, or whose recorded key
is not the one asked for, is rebuilt. The warm-up runs on one thread so the
weights do not depend on the machine's core count.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from pdmctl.backends.toy import model as model_module
from pdmctl.backends.toy import task as task_module
from pdmctl.backends.toy.model import MODEL_PRESETS, TinyTransformer, build_model
from pdmctl.backends.toy.task import FREE_LEN, demonstrations, is_careful, sample_train, sample_words

_CODE = (Path(__file__), Path(model_module.__file__), Path(task_module.__file__))  # what the warm-up runs


def cache_dir() -> Path:
    return Path(os.environ.get("PDMCTL_CACHE") or Path.home() / ".cache" / "pdmctl" / "toy-base")


def cache_key(preset_name: str) -> str:
    """A digest of everything that decides the base model's weights."""
    digest = hashlib.sha256()
    preset = {"preset": preset_name, **dataclasses.asdict(MODEL_PRESETS[preset_name])}
    digest.update(json.dumps(preset, sort_keys=True).encode())
    digest.update(torch.__version__.encode())
    for source in _CODE:
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


def base_model_path(preset_name: str) -> Path:
    return cache_dir() / f"{preset_name}-{cache_key(preset_name)}.pt"


def load_base_model(preset_name: str) -> TinyTransformer:
    """The base model of a preset, built on first use and rebuilt when its entry is stale or corrupt."""
    key, path = cache_key(preset_name), base_model_path(preset_name)
    model = _load(path, preset_name, key)
    if model is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            model = _load(path, preset_name, key)  # another process may have built it while we waited
            if model is None:
                model = warm_up(preset_name)
                save_atomically({"key": key, "state_dict": model.state_dict()}, path)
    return model


def _load(path: Path, preset_name: str, key: str) -> TinyTransformer | None:
    """The cached model, or None where the entry is missing, unreadable, or recorded under another key."""
    try:
        entry = torch.load(path, weights_only=True)
        if not isinstance(entry, dict) or entry.get("key") != key:
            return None
        model = TinyTransformer(MODEL_PRESETS[preset_name])
        model.load_state_dict(entry["state_dict"])
    except FileNotFoundError:
        return None
    except Exception:  # truncated, not a torch file, other shapes: rebuilt, never used
        return None
    return model


def warm_up(
    preset_name: str, on_step: Callable[[int, TinyTransformer], None] | None = None
) -> TinyTransformer:
    """Supervised training on noisy demonstrations (task.demonstrations): a Zipf-drawn word, then
    the answer, its first digit in a Zipf-drawn form.

    The first digit is replaced by a random digit with probability
    `careful_lead_label_noise` after a careful word and `lead_label_noise`
    after the others, the second with probability `label_noise`; so the model
    learns the right answer as its mode but puts real mass on other digits:
    its samples at temperature 1.0 are often wrong, and RL gains by choosing
    words and sharpening digits, as it does for an LLM.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a multi-threaded reduction may sum in another order: other weights
    try:
        return _warm_up(preset_name, on_step)
    finally:
        torch.set_num_threads(threads)


def _warm_up(preset_name: str, on_step: Callable[[int, TinyTransformer], None] | None) -> TinyTransformer:
    preset = MODEL_PRESETS[preset_name]
    model = build_model(preset, preset.warmup_seed)
    generator = torch.Generator().manual_seed(preset.warmup_seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=preset.warmup_lr)
    for step in range(preset.warmup_steps):
        problems = sample_train(preset.warmup_batch, generator)
        words = sample_words(len(problems), generator)
        is_digit = problems.answers < 10
        noise = torch.full(is_digit.shape, preset.label_noise)
        noise[:, 0] = torch.where(is_careful(words), preset.careful_lead_label_noise, preset.lead_label_noise)
        noisy = is_digit & (torch.rand(is_digit.shape, generator=generator) < noise)
        random_digits = torch.randint(10, is_digit.shape, generator=generator)
        targets = demonstrations(words, torch.where(noisy, random_digits, problems.answers), generator)
        tokens = torch.cat([problems.prompts, targets], dim=1)
        logits = model(tokens[:, :-1], last=targets.shape[1])  # the positions that predict the answer
        in_answer = torch.arange(targets.shape[1]) < FREE_LEN + problems.answer_lens.unsqueeze(1)
        token_loss = F.cross_entropy(
            logits.reshape(-1, preset.vocab_size),
            targets.reshape(-1),
            label_smoothing=preset.label_smoothing,
            reduction="none",
        )
        loss = (token_loss * in_answer.reshape(-1)).sum() / in_answer.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if on_step is not None:
            on_step(step + 1, model)
    return model


def save_atomically(obj: object, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
