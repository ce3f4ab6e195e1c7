"""The row statistics the masks need from the logits, in one pass over the vocabulary.

For each row: the maximum `max z`, `z` at the support's slots, `Σ_{j∉S} e_j` and (for the `exact`
estimator) `Σ_{j∉S} e_j²`, with `e_j = exp(z_j − max z)` (`docs/MATH.md`; `pdmctl.masks` turns them
into `π`, `π_tail`, `Q_tail` in float64). The support's columns are zeroed in each block before the
sums, so the sums run over the unseen tokens alone, to float32's relative precision however small the
tail is. Nothing of size [N, V] is allocated: bfloat16 logits are widened a block at a time.

On a CUDA device the pass is one fused Triton kernel (`pdmctl.masks.kernel`: the same four row
statistics in one read of the logits) where Triton imports; `PDMCTL_MASK_KERNEL` chooses: `torch` (the
default: this module's blocked pass everywhere), `auto` (the kernel for CUDA logits where Triton imports)
or `triton` (the kernel everywhere; on CPU only under `TRITON_INTERPRET=1`, as CI tests it). The kernel is
opt-in: the test suite runs it under Triton's interpreter only, and `scripts/device-check.sh` checks it on a GPU.

With a `VocabShard` (Megatron's vocabulary-parallel logits) the row maximum and the sums are
all-reduced over the shard's process group, and every rank gets the whole vocabulary's values.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import torch

_CHUNK_ELEMENTS = 1 << 22  # one block of scratch (16 MB of float32) for passes over the vocabulary
KERNEL_ENV = "PDMCTL_MASK_KERNEL"  # auto | torch | triton: who makes the row statistics (module docstring)
KERNEL_CHOICES = ("auto", "torch", "triton")


@dataclass(frozen=True)
class VocabShard:
    """The logits given are this process's columns `[start, start + V_local)` of a vocabulary of
    `vocab_size` split across `group` (a `torch.distributed` process group; None: the default one).
    Every process of the group must make the same calls with the same token inputs."""

    start: int
    vocab_size: int
    group: Any = None


def _work_dtype(logits: torch.Tensor) -> torch.dtype:
    """float32 for float32/bfloat16/float16 logits; float64 logits (tests) stay float64."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _tail_sums(
    logits: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, need_sq: bool, shard: VocabShard | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """max z, z at the support's slots, Σ_{j∉S} e_j and Σ_{j∉S} e_j² (e_j = exp(z_j − max z)) per row.

    The support's columns are zeroed in each block of `e` before the sums, so the sums run over the
    unseen tokens alone and keep float32's relative precision (about 1e-6) however small the tail is,
    where 1 − Σ_S π_i would keep none of it. One exp per logit serves both sums; blocks of
    `_CHUNK_ELEMENTS` bound the scratch while each torch call does enough work to amortise its cost.

    With a `shard`, the row maximum is the group's (one MAX all-reduce of [N] before the blocks), the
    support's logits come from the ranks that own them and the sums are the group's (one SUM
    all-reduce of [N, m + 2]); every rank returns the same values.
    """
    n, width = logits.shape
    named = valid.clone()
    named[:, -1] = True  # k's slot: a member of S or a copy of one, and where log π_k is read
    local = ids - (0 if shard is None else shard.start)
    owned = named & (local >= 0) & (local < width)
    local = torch.where(owned, local, 0)
    top = None
    if shard is not None:
        import torch.distributed as dist

        dtype = _work_dtype(logits)
        top = logits.amax(-1).to(dtype) if width else torch.full((n,), -torch.inf, dtype=dtype,
                                                                 device=logits.device)  # fmt: skip
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=shard.group)
    if n and width and fused_row_stats(logits):
        from pdmctl.masks import kernel

        top, z_support, tail, tail_sq = kernel.row_stats(logits, local, owned, need_sq, top=top)
        sums = torch.stack([tail, tail_sq], dim=-1)
    else:
        top, z_support, sums = _blocked_row_stats(logits, local, owned, need_sq, top)
    if shard is not None:
        gathered = torch.cat([sums, z_support], dim=-1)
        dist.all_reduce(gathered, op=dist.ReduceOp.SUM, group=shard.group)
        sums, z_support = gathered[:, :2], gathered[:, 2:]
    return top.double(), z_support, sums[:, 0], sums[:, 1]


def _blocked_row_stats(
    logits: torch.Tensor, local: torch.Tensor, owned: torch.Tensor, need_sq: bool, top: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch path of `_tail_sums` (the row maximum unless `top` is given, z at the owned `local`
    columns, the two sums as [N, 2]), in blocks of `_CHUNK_ELEMENTS`."""
    n, width = logits.shape
    dtype = _work_dtype(logits)
    # multiplying by 0 at the owned support columns (by 1 elsewhere) zeroes them whatever the duplicates
    unseen = (~owned).to(dtype)
    z_support = torch.zeros(local.shape, dtype=torch.float64, device=logits.device)
    if width:
        z_support = torch.where(owned, logits.gather(-1, local).double(), z_support)
    rows = max(1, min(n, _CHUNK_ELEMENTS // max(width, 1)))
    given = top is not None
    if top is None:
        top = torch.empty(n, dtype=dtype, device=logits.device)  # filled block by block, in cache
    sums = torch.zeros(n, 2, dtype=torch.float64, device=logits.device)  # Σ_{j∉S} e_j, Σ_{j∉S} e_j²
    scratch = torch.empty(rows, width, dtype=dtype, device=logits.device)
    for start in range(0, n if width else 0, rows):
        block = slice(start, start + rows)
        z = logits[block]
        if not given:
            top[block] = z.amax(-1).to(dtype)
        e = torch.sub(z, top[block, None], out=scratch[: z.shape[0]]).exp_()  # widens bfloat16 in the block
        e.scatter_reduce_(-1, local[block], unseen[block], reduce="prod")
        sums[block, 0] = e.sum(-1).double()
        if need_sq:
            sums[block, 1] = torch.linalg.vector_norm(e, dim=-1).double() ** 2
    return top, z_support, sums


def kernel_choice() -> str:
    """PDMCTL_MASK_KERNEL's value (torch when unset); ValueError in one line for any other."""
    choice = os.environ.get(KERNEL_ENV, "").strip() or "torch"  # the kernel opt-in until a GPU has checked it
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"{KERNEL_ENV}: unknown {choice!r}; choose from {', '.join(KERNEL_CHOICES)}")
    return choice


def fused_row_stats(logits: torch.Tensor) -> bool:
    """Whether the fused Triton kernel makes the row statistics of these logits (module docstring):
    float32/bfloat16/float16 logits on a CUDA device with Triton installed, unless PDMCTL_MASK_KERNEL
    says otherwise. float64 logits (tests, references) always take the torch path."""
    choice = kernel_choice()
    if choice == "torch" or logits.dtype == torch.float64:
        return False
    return choice == "triton" or (logits.is_cuda and importlib.util.find_spec("triton") is not None)
