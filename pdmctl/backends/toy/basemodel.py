"""The base model: weights shipped with the package, and the warm-up that makes them.

Every run starts from the same base on every machine: the weights of each preset
are a small file in the package (`weights/<preset>.pt`, about 1.2 MB), checked
against the SHA-256 digest recorded in `shipped` before use (that check needs no
torch). The warm-up that wrote them is the documented way to rebuild them (`python -m
pdmctl.backends.toy.rebuild_base`), and `PDMCTL_TOY_BASE=warmup` makes every run use a base rebuilt on this
machine instead (CI runs the testbed's tests that way under other CPU kernels).

Why ship weights: a fixed-length warm-up was stopped where rounding decided the
outcome. The second answer digit is learned in a sudden transition whose step
moves by hundreds of steps with the CPU's summation order (AVX-512, AVX2 or
scalar kernels), so the same code gave a base scoring 0.06 on one machine and
0.45 on another. The warm-up now trains to a criterion (both answer digits
greedy-correct on a probe set of training problems), then anneals the learning
rate to 0, so its outcome is the recipe's converged model on any machine; and
the shipped file makes it the same model bit for bit (docs/TESTBED.md).

A rebuilt base is cached on disk (`PDMCTL_CACHE`), shared by every run on the
machine: eight jobs may ask for it at once, so one builds it under an exclusive
file lock while the others wait, and the file appears by an atomic rename. Its
cache key is everything that decides the weights: the preset, the source of the
modules that build and train the model (this one, `model`, `task`, `presets`) and the
torch version; an entry that does not load, or whose recorded key is not the one asked
for, is rebuilt. The warm-up runs on one thread so the weights do not depend on
the machine's core count.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pdmctl.backends.toy import fork_task, llm_task
from pdmctl.backends.toy import model as model_module
from pdmctl.backends.toy import presets as presets_module
from pdmctl.backends.toy import task as task_module
from pdmctl.backends.toy.model import (
    MODEL_PRESETS,
    ForkPreset,
    LLMPreset,
    ModelPreset,
    TinyTransformer,
    build_model,
)
from pdmctl.backends.toy.shipped import (  # noqa: F401  (re-exported: basemodel.check_shipped, ...)
    SHIPPED_FORMAT,
    SHIPPED_SHA256,
    SOURCES,
    WEIGHTS_DIR,
    BaseModelError,
    base_source,
    check_shipped,
    recipe_of,
    sha256_of,
    shipped_path,
    source_of,
)
from pdmctl.backends.toy.task import (
    FREE_LEN,
    VARIANTS,
    demonstrations,
    form,
    is_careful,
    sample_train,
    sample_words,
)

# what the warm-up runs, and the presets' defaults
_CODE = (Path(__file__), Path(model_module.__file__), Path(task_module.__file__), Path(presets_module.__file__))
PROBE_SIZE = 1024


def load_base_model(preset_name: str) -> TinyTransformer:
    """The base model of a preset: the shipped weights, or (PDMCTL_TOY_BASE=warmup) the warm-up's."""
    if source_of(preset_name) == "shipped":
        return load_shipped(preset_name)
    return load_warmed_up(preset_name)


# ---------------------------------------------------------------------------
# The shipped weights
# ---------------------------------------------------------------------------


def load_shipped(preset_name: str, path: Path | None = None) -> TinyTransformer:
    path = check_shipped(preset_name, path)
    entry = torch.load(path, weights_only=True)
    if entry.get("recipe") != recipe_of(preset_name):
        raise BaseModelError(
            f"{path}: written by another warm-up recipe than {preset_name!r}'s; rebuild it with "
            "`python -m pdmctl.backends.toy.rebuild_base`"
        )
    model = TinyTransformer(MODEL_PRESETS[preset_name])
    model.load_state_dict(entry["state_dict"])
    return model


