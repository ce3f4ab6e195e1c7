"""The primary statistic and the primary test of `analyze` runs, from their JSON or from their seed tables.

For each RUN (an `analyze --json` file, plain or .json.gz, or an `analyze --csv` seed table, whose
counterfactual `exact` rows hold each seed's kept disagreement tokens and unsafe-keep rates): the predictive −
ratio unsafe-keep rate pooled over tokens, its seed-cluster bootstrap interval, its sign-flip p and Kish's
effective seeds (pdmctl.analysis.inference, the numbers `pdmctl analyze` prints); with several runs, the
primary test: their p's Holm-adjusted over the runs. `--drop N` also prints each run without its N heaviest
seeds (ranked by their kept tokens, both criteria together: the weight a seed has in the pooled statistic).

    python bench/primary_test.py RUN [RUN ...] [--drop 4]

numpy's generator with the analysis's fixed seed: the same figures on any machine.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import json
from pathlib import Path

import numpy as np

from pdmctl.analysis import inference
from pdmctl.analysis.results import AnalysisResult
from pdmctl.report.stats import format_p, holm


def counts(path: str) -> tuple[list[int], np.ndarray]:
    """The run's seeds and its per-seed (unsafe predictive, kept predictive, unsafe ratio, kept ratio)."""
    raw = Path(path).read_bytes()
    text = (gzip.decompress(raw) if path.endswith(".gz") else raw).decode()
    if ".csv" in path:
        rows = [r for r in csv.DictReader(io.StringIO(text))
                if (r["protocol"], r["estimator"]) == (inference.PRIMARY_PROTOCOL, inference.PRIMARY_ESTIMATOR)]  # fmt: skip

        def column(kept: str, rate: str) -> tuple[list[int], list[int]]:
            n = [int(r[kept] or 0) for r in rows]
            return [round(float(r[rate]) * k) if r[rate] else 0 for r, k in zip(rows, n, strict=True)], n

        (up_p, n_p), (up_r, n_r) = column("predictive_kept", "predictive_unsafe_keep"), column("ratio_kept", "ratio_unsafe_keep")
        return [int(r["seed"]) for r in rows], np.array([up_p, n_p, up_r, n_r], dtype=float)
    result = AnalysisResult.from_dict(json.loads(text))
    pred = inference._counts(result, inference.PRIMARY_ESTIMATOR, "predictive", "disagreement", "kept")
    ratio = inference._counts(result, inference.PRIMARY_ESTIMATOR, "ratio", "disagreement", "kept")
    if pred is None or ratio is None:
        raise SystemExit(f"{path}: no counterfactual counts (the primary metric was not measured)")
    return result.seeds, np.array([pred.own_up, pred.n, ratio.own_up, ratio.n], dtype=float)


def line(c: np.ndarray) -> tuple[str, float]:
    low, high = inference.cluster_bootstrap(*c)
    p = inference.sign_flip_p(*c)
    return (f"{100 * inference.pooled_difference(*c):+.1f} points [{100 * low:+.1f}, {100 * high:+.1f}], sign-flip p "
            f"{format_p(p)}, {inference.effective_seeds(c[1] + c[3]):.1f} effective of {c.shape[1]} seeds, "
            f"{int(c[1].sum()):,} / {int(c[3].sum()):,} kept (predictive / ratio)", p)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="analyze --json files (.json or .json.gz) or --csv seed tables")
    parser.add_argument("--drop", type=int, default=0, help="also without each run's 1..N heaviest seeds")
    args = parser.parse_args()
    ps = []
    for path in args.runs:
        seeds, c = counts(path)
        text, p = line(c)
        ps.append(p)
        print(f"{path}: {text}")
        weight = c[1] + c[3]
        order = np.argsort(-weight, kind="stable")
        for k in range(1, args.drop + 1):
            left = np.sort(order[k:])
            dropped = ", ".join(f"{seeds[i]} ({int(weight[i])})" for i in order[:k])
            print(f"  without {k} ({dropped}: {weight[order[:k]].sum() / weight.sum():.1%} of the tokens): "
                  f"{line(c[:, left])[0]}")  # fmt: skip
    if len(ps) > 1:
        print("primary test, the p's Holm-adjusted over these runs:")
        for path, p in zip(args.runs, holm(ps), strict=True):
            print(f"  {path}: {format_p(p)}")


if __name__ == "__main__":
    main()
