"""Cost of the masks relative to one log-softmax.

N = 4,096 tokens, V = 151,936 (Qwen3's vocabulary), K = 20, float32, this CPU.
Each figure is the median of REPEATS rounds in one process (cases interleaved), printed as a ratio to
one `torch.log_softmax` over the same logits. Targets: pdm agg/uni <= 1.10 x
dppo, pdm exact <= 1.5 x dppo; dppo, pdm-agg, pdm-uni <= 1.5 x log_softmax,
pdm-exact <= 2.0 x.

    python bench/masks.py [--n 4096] [--vocab 151936] [--k 20] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from rich.console import Console
from rich.table import Table

from pdmctl.masks import compute_mask


def median_seconds(cases: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Round-robin over the cases, so that load from other processes hits every case alike."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for rep in range(repeats + 1):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            if rep:  # the first round warms the allocator and the thread pool
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(args.n, args.vocab, generator=g) * 3
    with torch.no_grad():  # a rollout distribution near π; only its top-K leaves the engine
        log_mu = torch.log_softmax(logits[:, :4096] + 0.3 * torch.randn(args.n, 4096, generator=g), -1)
    top = log_mu.topk(args.k, dim=-1)
    sampled = torch.multinomial(log_mu.exp(), 1, generator=g).squeeze(-1)
    sampled_lp = log_mu.gather(-1, sampled[:, None]).squeeze(-1)
    adv = torch.randn(args.n, generator=g)
    inputs = (logits, sampled, top.indices, top.values, sampled_lp, adv)

    cases = {
        "log_softmax": lambda: torch.log_softmax(logits, -1),
        "grpo": lambda: compute_mask(*inputs, method="grpo"),
        "dppo (topk_kl)": lambda: compute_mask(*inputs, method="dppo", divergence="topk_kl"),
        "pdm agg": lambda: compute_mask(*inputs, method="pdm", estimator="agg"),
        "pdm uni": lambda: compute_mask(*inputs, method="pdm", estimator="uni"),
        "pdm exact": lambda: compute_mask(*inputs, method="pdm", estimator="exact"),
    }
    secs = median_seconds(cases, args.repeats)
    base, dppo = secs["log_softmax"], secs["dppo (topk_kl)"]
    targets = {
        "dppo (topk_kl)": (1.5, None),
        "pdm agg": (1.5, 1.10),
        "pdm uni": (1.5, 1.10),
        "pdm exact": (2.0, 1.5),
    }
    table = Table(title=f"masks: N={args.n} V={args.vocab} K={args.k} float32, median of {args.repeats}, "
                  f"{torch.get_num_threads()} threads")  # fmt: skip
    for col in ("case", "ms", "x log_softmax", "target", "x dppo", "target"):
        table.add_column(col, justify="right")
    ok = True
    for name, s in secs.items():
        t_ls, t_dppo = targets.get(name, (None, None))
        r_ls, r_dppo = s / base, s / dppo
        ok &= (t_ls is None or r_ls <= t_ls) and (t_dppo is None or r_dppo <= t_dppo)
        table.add_row(
            name, f"{s * 1e3:.1f}", f"{r_ls:.3f}", f"<= {t_ls}" if t_ls else "", f"{r_dppo:.3f}",
            f"<= {t_dppo}" if t_dppo else "",
        )  # fmt: skip
    Console().print(table)
    print("all targets met" if ok else "SOME TARGETS MISSED")


if __name__ == "__main__":
    main()
