"""The testbed's model presets and the names of its weight precisions, without torch.

Expanding a grid validates every run's `model` and `precision` against these; the model (`model`) and
the base model (`basemodel`) build from them. The task sizes a preset needs are written here as plain
numbers (tests hold them equal to `task`'s and `llm_task`'s), so reading a preset loads no task code.
A preset's fields, through `dataclasses.asdict`, are the recipe a shipped base model records
(`shipped.recipe_of`): a changed value needs rebuilt weights.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

VOCAB_SIZE = 4096  # task.VOCAB_SIZE
PROMPT_LEN = 6  # task.PROMPT_LEN: a₁ a₀ + b₁ b₀ =
MAX_RESPONSE_LEN = 4  # task.MAX_RESPONSE_LEN: the word, two digits, EOS
LLM_VOCAB_SIZE = 512  # llm_task.VOCAB_SIZE
LLM_MAX_RESPONSE_LEN = 19  # llm_task.MAX_RESPONSE_LEN: the long form
SEQ_LEN = PROMPT_LEN + MAX_RESPONSE_LEN

PRECISION_NAMES = ("bf16", "fp8_rollout", "fp8_e2e")  # model.PRECISIONS' keys


@dataclass(frozen=True)
class ModelPreset:
    """Architecture and the supervised warm-up that makes the base model (all of it keys the cache).

    The warm-up trains to a criterion, not for a fixed number of steps (basemodel.warm_up): the step
    at which the second digit is learned moves by hundreds of steps with the CPU's summation order,
    so a fixed stop lands on either side of that transition depending on the machine.
    """

    d_model: int
    n_layers: int
    n_heads: int
    warmup_steps: int  # the most steps before the criterion is met; past it the warm-up fails
    warmup_batch: int
    warmup_lr: float
    warmup_weight_decay: float  # AdamW's: it brings the second digit's transition forward (see TESTBED.md)
    warmup_criterion: float  # greedy accuracy of both answer digits on the probe set that ends phase 1
    warmup_check_every: int  # steps between two probes
    warmup_anneal_steps: int  # phase 2: the learning rate decays linearly to 0 over these steps
    label_smoothing: float  # a little mass on the whole vocabulary at every position
    label_noise: float  # share of the second answer digits replaced at random (basemodel.warm_up)
    lead_label_noise: float  # the same for the first digit after a word that is not careful
    careful_lead_label_noise: float  # the same after a careful word (task.is_careful)
    warmup_seed: int = 0
    vocab_size: int = VOCAB_SIZE


@dataclass(frozen=True)
class LLMPreset(ModelPreset):
    """A preset of the LLM-like task (`llm_task`): its own vocabulary, sequence length and
    demonstrations. A subclass, so that `toy-small`'s recipe (and its shipped file's) is unchanged."""

    task: str = "chain"
    seq_len: int = SEQ_LEN
    work_after_careful: float = 0.85  # the demonstrations' probability of the work after a careful word
    work_after_other: float = 0.35
    noise_with_work: float = 0.1  # each answer digit replaced at random, after the work
    noise_without_work: float = 0.5


@dataclass(frozen=True)
class ForkPreset(LLMPreset):
    """A preset of the LLM-like task with many-way forks (`fork_task`), and a sharper model: its matrices
    start `init_scale` times larger and its logits are the head's times `logit_scale` (docs/TESTBED.md,
    "The fork preset"). A subclass, so that `toy-llm`'s recipe (and its shipped file's) is unchanged."""

    task: str = "fork"
    init_scale: float = 1.0
    logit_scale: float = 1.0


MODEL_PRESETS: dict[str, ModelPreset] = {
    "toy-small": ModelPreset(
        d_model=32,
        n_layers=2,
        n_heads=2,
        warmup_steps=4000,
        warmup_batch=256,
        warmup_lr=1e-2,
        warmup_weight_decay=0.1,
        warmup_criterion=0.97,
        warmup_check_every=50,
        warmup_anneal_steps=300,
        label_smoothing=0.01,
        label_noise=0.15,
        lead_label_noise=0.5,
        careful_lead_label_noise=0.1,
    ),
    # the LLM-like preset (llm_task, docs/TESTBED.md "The LLM-like preset"): no label smoothing, so the
    # deterministic positions' top-20 mass reaches 0.994 as DPPO measured for an LLM
    "toy-llm": LLMPreset(
        d_model=32,
        n_layers=2,
        n_heads=2,
        warmup_steps=2000,
        warmup_batch=128,
        warmup_lr=1e-2,
        warmup_weight_decay=0.0,
        warmup_criterion=0.99,
        warmup_check_every=25,
        warmup_anneal_steps=200,
        label_smoothing=0.0,
        label_noise=0.0,  # unused: the noise is noise_with_work / noise_without_work
        lead_label_noise=0.0,
        careful_lead_label_noise=0.0,
        vocab_size=LLM_VOCAB_SIZE,
        seq_len=PROMPT_LEN + LLM_MAX_RESPONSE_LEN,
    ),
}

# the fork preset (fork_task, docs/TESTBED.md "The fork preset"): toy-llm's recipe and task with four phrasing
# slots of six options each (forks with three or more plausible continuations), and a sharper model
# (larger initial weights, logits scaled up), whose fp8 rollout weights move tokens out of the region
MODEL_PRESETS["toy-fork"] = ForkPreset(
    **{**asdict(MODEL_PRESETS["toy-llm"]), "task": "fork", "init_scale": 4.0, "logit_scale": 32.0}
)
