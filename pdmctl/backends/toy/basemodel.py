"""The base model: a short, deterministic supervised warm-up, cached on disk by its preset.

The warm-up is stopped early on purpose, so that held-out avg@16 starts low
but not at zero and RL has something to sharpen; label smoothing keeps a few
percent of the mass on the whole vocabulary, the tail the masks must see.

The cache is shared by every run on the machine: eight jobs may ask for the
same base model at once, so one builds it under an exclusive file lock while
the others wait, and the file appears by an atomic rename, whole or not at all.
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

from pdmctl.backends.toy.model import MODEL_PRESETS, TinyTransformer, build_model
from pdmctl.backends.toy.task import sample_train

_FORMAT = 1  # bump when the task or the warm-up changes what a preset produces


def cache_dir() -> Path:
    return Path(os.environ.get("PDMCTL_CACHE") or Path.home() / ".cache" / "pdmctl" / "toy-base")


def base_model_path(preset_name: str) -> Path:
    config = {"format": _FORMAT, "preset": preset_name, **dataclasses.asdict(MODEL_PRESETS[preset_name])}
    key = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"{preset_name}-{key}.pt"


def load_base_model(preset_name: str) -> TinyTransformer:
    """The base model of a preset, built on first use."""
    path = base_model_path(preset_name)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if not path.exists():  # another process may have built it while we waited
                save_atomically(warm_up(preset_name).state_dict(), path)
    model = TinyTransformer(MODEL_PRESETS[preset_name])
    model.load_state_dict(torch.load(path, weights_only=True))
    return model


def warm_up(
    preset_name: str, on_step: Callable[[int, TinyTransformer], None] | None = None
) -> TinyTransformer:
    """Supervised training on noisy demonstrations: answers whose digits are sometimes wrong.

    Each answer digit is replaced by a random digit with probability
    `label_noise`, so the model learns the right answer as its mode but puts
    real mass on other digits: its samples at temperature 1.0 are often
    wrong, its greedy answers often right, and RL gains by sharpening, as it
    does for an LLM.
    """
    preset = MODEL_PRESETS[preset_name]
    model = build_model(preset, preset.warmup_seed)
    generator = torch.Generator().manual_seed(preset.warmup_seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=preset.warmup_lr)
    for step in range(preset.warmup_steps):
        problems = sample_train(preset.warmup_batch, generator)
        is_digit = problems.answers < 10
        noisy = is_digit & (torch.rand(is_digit.shape, generator=generator) < preset.label_noise)
        random_digits = torch.randint(10, is_digit.shape, generator=generator)
        targets = torch.where(noisy, random_digits, problems.answers)
        tokens = torch.cat([problems.prompts, targets], dim=1)
        logits = model(tokens[:, :-1], last=targets.shape[1])  # the positions that predict the answer
        in_answer = torch.arange(targets.shape[1]) < problems.answer_lens.unsqueeze(1)
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
