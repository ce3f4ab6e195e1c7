"""The fused Triton kernel of the masks' row statistics (pdmctl.masks.kernel) against the torch path.

On CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1): every program of the grid,
one per row, executed in numpy, so the sizes here are small. What the interpreter cannot show, that
the kernel compiles for the GPU, `test_the_kernel_compiles_for_an_h200` shows by compiling it ahead
of time for sm_90 (Triton's own compiler and ptxas, no GPU needed).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from pdmctl import masks
from pdmctl.masks import DIVERGENCES, ESTIMATORS, METHODS, rows, token_diagnostics
from pdmctl.masks import kernel as mask_kernel
from tests.test_masks import confident_batch, make_batch


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _layout(n: int, vocab: int, m: int, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Support ids [n, m] and which of them count: duplicates, the first and last columns, ids in
    every block, padding slots that do not count (as `masks.rows._tail_sums` builds them)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(vocab, (n, m), generator=g)
    ids[0, :2] = torch.tensor([0, vocab - 1])
    ids[1, 1] = ids[1, 0]  # a duplicate (k among the top-K)
    owned = torch.rand(n, m, generator=g) > 0.2
    owned[:, -1] = True  # k's slot always counts
    return torch.where(owned, ids, 0), owned


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_row_stats_equal_the_torch_pass(monkeypatch, dtype):
    """Across several blocks (BLOCK_MAX lowered to 64: four blocks, the last one partial), with a
    confident row whose tail is 1e-9 of the total: the same row maximum and support logits, and
    tail sums within float32's relative precision, with and without a given row maximum (a shard)."""
    monkeypatch.setattr(mask_kernel, "BLOCK_MAX", 64)
    n, vocab, m = 6, 200, 7
    g = torch.Generator().manual_seed(1)
    z = torch.randn(n, vocab, generator=g) * 3
    z[2, 150] = 40.0  # a confident row: the unseen mass is about 1e-9 of the whole
    z[3, :] = torch.where(torch.arange(vocab) % 3 == 0, -math.inf, z[3])  # masked columns
    z = z.to(dtype)
    ids, owned = _layout(n, vocab, m, seed=2)
    ids[2, 0], owned[2, 0] = 150, True
    for top in (None, z.float().amax(-1) + 0.5):
        want_top, want_z, want = rows._blocked_row_stats(z, ids, owned, True, top)
        got_top, got_z, tail, tail_sq = mask_kernel.row_stats(z, ids, owned, True, top=top)
        assert torch.equal(got_top, want_top)
        assert torch.equal(got_z, want_z)
        torch.testing.assert_close(tail, want[:, 0], rtol=2e-6, atol=0)
        torch.testing.assert_close(tail_sq, want[:, 1], rtol=2e-6, atol=0)
    assert 0 < float(want[2, 0]) < 1e-8  # the confident row's tail kept its digits on both paths
    _, _, _, no_sq = mask_kernel.row_stats(z, ids, owned, False)
    assert torch.equal(no_sq, torch.zeros(n, dtype=torch.float64))


@pytest.fixture
def launches(monkeypatch):
    """Run the kernel once per distinct input: the 36 masks of one batch share four sets of row
    statistics (top-K or binary support, with or without Σπ²), and the interpreter takes a fifth of
    a second a launch. Each result is the kernel's own; the list counts the launches."""
    real, seen, count = mask_kernel.row_stats, {}, []

    def once(logits, ids, owned, need_sq, top=None):
        key = (logits.data_ptr(), logits.dtype, ids.numpy().tobytes(), owned.numpy().tobytes(), need_sq, top)
        if key not in seen:
            count.append(key)
            seen[key] = real(logits, ids, owned, need_sq, top=top)
        return tuple(t.clone() for t in seen[key])

    monkeypatch.setattr(mask_kernel, "row_stats", once)
    return count


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_mask_agrees_with_the_torch_path(monkeypatch, launches, dtype):
    """Every method, divergence and estimator, on confident rows (1 − π_k down to 1e-9) and ordinary
    ones, k inside and outside the top-K, -inf padding: the same decisions, D and Ḋ within float32's
    relative precision."""
    z, sampled, ids, lps, slp, adv = confident_batch(6, 300, 8, seed=5, drift=0.5)
    z2, sampled2, ids2, lps2, slp2, adv2 = make_batch(6, 300, 8, seed=6, dtype=torch.float32, k_outside=True)
    lps2 = lps2.float().clone()
    lps2[::2, -2:] = -math.inf  # entries the engine did not return
    inputs = (
        torch.cat([z, z2]).to(dtype), torch.cat([sampled, sampled2]), torch.cat([ids, ids2]),
        torch.cat([lps, lps2]), torch.cat([slp, slp2.float()]), torch.cat([adv, adv2.float()]),
    )  # fmt: skip
    masked = 0
    for method in METHODS:
        for divergence in DIVERGENCES:
            for estimator in ESTIMATORS:
                got = {}
                for kernel in ("torch", "triton"):
                    monkeypatch.setenv(masks.KERNEL_ENV, kernel)
                    got[kernel] = token_diagnostics(*inputs, method=method, divergence=divergence,
                                                    estimator=estimator, delta=0.02)  # fmt: skip
                case = (method, divergence, estimator)
                ref, fused = got["torch"], got["triton"]
                assert torch.equal(fused.keep, ref.keep), case
                assert torch.equal(fused.out_of_region, ref.out_of_region), case
                for name in ("divergence", "ddot", "ratio"):
                    torch.testing.assert_close(getattr(fused, name), getattr(ref, name), rtol=1e-5, atol=1e-9,
                                               msg=lambda m, c=case, n=name: f"{c} {n}: {m}")  # fmt: skip
                masked += int((~ref.keep).sum())
    assert masked > 0  # the decisions compared are not all "keep"
    assert len(launches) == 4  # {top-K, binary} x {Σπ² or not}: the kernel made every one