def write_shipped(preset_name: str, path: Path | None = None) -> tuple[Path, str, WarmUpReport]:
    """Run the warm-up and write its weights as the shipped file (or at `path`); its path, digest and report."""
    model, report = warm_up_with_report(preset_name)
    path = path or shipped_path(preset_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {
        "format": SHIPPED_FORMAT,
        "recipe": recipe_of(preset_name),
        "built_with": {
            "torch": str(torch.__version__),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            **dataclasses.asdict(report),
        },
        "state_dict": model.state_dict(),
    }
    save_atomically(entry, path)
    path.chmod(0o644)  # a package file, not a private temporary one
    return path, sha256_of(path), report


# ---------------------------------------------------------------------------
# The warm-up, and its cache
# ---------------------------------------------------------------------------


def cache_dir() -> Path:
    from pdmctl.cache import CacheError
    from pdmctl.cache import cache_dir as pdmctl_cache

    try:
        return pdmctl_cache(Path.home() / ".cache" / "pdmctl" / "toy-base")
    except CacheError as exc:
        raise BaseModelError(str(exc)) from None


def check_base_model(preset_name: str) -> None:
    """Before any work (BaseModelError, one line): the shipped file whole, or (warm-up) a cache that holds
    the base already or can take its build."""
    from pdmctl.cache import CacheError, check_writable_dir

    if source_of(preset_name) == "shipped":
        check_shipped(preset_name)
        return
    path = base_model_path(preset_name)
    if path.is_file():
        return
    try:
        check_writable_dir(path.parent, "PDMCTL_TOY_BASE=warmup: the warm-up's cache")
    except CacheError as exc:
        raise BaseModelError(str(exc)) from None


def cache_key(preset_name: str) -> str:
    """A digest of everything that decides the base model's weights."""
    digest = hashlib.sha256()
    digest.update(json.dumps(recipe_of(preset_name), sort_keys=True).encode())
    digest.update(torch.__version__.encode())
    preset = MODEL_PRESETS[preset_name]
    extra = (Path(llm_task.__file__),) if isinstance(preset, LLMPreset) else ()
    extra += (Path(fork_task.__file__),) if isinstance(preset, ForkPreset) else ()
    for source in (*_CODE, *extra):
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


def base_model_path(preset_name: str) -> Path:
    return cache_dir() / f"{preset_name}-{cache_key(preset_name)}.pt"


def load_warmed_up(preset_name: str) -> TinyTransformer:
    """The warm-up's model of a preset, built on first use and rebuilt when its entry is stale or corrupt."""
    key, path = cache_key(preset_name), base_model_path(preset_name)
    model = _load(path, preset_name, key)
    if model is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            model = _load(path, preset_name, key)  # another process may have built it while we waited
            if model is None:
                model, report = warm_up_with_report(preset_name)
                save_atomically(
                    {"key": key, "state_dict": model.state_dict(), "report": dataclasses.asdict(report)}, path
                )
    return model


def cached_warm_up_report(preset_name: str) -> WarmUpReport | None:
    """How the cached warm-up of a preset went (None when there is none, or it predates reports)."""
    try:
        entry = torch.load(base_model_path(preset_name), weights_only=True)
        return WarmUpReport(**entry["report"])
    except Exception:
        return None


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


@dataclass(frozen=True)
class WarmUpReport:
    criterion_step: int  # the step at which the probe first met the criterion (phase 1's end)
    steps: int  # all steps, the anneal included
    first_digit_accuracy: float  # the probe's greedy accuracies at the end
    second_digit_accuracy: float


def warm_up(
    preset_name: str, on_step: Callable[[int, TinyTransformer], None] | None = None
) -> TinyTransformer:
    return warm_up_with_report(preset_name, on_step)[0]


def warm_up_with_report(
    preset_name: str, on_step: Callable[[int, TinyTransformer], None] | None = None
) -> tuple[TinyTransformer, WarmUpReport]:
    """Supervised training on noisy demonstrations (task.demonstrations): a Zipf-drawn word, then
    the answer, its first digit in a Zipf-drawn form.

    The first digit is replaced by a random digit with probability
    `careful_lead_label_noise` after a careful word and `lead_label_noise`
    after the others, the second with probability `label_noise`; so the model
    learns the right answer as its mode but puts real mass on other digits:
    its samples at temperature 1.0 are often wrong, and RL gains by choosing
    words and sharpening digits, as it does for an LLM.

    Phase 1 trains at a constant learning rate until the greedy answer of both
    digits is right on `warmup_criterion` of a fixed probe set of training
    problems (checked every `warmup_check_every` steps; BaseModelError past
    `warmup_steps`); phase 2 decays the learning rate linearly to 0 over
    `warmup_anneal_steps`, so the model settles where the label noise puts it.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a multi-threaded reduction may sum in another order: other weights
    try:
        return _warm_up(preset_name, on_step)
    finally:
        torch.set_num_threads(threads)


def _warm_up(
    preset_name: str, on_step: Callable[[int, TinyTransformer], None] | None
) -> tuple[TinyTransformer, WarmUpReport]:
    preset = MODEL_PRESETS[preset_name]
    model = build_model(preset, preset.warmup_seed)
    generator = torch.Generator().manual_seed(preset.warmup_seed)
    if isinstance(preset, ForkPreset):  # the fork task's (its slots are forks: the probe skips them)
        probe, accuracy, train_step = _fork_probe_set(preset), llm_probe_accuracy, _fork_warm_up_step
    elif isinstance(preset, LLMPreset):  # the LLM-like task's demonstrations and probe
        probe, accuracy, train_step = _llm_probe_set(preset), llm_probe_accuracy, _llm_warm_up_step
    else:
        probe, accuracy, train_step = _probe_set(preset), probe_accuracy, _warm_up_step
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=preset.warmup_lr, weight_decay=preset.warmup_weight_decay
    )
    step, criterion_step = 0, None
    while criterion_step is None:
        if step >= preset.warmup_steps:
            first, second = accuracy(model, probe)
            raise BaseModelError(
                f"{preset_name}: the warm-up did not reach its criterion ({preset.warmup_criterion:.0%} greedy-"
                f"correct answer digits) in {preset.warmup_steps} steps: first digit {first:.1%}, second "
                f"{second:.1%}"
            )
        train_step(model, optimizer, preset, generator)
        step += 1
        if on_step is not None:
            on_step(step, model)
        if step % preset.warmup_check_every == 0 and min(accuracy(model, probe)) >= preset.warmup_criterion:
            criterion_step = step
    for i in range(preset.warmup_anneal_steps):
        for group in optimizer.param_groups:
            group["lr"] = preset.warmup_lr * (1 - i / preset.warmup_anneal_steps)
        train_step(model, optimizer, preset, generator)
        step += 1
        if on_step is not None:
            on_step(step, model)
    first, second = accuracy(model, probe)
    return model, WarmUpReport(criterion_step, step, first, second)


def _warm_up_step(
    model: TinyTransformer, optimizer: torch.optim.Optimizer, preset: ModelPreset, generator: torch.Generator
) -> None:
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


@dataclass(frozen=True)
class _Probe:
    tokens: torch.Tensor  # long [N, P + 3]: prompt, word, the plain first digit, the second digit
    answers: torch.Tensor  # long [N, 2]


def _probe_set(preset: ModelPreset) -> _Probe:
    """A fixed set of training problems (a generator of its own: the training stream is unchanged),
    each behind a Zipf-drawn word, answered correctly: what the probe reads the greedy answer from."""
    generator = torch.Generator().manual_seed(preset.warmup_seed + 1_000_003)
    problems = sample_train(PROBE_SIZE, generator)
    words = sample_words(PROBE_SIZE, generator)
    answers = problems.answers[:, :2]
    tokens = torch.cat([problems.prompts, words.unsqueeze(1), answers], dim=1)
    return _Probe(tokens, answers)


@torch.no_grad()
def probe_accuracy(model: TinyTransformer, probe: _Probe) -> tuple[float, float]:
    """Greedy accuracy on the probe of the first digit (the digit whose forms hold the most mass,
    teacher-forced after the word) and of the second (the most likely token after the right first)."""
    logits = model(probe.tokens[:, :-1], last=2)  # predicting the first digit, then the second
    probs = logits[:, 0].softmax(-1)
    forms = form(torch.arange(10).unsqueeze(1), torch.arange(VARIANTS).unsqueeze(0))  # [10, VARIANTS]
    by_digit = probs[:, forms.reshape(-1)].view(-1, 10, VARIANTS).sum(-1)
    first = (by_digit.argmax(-1) == probe.answers[:, 0]).float().mean()
    second = (logits[:, 1].argmax(-1) == probe.answers[:, 1]).float().mean()
    return float(first), float(second)


# ---------------------------------------------------------------------------
# The LLM-like task's warm-up (llm_task): the same two phases, its own demonstrations and probe
# ---------------------------------------------------------------------------


def _llm_demonstrations(
    preset: LLMPreset, n: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts, noisy demonstrated responses and the bool [n] "has the work", drawn from `generator`."""
    problems, words, work, answers = _llm_draws(preset, llm_task.sample_train(n, generator), generator)
    return problems.prompts, llm_task.responses(problems.prompts, words, work, answers), work


def _llm_draws(preset: LLMPreset, problems, generator: torch.Generator):
    """After the problems: the words, "has the work" and the noisy answers of the demonstrations."""
    n = len(problems.prompts)
    words = llm_task.sample_words(n, generator)
    p_work = torch.where(llm_task.is_careful(words), preset.work_after_careful, preset.work_after_other)
    work = torch.rand(n, generator=generator) < p_work
    noise = torch.where(work, preset.noise_with_work, preset.noise_without_work).unsqueeze(1)
    noisy = torch.rand(problems.answers.shape, generator=generator) < noise
    random_digits = torch.randint(10, problems.answers.shape, generator=generator)
    return problems, words, work, torch.where(noisy, random_digits, problems.answers)


def _llm_warm_up_step(
    model: TinyTransformer, optimizer: torch.optim.Optimizer, preset: LLMPreset, generator: torch.Generator,
    demonstrations=None,
) -> None:
    """One supervised step on a batch of demonstrations (`_llm_demonstrations`, or the fork task's)."""
    prompts, targets, work = (demonstrations or _llm_demonstrations)(preset, preset.warmup_batch, generator)
    lengths = torch.where(work, llm_task.LONG_LEN, llm_task.SHORT_LEN)
    logits = model(torch.cat([prompts, targets], dim=1)[:, :-1], last=targets.shape[1])
    in_response = torch.arange(targets.shape[1]) < lengths.unsqueeze(1)
    token_loss = F.cross_entropy(
        logits.reshape(-1, preset.vocab_size),
        targets.reshape(-1),
        label_smoothing=preset.label_smoothing,
        reduction="none",
    )
    loss = (token_loss * in_response.reshape(-1)).sum() / in_response.sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


@dataclass(frozen=True)
class _LLMProbe:
    tokens: torch.Tensor  # long [N, P + MAX_RESPONSE_LEN]: prompt and a correct response, half of each form
    answer: torch.Tensor  # bool [N, MAX_RESPONSE_LEN]: the positions of the answer digits
    determined: torch.Tensor  # bool [N, MAX_RESPONSE_LEN]: the other positions after the fork, EOS included


def _llm_probe_set(preset: LLMPreset) -> _LLMProbe:
    generator = torch.Generator().manual_seed(preset.warmup_seed + 1_000_003)
    problems = llm_task.sample_train(PROBE_SIZE, generator)
    words = llm_task.sample_words(PROBE_SIZE, generator)
    work = torch.arange(PROBE_SIZE) % 2 == 0
    targets = llm_task.responses(problems.prompts, words, work, problems.answers)
    positions = torch.arange(llm_task.MAX_RESPONSE_LEN)
    start = torch.where(work, llm_task.ANSWER_OFFSET[True], llm_task.ANSWER_OFFSET[False]).unsqueeze(1)
    answer = (positions >= start) & (positions < start + llm_task.ANSWER_LEN)
    length = torch.where(work, llm_task.LONG_LEN, llm_task.SHORT_LEN).unsqueeze(1)
    determined = (positions >= 2) & (positions < length) & ~answer
    return _LLMProbe(torch.cat([problems.prompts, targets], dim=1), answer, determined)


@torch.no_grad()
def llm_probe_accuracy(model: TinyTransformer, probe: _LLMProbe) -> tuple[float, float]:
    """Teacher-forced greedy accuracy on the probe: of the answer digits, and of the deterministic
    positions (the work, the markers, EOS). WarmUpReport records them as its first and second."""
    logits = model(probe.tokens[:, :-1], last=llm_task.MAX_RESPONSE_LEN)
    right = logits.argmax(-1) == probe.tokens[:, -llm_task.MAX_RESPONSE_LEN :]
    return float(right[probe.answer].float().mean()), float(right[probe.determined].float().mean())


# ---------------------------------------------------------------------------
# The fork task's warm-up (fork_task): toy-llm's, with the phrasing slots drawn in the demonstrations
# ---------------------------------------------------------------------------


def _fork_demonstrations(
    preset: ForkPreset, n: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_llm_demonstrations` with each long response's slots drawn from fork_task.slot_law."""
    problems, words, work, answers = _llm_draws(preset, fork_task.sample_train(n, generator), generator)
    slots = fork_task.slot_tokens(fork_task.sample_slots(problems.prompts, generator))
    return problems.prompts, fork_task.responses(problems.prompts, words, work, answers, slots), work


def _fork_warm_up_step(
    model: TinyTransformer, optimizer: torch.optim.Optimizer, preset: ForkPreset, generator: torch.Generator
) -> None:
    """toy-llm's step (the fork task's lengths are toy-llm's) on the fork task's demonstrations."""
    _llm_warm_up_step(model, optimizer, preset, generator, _fork_demonstrations)


def _fork_probe_set(preset: ForkPreset) -> _LLMProbe:
    """`_llm_probe_set` of the fork task: each slot filled with its likeliest option; the slots are forks,
    so they count as neither answer nor determined positions."""
    generator = torch.Generator().manual_seed(preset.warmup_seed + 1_000_003)
    problems = fork_task.sample_train(PROBE_SIZE, generator)
    words = llm_task.sample_words(PROBE_SIZE, generator)
    work = torch.arange(PROBE_SIZE) % 2 == 0
    slots = fork_task.slot_tokens(fork_task.slot_law(problems.prompts).argmax(-1))
    targets = fork_task.responses(problems.prompts, words, work, problems.answers, slots)
    positions = torch.arange(fork_task.MAX_RESPONSE_LEN)
    start = torch.where(work, llm_task.ANSWER_OFFSET[True], llm_task.ANSWER_OFFSET[False]).unsqueeze(1)
    answer = (positions >= start) & (positions < start + llm_task.ANSWER_LEN)
    length = torch.where(work, fork_task.LONG_LEN, fork_task.SHORT_LEN).unsqueeze(1)
    slot = torch.isin(positions, torch.tensor(fork_task.SLOT_POSITIONS)) & work.unsqueeze(1)
    determined = (positions >= 2) & (positions < length) & ~answer & ~slot
    return _LLMProbe(torch.cat([problems.prompts, targets], dim=1), answer, determined)


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
