"""The shipped base models: where their files lie, their recorded digests, and the check before any run.

Every run starts from the base model of its preset, by default the weights shipped in the package
(`weights/<preset>.pt`), each checked against the SHA-256 digest recorded here: a file that does not match
(damaged, or replaced without updating this record) is refused, never trained from. The check reads bytes
only, so a grid is checked without torch; loading and rebuilding the weights is `basemodel`'s, and so is the
check of `PDMCTL_TOY_BASE=warmup`, a base rebuilt on the machine (its cache key names the torch version).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from pathlib import Path

from pdmctl.backends.toy.presets import MODEL_PRESETS

WEIGHTS_DIR = Path(__file__).parent / "weights"
SHIPPED_FORMAT = 1
# The digest of each shipped file: a file that does not match (damaged, or replaced without updating
# this line) is refused, never trained from.
SHIPPED_SHA256 = {
    "toy-small": "4872ae51c589ab9e0d35b260eb74c151fbfe64129f7695bf7bf5a6201bb9d71f",
    "toy-llm": "d7b22b93d728f2c274d6080a44ee254761ba998c0a5c3724cd9b982e092e9015",
    "toy-fork": "aee862551f7a34f12baf61cd1a9fb717c989d232916baa67f483d156d2d6cada",
}
SOURCES = ("shipped", "warmup")  # PDMCTL_TOY_BASE
# a model plugin's base model file (pdmctl.plugins registers it, and its digest in SHIPPED_SHA256)
PLUGIN_WEIGHTS: dict[str, Path] = {}


class BaseModelError(RuntimeError):
    """The base model cannot be had: a damaged shipped file, an unknown source, a warm-up that failed."""


def base_source() -> str:
    source = os.environ.get("PDMCTL_TOY_BASE", "").strip() or "shipped"
    if source not in SOURCES:
        raise BaseModelError(f"PDMCTL_TOY_BASE: unknown {source!r}; choose from {', '.join(SOURCES)}")
    return source


def source_of(preset_name: str) -> str:
    """Where a preset's base model comes from: `base_source()`, except for a preset with no recorded file (a
    model plugin's without weights), whose base is always the warm-up's."""
    source = base_source()
    return source if preset_name in SHIPPED_SHA256 else "warmup"


def shipped_path(preset_name: str) -> Path:
    return PLUGIN_WEIGHTS.get(preset_name) or WEIGHTS_DIR / f"{preset_name}.pt"


def sha256_of(path: Path) -> str:
    stat = path.stat()
    return _sha256_of(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _sha256_of(path: str, size: int, mtime_ns: int) -> str:
    """A file's digest, once per version of it (size and mtime are the key): a grid of 1,000 runs checks
    the shipped base model once, not 1,000 times."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def recipe_of(preset_name: str) -> dict:
    """What decides a base model's weights, as the shipped file records it."""
    return {"preset": preset_name, **dataclasses.asdict(MODEL_PRESETS[preset_name])}


def check_shipped(preset_name: str, path: Path | None = None) -> Path:
    """The shipped file of a preset, its digest checked; BaseModelError in one line if it is not the one."""
    path = path or shipped_path(preset_name)
    expected = SHIPPED_SHA256.get(preset_name)
    if not path.is_file():
        raise BaseModelError(
            f"{path}: the shipped base model of {preset_name!r} is missing; reinstall pdmctl"
        )
    digest = sha256_of(path)
    if digest != expected:
        raise BaseModelError(
            f"{path}: SHA-256 {digest[:12]}… is not the recorded {str(expected)[:12]}…: the shipped base "
            "model is damaged or was replaced; reinstall pdmctl, or rebuild it with "
            "`python -m pdmctl.backends.toy.rebuild_base`"
        )
    return path
