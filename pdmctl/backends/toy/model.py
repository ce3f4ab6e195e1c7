"""The policy: a small pre-LN causal transformer and the weight precisions (its presets: `presets`).

Precision is a property of weights only, as in the paper's setup: the rollout engine
keeps its own copy of the weights rounded to bfloat16 or quantized through
float8 e4m3 (one scale per tensor); `fp8_e2e` also runs the training forward
through the fp8 weights, with a straight-through gradient to the float32
master weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from pdmctl.backends.toy.presets import (  # noqa: F401  (re-exported: model.MODEL_PRESETS, model.VOCAB_SIZE, ...)
    MODEL_PRESETS,
    SEQ_LEN,
    VOCAB_SIZE,
    ForkPreset,
    LLMPreset,
    ModelPreset,
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
