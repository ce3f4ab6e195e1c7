"""The masks' row statistics in one fused Triton kernel: one pass over the logits, on a GPU.

`pdmctl.masks` needs four things per row of logits `z` and support `S` (MATH.md, "Numerics"): the row
maximum `max z`, `z` at the support's ids (the top-K gather), `Σ_{j∉S} e_j` (the tail mass, before
the normaliser) and, for the `exact` estimator, `Σ_{j∉S} e_j²`, with `e_j = exp(z_j − max z)`. The
torch path (`masks.rows._tail_sums`) makes them with a handful of kernels per block of rows; this kernel
makes them in one read of the logits: one program per row walks its columns in blocks with an online
maximum (the sums are rescaled when the maximum grows, as in a fused softmax), zeroes the support's
columns in the blocks that hold one (so the sums run over the unseen tokens alone and keep float32's
relative precision however small the tail is: no `1 − Σ_S π_i`), and carries the sums across blocks in
float64. The log-normaliser `max z + log(Σ_S e_i + Σ_{j∉S} e_j)` is then formed in float64 by
`masks.token_support`, as on the torch path.

`masks.rows` calls `row_stats` when the logits are on a CUDA device and Triton imports
(`PDMCTL_MASK_KERNEL=torch` turns it off, `=triton` forces it). On CPU it runs only under Triton's
interpreter (`TRITON_INTERPRET=1`), which is how CI tests it against the torch path.
"""

import functools
import os

import torch
import triton
import triton.language as tl


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


