"""The policy: a small pre-LN causal transformer, its presets, and the weight precisions.

Precision is a property of weights only, as in the paper's setup: the rollout engine
keeps its own copy of the weights rounded to bfloat16 or quantized through
float8 e4m3 (one scale per tensor); `fp8_e2e` also runs the training forward
through the fp8 weights, with a straight-through gradient to the float32
master weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from pdmctl.backends.toy.llm_task import MAX_RESPONSE_LEN as LLM_MAX_RESPONSE_LEN
from pdmctl.backends.toy.llm_task import VOCAB_SIZE as LLM_VOCAB_SIZE
from pdmctl.backends.toy.task import MAX_RESPONSE_LEN, PROMPT_LEN, VOCAB_SIZE

SEQ_LEN = PROMPT_LEN + MAX_RESPONSE_LEN


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


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.up = nn.Linear(d_model, 4 * d_model)
        self.down = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))

    def cached(
        self, x: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, tuple]:
        """`forward` for the new positions x [B, t, d] after the cached keys and values of the earlier ones
        (None: x is the whole prefix); the output and the cache extended by x's keys and values."""
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=past is None)  # one new query sees every key
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x)))), (k, v)


class TinyTransformer(nn.Module):
    def __init__(self, preset: ModelPreset) -> None:
        super().__init__()
        self.tok = nn.Embedding(preset.vocab_size, preset.d_model)
        self.pos = nn.Embedding(getattr(preset, "seq_len", SEQ_LEN), preset.d_model)
        self.blocks = nn.ModuleList(Block(preset.d_model, preset.n_heads) for _ in range(preset.n_layers))
        self.ln_f = nn.LayerNorm(preset.d_model)
        self.head = nn.Linear(preset.d_model, preset.vocab_size)
        # a fixed multiplier on the logits (ForkPreset; None elsewhere: the other presets compute as before)
        scale = getattr(preset, "logit_scale", 1.0)
        self.logit_scale = None if scale == 1.0 else scale

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.ln_f(x))
        return logits if self.logit_scale is None else logits * self.logit_scale

    def forward(self, tokens: torch.Tensor, last: int = 1) -> torch.Tensor:
        """Next-token logits at the `last` positions, float [B, last, V], for tokens long [B, T].

        Only the positions that predict response tokens need the vocabulary
        head, the widest matrix of a model this size.
        """
        x = self.tok(tokens) + self.pos.weight[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self._logits(x[:, -last:])

    def cached(self, tokens: torch.Tensor, start: int, past: list | None) -> tuple[torch.Tensor, list]:
        """The next-token logits [B, V] after `tokens` [B, t] at positions start.., given the cache of the
        positions before (None with start 0), and the extended cache: generation without recomputing the
        prefix (the LLM-like preset's responses are 19 tokens long)."""
        x = self.tok(tokens) + self.pos.weight[start : start + tokens.shape[1]]
        cache = []
        for i, block in enumerate(self.blocks):
            x, kv = block.cached(x, None if past is None else past[i])
            cache.append(kv)
        return self._logits(x[:, -1]), cache


def build_model(preset: ModelPreset, seed: int) -> TinyTransformer:
    """A freshly initialised model; the global RNG is left as it was."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = TinyTransformer(preset)
    init_scale = getattr(preset, "init_scale", 1.0)
    if init_scale != 1.0:  # ForkPreset: every matrix (the embeddings and the head included) starts larger
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.mul_(init_scale)
    return model


# ---------------------------------------------------------------------------
# Weight precision
# ---------------------------------------------------------------------------

WeightCast = Callable[[torch.Tensor], torch.Tensor]
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def to_bf16(w: torch.Tensor) -> torch.Tensor:
    return w.to(torch.bfloat16).to(w.dtype)


def to_fp8(w: torch.Tensor) -> torch.Tensor:
    """float8 e4m3 with one scale per tensor for matrices; vectors (norms, biases) stay in bfloat16."""
    if w.dim() < 2:
        return to_bf16(w)
    scale = w.abs().amax().clamp_min(1e-12) / FP8_MAX
    return (w / scale).to(torch.float8_e4m3fn).to(w.dtype) * scale


@dataclass(frozen=True)
class Precision:
    rollout: WeightCast  # the rollout engine's copy of the weights
    train: WeightCast | None  # the training forward's weights (None: the float32 masters)


PRECISIONS: dict[str, Precision] = {
    "bf16": Precision(rollout=to_bf16, train=None),
    "fp8_rollout": Precision(rollout=to_fp8, train=None),
    "fp8_e2e": Precision(rollout=to_fp8, train=to_fp8),
}


def forward(model: TinyTransformer, tokens: torch.Tensor, last: int, cast: WeightCast | None) -> torch.Tensor:
    """The training forward; with `cast`, through the cast weights, straight-through to the masters."""
    if cast is None:
        return model(tokens, last)
    params = {name: p + (cast(p.detach()) - p).detach() for name, p in model.named_parameters()}
    return functional_call(model, params, (tokens, last))