@pytest.mark.parametrize(
    ("where", "value"),
    [("unseen", math.nan), ("support", math.nan), ("unseen", math.inf), ("support", math.inf), ("row", -math.inf)],
)
def test_bad_logits_are_refused_as_on_the_torch_path(monkeypatch, where, value):
    z, sampled, ids, lps, slp, adv = make_batch(n=2, vocab=40, k=3, seed=0, dtype=torch.float32)
    z = z.clone()
    if where == "row":
        z[1] = value
    else:
        unseen = next(c for c in range(40) if c not in ids[1].tolist() and c != int(sampled[1]))
        column = int(ids[1, 0]) if where == "support" else unseen
        z[1, column] = value
    args = (z, sampled, ids, lps.float(), slp.float(), adv.float())
    for kernel in ("torch", "triton"):
        monkeypatch.setenv(masks.KERNEL_ENV, kernel)
        with pytest.raises(ValueError, match=r"^logits: contains NaN or \+inf"):
            token_diagnostics(*args)


def test_which_path_makes_the_row_statistics(monkeypatch):
    z = torch.zeros(2, 8)
    monkeypatch.delenv(masks.KERNEL_ENV, raising=False)
    assert masks.kernel_choice() == "torch"  # unset: the torch path (the kernel is opt-in until a GPU checked it)
    assert not masks.fused_row_stats(z)
    monkeypatch.setenv(masks.KERNEL_ENV, "auto")
    assert not masks.fused_row_stats(z)  # auto: CPU logits take the torch path
    monkeypatch.setenv(masks.KERNEL_ENV, "triton")
    assert masks.fused_row_stats(z) and not masks.fused_row_stats(z.double())  # float64: always torch
    monkeypatch.setenv(masks.KERNEL_ENV, "cuda")
    with pytest.raises(ValueError, match=r"^PDMCTL_MASK_KERNEL: unknown 'cuda'; choose from auto, torch, triton$"):
        masks.fused_row_stats(z)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match=r"^logits: the fused kernel runs on a CUDA device"):
        mask_kernel.row_stats(z, torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.bool), False)


def test_the_kernel_compiles_for_an_h200():
    """Triton's compiler down to a cubin for sm_90 (the H200), both constexpr branches of each flag."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    kernel = JITFunction(mask_kernel.row_stats_source)  # not triton.jit: that would be the interpreter here
    pointers = {"ids_ptr": "*i64", "own_ptr": "*i8", "sorted_ptr": "*i64", "top_ptr": "*fp32", "zs_ptr": "*fp32",
                "sums_ptr": "*fp64"}  # fmt: skip
    for dtype, given_top, need_sq in (("bf16", False, True), ("fp32", True, False)):
        signature = {"z_ptr": f"*{dtype}", "stride": "i64", "V": "i32", "M": "i32", **pointers}
        signature = {name: signature.get(name, "constexpr") for name in kernel.arg_names}
        constexprs = {"GIVEN_TOP": given_top, "NEED_SQ": need_sq, "BLOCK": 2048, "MPAD": 32}
        compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": 8})  # fmt: skip
        assert compiled.asm["cubin"][:4] == b"\x7fELF"