# tl.sum's and tl.max's own combine functions, passed to tl.reduce directly: the same reductions on a
# GPU, and under the interpreter numpy's sum and max without a device-function call per reduction
# (each of those re-patches the language: about 5 ms) and whatever Triton's import saw of
# TRITON_INTERPRET. A Triton without these names gets the plain ones above.
_ADD = getattr(tl.standard, "_sum_combine", _add)
_MAX = getattr(tl.standard, "_elementwise_max", _maximum)
SENTINEL: tl.constexpr = tl.constexpr(1 << 62)  # an id past every column (sorts last)
BLOCK_MAX = 2048  # columns one program reads per step (a power of two); tests lower it to cross blocks
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def row_stats_source(
    z_ptr, stride, V, ids_ptr, own_ptr, sorted_ptr, M, top_ptr, zs_ptr, sums_ptr,
    GIVEN_TOP: tl.constexpr, NEED_SQ: tl.constexpr, BLOCK: tl.constexpr, MPAD: tl.constexpr,
):  # fmt: skip
    """The kernel's body, one program per row (`_kernel` jits it on first use, so that
    TRITON_INTERPRET is read then, not at import). `sorted_ptr` holds the row's owned support ids in
    ascending order, the others replaced by a sentinel past every column: the ids that fall in a
    block are then the next run of that list."""
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride
    slot = tl.arange(0, MPAD)
    in_m = slot < M
    # the top-K gather: z at the support's ids (those this row owns), in the caller's slot order
    ids = tl.load(ids_ptr + row * M + slot, mask=in_m, other=0)
    own = tl.load(own_ptr + row * M + slot, mask=in_m, other=0) != 0
    z_s = tl.load(z_row + ids, mask=own, other=0.0).to(tl.float32)
    tl.store(zs_ptr + row * M + slot, z_s, mask=in_m)
    if GIVEN_TOP:  # noqa: SIM108 (a constexpr branch: the kernel compiles one side)
        top = tl.load(top_ptr + row).to(tl.float32)
    else:
        top = tl.full([], float("-inf"), tl.float32)
    s1 = tl.full([], 0.0, tl.float64)  # Σ_{j∉S} exp(z_j − top)
    s2 = tl.full([], 0.0, tl.float64)  # Σ_{j∉S} exp(z_j − top)²
    nxt = tl.full([], 0, tl.int32)  # the first sorted support id not yet passed
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(z_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        if GIVEN_TOP:
            shift = top
        else:  # online maximum: rescale what was summed against the old one
            new_top = tl.maximum(top, tl.reduce(z, 0, _MAX))
            shift = tl.where(new_top == float("-inf"), 0.0, new_top)
            scale = tl.exp(top - shift).to(tl.float64)
            s1 = s1 * scale
            s2 = s2 * scale * scale
            top = new_top
        e = tl.exp(z - shift)
        # zero the support's columns in this block: the sorted ids from `first` up to `nxt`
        first = nxt
        while tl.load(sorted_ptr + row * M + nxt, mask=nxt < M, other=SENTINEL) < start + BLOCK:
            nxt += 1
        if nxt > first:
            seen = cols < 0
            for i in range(first, nxt):
                seen = seen | (cols == tl.load(sorted_ptr + row * M + i))
            e = tl.where(seen, 0.0, e)
        s1 = s1 + tl.reduce(e, 0, _ADD).to(tl.float64)
        if NEED_SQ:
            s2 = s2 + tl.reduce(e * e, 0, _ADD).to(tl.float64)
    tl.store(top_ptr + row, top)
    tl.store(sums_ptr + row * 2, s1)
    tl.store(sums_ptr + row * 2 + 1, s2)


@functools.cache
def _kernel(interpret: bool):
    """The jitted kernel; one per interpreter setting (the argument keys the cache)."""
    return triton.jit(row_stats_source)


def launch_config(vocab: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for a vocabulary width."""
    block = min(BLOCK_MAX, triton.next_power_of_2(max(vocab, 16)))
    return block, (8 if block >= 2048 else 4)


def row_stats(
    logits: torch.Tensor,
    ids: torch.Tensor,
    owned: torch.Tensor,
    need_sq: bool,
    top: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """max z (float32 [N]; `top` when given: a vocabulary shard's group maximum), z at `ids` where
    `owned` (float64 [N, M], 0 elsewhere), Σ_{j∉S} e_j and Σ_{j∉S} e_j² (float64 [N]; the second 0
    unless `need_sq`), S being the owned ids. A row with NaN, +inf, or nothing but -inf gets NaN sums,
    as on the torch path, so that `masks` refuses it."""
    if logits.dtype not in _DTYPES:
        raise ValueError(f"logits: the fused kernel takes {', '.join(map(str, _DTYPES))}, got {logits.dtype}")
    if not logits.is_cuda and not interpreted():
        raise ValueError("logits: the fused kernel runs on a CUDA device, or on CPU under TRITON_INTERPRET=1")
    n, vocab = logits.shape
    m = ids.shape[1]
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    ids = ids.to(torch.int64).contiguous()
    own = owned.to(torch.int8).contiguous()
    sorted_ids = torch.where(owned, ids, SENTINEL.value).sort(-1).values.contiguous()
    given = top is not None
    top_out = (
        top.to(torch.float32).clone() if given else torch.empty(n, dtype=torch.float32, device=logits.device)
    )
    z_s = torch.empty(n, m, dtype=torch.float32, device=logits.device)
    sums = torch.empty(n, 2, dtype=torch.float64, device=logits.device)
    block, warps = launch_config(vocab)
    if n:
        _kernel(interpreted())[(n,)](
            logits, logits.stride(0), vocab, ids, own, sorted_ids, m, top_out, z_s, sums,
            GIVEN_TOP=given, NEED_SQ=need_sq, BLOCK=block, MPAD=triton.next_power_of_2(max(m, 2)),
            num_warps=warps,
        )  # fmt: skip
    z_support = torch.where(owned, z_s.double(), torch.zeros((), dtype=torch.float64, device=logits.device))
    bad = ~torch.isfinite(top_out) | (torch.isnan(z_s) & owned).any(-1)
    nan = torch.full((), torch.nan, dtype=torch.float64, device=logits.device)
    return top_out, z_support, torch.where(bad, nan, sums[:, 0]), torch.where(bad, nan, sums[:, 1])
