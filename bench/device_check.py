"""The device check: the masks on a GPU against their CPU path, what they cost there at the
paper's scale, and the toy testbed trained on the GPU. `scripts/device-check.sh` runs it.

    python bench/device_check.py OUT_DIR          a CUDA machine: V = 151,936, K = 20 (about 5 minutes)
    python bench/device_check.py OUT_DIR --cpu    the CPU half: the same code at small sizes (CI)

It needs torch and numpy, and Triton for the fused kernel (`pdmctl.masks.kernel`), with pdmctl taken
from the working tree (PYTHONPATH); it checks that nothing else was imported. It writes
OUT_DIR/device-check.json and OUT_DIR/device-check.txt, section by section, and exits 0 when every
check passed, 1 when one failed, 2 on bad input (nothing written).

1. correctness: every method x divergence x estimator (GRPO clip-higher, DPPO, PDM agg/uni/exact;
   top-K and binary, KL and TV) on the same inputs on the device and on CPU (`PDMCTL_MASK_KERNEL=torch`),
   bfloat16 and float32 logits, ordinary rows and confident ones (1 − π_k from 1e-9 to 1e-5). On CUDA
   the device runs both the fused kernel and the torch path; with --cpu the "device" is Triton's
   interpreter on CPU (a subset of the cases: it runs every program in numpy). A decision that differs
   is listed with its margin: the deciding quantities (D − δ, r − 1, Ḋ, or r against the clip bound)
   on both sides and how far the paths' values differ. The check passes when D and r agree to 1e-5
   on every token and every differing decision is a tie: a deciding quantity within ten times the
   paths' difference of its threshold, that difference no larger than rounding's (TIE).
2. cost: time (median of the repeats, cases interleaved) and peak memory beyond the inputs of each
   mask per micro-batch, as ratios to one `log_softmax` of the same logits (and to one with a float32
   output, what the loss's gradient takes) and to DPPO of the same divergence; the fused kernel's row
   statistics alone beside them. Sizes that do not fit the device's memory are listed as such.
3. toy: the testbed trains a few steps on the device (`train(..., device=...)`): finite metrics, the
   weights on the device.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

VOCAB, K = 151_936, 20
GOALS = {"pdm_vs_dppo": 1.10, "pdm_vs_log_softmax": 1.5, "fused_vs_log_softmax": 1.0}  # the goals: cost ratios at most these
# the paper's micro-batches (DPPO appendix: response length 8,192 dense, 16,384 MoE)
GPU_SIZES = (("8x8192", 8 * 8192), ("32x16384", 32 * 16384))
CPU_SIZES = (("1x256", 256),)
DELTA = 0.05
# How far the two paths' values of a deciding quantity may lie apart for a decision they take
# differently to count as a tie decided by rounding (float32 sums carry about 1e-6 relative).
TIE = {"D - delta": 1e-5, "r - 1": 1e-5, "r - clip bound": 1e-5, "Ddot": 1e-6}
AGREE = 1e-5  # |ΔD| / max(1, |D|) and |Δr| / r allowed between the paths on every token


@dataclasses.dataclass(frozen=True)
class Plan:
    device: str
    vocab: int
    plain_rows: int  # correctness rows of each kind
    confident_rows: int
    cases: tuple[tuple[str, str, str], ...]  # (method, divergence, estimator) checked
    sizes: tuple[tuple[str, int], ...]  # timing: (label, tokens)
    repeats: int
    toy: dict  # ToyConfig fields


def plan_for(cpu: bool) -> Plan:
    from pdmctl.masks import DIVERGENCES, ESTIMATORS, METHODS

    every = tuple((m, d, e) for m in METHODS for d in DIVERGENCES for e in ESTIMATORS)
    if not cpu:
        return Plan("cuda", VOCAB, 512, 512, every, GPU_SIZES, 5,
                    dict(steps=3, prompts_per_step=64, group_size=8, minibatches=4, eval_every=3,
                         eval_samples=4, checkpoint_every=3))  # fmt: skip
    # under the interpreter: each method with each support and estimator at least once
    pairs = (("topk_kl", "exact"), ("topk_tv", "agg"), ("binary_kl", "uni"), ("binary_tv", "exact"))
    subset = tuple((m, d, e) for m in METHODS for d, e in pairs)
    return Plan("cpu", 2048, 4, 4, subset, CPU_SIZES, 1,
                dict(steps=2, prompts_per_step=8, group_size=4, minibatches=2, eval_every=2, eval_samples=1,
                     checkpoint_every=2))  # fmt: skip


# ---------------------------------------------------------------------------
# environment and imports
# ---------------------------------------------------------------------------


def environment(torch) -> dict:
    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": version("triton"),
        "numpy": version("numpy"),
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "device_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
        "cpu_threads": torch.get_num_threads(),
    }


def _requirement_closure(roots: tuple[str, ...]) -> set[str]:
    """The distributions `roots` need, transitively (requirements behind an extra left out)."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [re.match(r"[A-Za-z0-9._-]+", r).group(0) for r in requires if "extra ==" not in r]
    return seen


class ImportWatch:
    """A meta-path finder that finds nothing and records, for each top-level module outside the
    standard library, the module whose code imported it first (torch imports dill and tqdm when they
    are installed; what counts is what pdmctl and this check import themselves)."""

    def __init__(self) -> None:
        self.importer: dict[str, str] = {}

    def find_spec(self, name, path=None, target=None):
        if "." not in name and name not in sys.stdlib_module_names and name not in self.importer:
            frame = sys._getframe(1)
            while frame and frame.f_globals.get("__name__", "").startswith(("importlib", "_frozen_importlib")):
                frame = frame.f_back
            self.importer[name] = frame.f_globals.get("__name__", "?") if frame else "?"
        return None


def imports_check(watch: ImportWatch) -> dict:
    """The top-level modules pdmctl and this check imported themselves beyond the standard library, and
    those that belong to none of torch, Triton, numpy and their requirements (typer, mlflow, hydra,
    rich, ...); every module loaded, for the record."""
    allowed = _requirement_closure(("torch", "triton", "numpy")) | {"pdmctl"}
    owners = importlib.metadata.packages_distributions()
    ours = sorted(n for n, by in watch.importer.items() if by.split(".")[0] in ("pdmctl", "__main__", "device_check"))
    outside = [n for n in ours if not {re.sub(r"[-_.]+", "-", d).lower() for d in owners.get(n, [n])} <= allowed]
    loaded = sorted({name.split(".")[0] for name in sys.modules} - set(sys.stdlib_module_names))
    return {"imported_by_pdmctl_or_the_check": ours, "outside_torch_triton_numpy": outside, "loaded": loaded,
            "ok": not outside}  # fmt: skip


# ---------------------------------------------------------------------------
# 1. correctness
# ---------------------------------------------------------------------------


def check_inputs(torch, plan: Plan, seed: int = 0) -> dict:
    """float32 logits [N, V] and a rollout's top-K on CPU: `plain_rows` ordinary rows (a quarter with
    k outside the top-K, an eighth with -inf padding) and `confident_rows` whose top token has
    1 − π between 1e-9 and 1e-5 at a random column, its μ a drifted copy (made on the device)."""
    dev = torch.device(plan.device)
    g = torch.Generator(device=dev).manual_seed(seed)
    n, v = plan.plain_rows + plan.confident_rows, plan.vocab
    z = torch.randn(n, v, generator=g, device=dev) * 2.0
    rows = torch.arange(plan.plain_rows, n, device=dev)
    hot = torch.randint(v, (plan.confident_rows,), generator=g, device=dev)
    gap = 10 ** -torch.empty(plan.confident_rows, device=dev, dtype=torch.float64).uniform_(5.0, 9.0, generator=g)
    z[rows] = torch.randn(plan.confident_rows, v, generator=g, device=dev)
    others = z[rows].double().index_put((torch.arange(len(rows), device=dev), hot), torch.tensor(-math.inf,
                                        dtype=torch.float64, device=dev))  # fmt: skip
    z[rows, hot] = (torch.logsumexp(others, -1) + torch.log((1 - gap) / gap)).float()
    z_mu = z + 0.5 * torch.randn(n, v, generator=g, device=dev)
    z_mu[rows, hot] -= torch.empty(len(rows), device=dev).uniform_(-2.0, 12.0, generator=g)
    log_mu = torch.log_softmax(z_mu, -1)
    del z_mu
    top = log_mu.topk(K, -1)
    sampled = torch.multinomial(log_mu.exp(), 1, generator=g).squeeze(-1)
    sampled[rows] = hot
    outside = torch.arange(0, plan.plain_rows, 4, device=dev)  # k outside the top-K: the least likely token
    sampled[outside] = log_mu[outside].argmin(-1)
    slp = log_mu.gather(-1, sampled[:, None]).squeeze(-1)
    topk_lp = top.values.clone()
    topk_lp[torch.arange(1, plan.plain_rows, 8, device=dev), -2:] = -math.inf  # entries not returned
    adv = torch.randn(n, generator=g, device=dev)
    adv[torch.arange(3, n, 20, device=dev)] = 0.0  # A = 0: no rule masks
    kind = ["plain"] * plan.plain_rows + ["confident"] * plan.confident_rows
    return {"z": z.cpu(), "sampled": sampled.cpu(), "ids": top.indices.cpu(), "lps": topk_lp.cpu(),
            "slp": slp.cpu(), "adv": adv.cpu(), "kind": kind}  # fmt: skip


def _deciding(method: str, d, delta: float, eps_low: float, eps_high: float) -> dict:
    """Per token, the quantities whose signs decide the method's mask (MATH.md) as float64 numbers."""
    adv = d["adv"]
    out = {"D - delta": d["divergence"] - delta}
    if method == "grpo":
        bound = 1 + eps_high if adv > 0 else 1 - eps_low
        return {"r - clip bound": d["ratio"] - bound}
    if method == "dppo":
        return {**out, "r - 1": d["ratio"] - 1}
    return {**out, "Ddot": d["ddot"]}


def compare(torch, method: str, ref, got, inputs: dict) -> dict:
    """The two paths' decisions; each difference with the deciding quantities on both sides."""
    differ = (ref.keep != got.keep).nonzero().flatten().tolist()
    listed, unexplained = [], 0
    for i in differ:
        values = {}
        for name, d in (("cpu", ref), ("device", got)):
            values[name] = {"divergence": float(d.divergence[i]), "ddot": float(d.ddot[i]),
                            "ratio": float(d.ratio[i]), "adv": float(inputs["adv"][i])}  # fmt: skip
        deciding_cpu = _deciding(method, values["cpu"], DELTA, 0.2, 0.28)
        deciding_dev = _deciding(method, values["device"], DELTA, 0.2, 0.28)
        margins = {
            q: {"cpu": deciding_cpu[q], "device": deciding_dev[q], "paths_differ_by": abs(deciding_cpu[q] - deciding_dev[q])}
            for q in deciding_cpu
        }
        # explained: some deciding quantity lies within ten times the paths' difference of its threshold,
        # and that difference is rounding's (TIE): a tie that float32 sums decide either way
        explained = any(
            abs(m["cpu"]) <= 10 * m["paths_differ_by"] <= 10 * TIE[q] for q, m in margins.items()
        )
        unexplained += not explained
        listed.append({"token": i, "row_kind": inputs["kind"][i], "cpu_keeps": bool(ref.keep[i]),
                       "margins": margins, "explained_by_rounding": explained})  # fmt: skip

    def worst(a, b, floor: float) -> float:
        diff = (a.double() - b.double()).abs() / a.double().abs().clamp_min(floor)
        return float(diff.max()) if diff.numel() else 0.0

    scaled_d, rel_r = worst(ref.divergence, got.divergence, 1.0), worst(ref.ratio, got.ratio, 1e-30)
    return {
        "tokens": len(ref.keep),
        "masked_cpu": int((~ref.keep).sum()),
        "decisions_differ": len(differ),
        "differences": listed,
        "unexplained": unexplained,
        "max_diff_D": scaled_d,  # |ΔD| / max(1, |D|)
        "max_rel_diff_ratio": rel_r,
        "max_rel_diff_Ddot": worst(ref.ddot, got.ddot, 1e-30),  # large where Ḋ is near 0: reported, not gated
        "values_agree": scaled_d <= AGREE and rel_r <= AGREE,
    }


def correctness(torch, plan: Plan, report) -> dict:
    from pdmctl import masks

    inputs = check_inputs(torch, plan)
    dev = torch.device(plan.device)
    # the device's paths: on CUDA the fused kernel (auto) and the torch path; with --cpu, the kernel
    # under Triton's interpreter
    paths = {"fused": "triton"} if plan.device == "cpu" else {"fused": "auto", "torch": "torch"}
    with kernel("auto"):
        auto = "fused kernel" if masks.fused_row_stats(torch.zeros(1, 8, device=dev)) else "torch"
    result: dict = {"vocab": plan.vocab, "k": K, "delta": DELTA, "plain_rows": plan.plain_rows,
                    "confident_rows": plan.confident_rows, "device_default_path": auto, "paths": {}}  # fmt: skip
    for dtype_name in ("bfloat16", "float32"):
        dtype = getattr(torch, dtype_name)
        cpu_args = (inputs["z"].to(dtype), inputs["sampled"], inputs["ids"], inputs["lps"], inputs["slp"], inputs["adv"])
        dev_args = tuple(t.to(dev) for t in cpu_args)
        for method, divergence, estimator in plan.cases:
            kwargs = dict(method=method, divergence=divergence, estimator=estimator, delta=DELTA)
            with kernel("torch"):
                ref = masks.token_diagnostics(*cpu_args, **kwargs)
            for path, choice in paths.items():
                try:
                    with kernel(choice):
                        got = masks.token_diagnostics(*dev_args, **kwargs)
                    got = masks.Diagnostics(**{f.name: getattr(got, f.name).cpu() for f in dataclasses.fields(got)})
                    entry = compare(torch, method, ref, got, inputs)
                except Exception as exc:  # recorded; the other cases and paths still run
                    entry = {"error": one_line(exc)}
                result["paths"].setdefault(path, {}).setdefault(dtype_name, {})[f"{method}/{divergence}/{estimator}"] = entry
        report.progress(f"correctness {dtype_name}: {len(plan.cases)} cases x {len(paths)} device path(s)")
    every = [e for p in result["paths"].values() for d in p.values() for e in d.values()]
    flat = [e for e in every if "error" not in e]
    result["errors"] = len(every) - len(flat)
    result["cases_checked"] = len(flat)
    result["decisions_differ"] = sum(e["decisions_differ"] for e in flat)
    result["unexplained"] = sum(e["unexplained"] for e in flat)
    result["masked_cpu"] = sum(e["masked_cpu"] for e in flat)
    result["values_disagree"] = sum(not e["values_agree"] for e in flat)
    result["ok"] = (result["errors"] == 0 and result["unexplained"] == 0 and result["values_disagree"] == 0
                    and result["masked_cpu"] > 0)  # fmt: skip
    return result


class kernel:
    """PDMCTL_MASK_KERNEL set for a block."""

    def __init__(self, choice: str) -> None:
        self.choice = choice

    def __enter__(self) -> None:
        self.old = os.environ.get("PDMCTL_MASK_KERNEL")
        os.environ["PDMCTL_MASK_KERNEL"] = self.choice

    def __exit__(self, *exc) -> None:
        if self.old is None:
            os.environ.pop("PDMCTL_MASK_KERNEL", None)
        else:
            os.environ["PDMCTL_MASK_KERNEL"] = self.old


# ---------------------------------------------------------------------------
# 2. cost
# ---------------------------------------------------------------------------


def timing_inputs(torch, n: int, vocab: int, dtype, dev) -> tuple:
    """Logits [n, V] and a rollout's top-K for timing (their values matter little; their layout does)."""
    g = torch.Generator(device=dev).manual_seed(1)
    z = (torch.randn(n, vocab, generator=g, device=dev, dtype=dtype) * 3).to(dtype)
    ids = torch.randint(vocab, (n, K), generator=g, device=dev)
    lps = torch.log_softmax(torch.randn(n, K + 1, generator=g, device=dev) * 2, -1)[:, :K].sort(-1, descending=True).values
    sampled = torch.where(torch.rand(n, generator=g, device=dev) < 0.8, ids[:, 0], torch.randint(vocab, (n,), generator=g, device=dev))
    slp = torch.where(sampled == ids[:, 0], lps[:, 0], torch.full_like(lps[:, 0], -9.0))
    adv = torch.randn(n, generator=g, device=dev)
    return z, sampled, ids, lps, slp, adv


def timing_cases(torch, inputs: tuple, with_kernel: bool) -> dict:
    """What is timed: two log-softmaxes, every mask (the device's default path), and with the kernel
    its row statistics alone and two masks through the torch path for comparison."""
    from pdmctl import masks

    z = inputs[0]

    def mask(method, divergence="topk_kl", estimator="agg", choice="auto"):
        def run():
            with kernel(choice):
                return masks.compute_mask(*inputs, method=method, divergence=divergence, estimator=estimator,
                                          delta=DELTA)  # fmt: skip

        return run

    cases = {
        "log_softmax": lambda: torch.log_softmax(z, -1),
        "log_softmax->fp32": lambda: torch.log_softmax(z, -1, dtype=torch.float32),
        "grpo": mask("grpo"),
    }
    for family in ("kl", "tv"):
        cases[f"dppo topk_{family}"] = mask("dppo", f"topk_{family}")
        for est in ("agg", "uni", "exact"):
            cases[f"pdm {est} topk_{family}"] = mask("pdm", f"topk_{family}", est)
    if with_kernel:
        from pdmctl.masks import kernel as mask_kernel

        ids = torch.cat([inputs[2], inputs[1][:, None]], -1)  # S = TopK ∪ {k}, as masks lays it out
        owned = torch.ones_like(ids, dtype=torch.bool)
        cases["fused row stats (exact)"] = lambda: mask_kernel.row_stats(z, ids, owned, True)
        cases["dppo topk_kl [torch path]"] = mask("dppo", "topk_kl", choice="torch")
        cases["pdm exact topk_kl [torch path]"] = mask("pdm", "topk_kl", "exact", choice="torch")
    return cases


def measure(torch, cases: dict, repeats: int, cuda: bool) -> dict:
    """Median seconds (cases interleaved, one warm-up round) and peak memory beyond what was allocated
    before each call (CUDA only)."""

    def sync():
        if cuda:
            torch.cuda.synchronize()

    times: dict[str, list[float]] = {name: [] for name in cases}
    peak: dict[str, int] = {}
    failed: dict[str, str] = {}
    for rep in range(repeats + 1):
        for name, fn in cases.items():
            if name in failed:
                continue
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            try:
                out = fn()
                sync()
            except Exception as exc:  # one case's failure (the kernel's compiler, memory) is its result
                failed[name] = one_line(exc)
                continue
            elapsed = time.perf_counter() - t0
            if cuda:
                peak[name] = max(peak.get(name, 0), torch.cuda.max_memory_allocated() - before)
            del out
            if rep:
                times[name].append(elapsed)
    return {name: {"error": failed[name]} if name in failed else
            {"ms": 1e3 * statistics.median(ts), "peak_extra_bytes": peak.get(name)} for name, ts in times.items()}  # fmt: skip


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def cost(torch, plan: Plan, report, deadline: float) -> dict:
    cuda = plan.device == "cuda"
    dev = torch.device(plan.device)
    out: dict = {"vocab": plan.vocab, "k": K, "repeats": plan.repeats, "goals": GOALS, "sizes": []}
    for label, n in plan.sizes:
        for dtype_name in ("bfloat16", "float32"):
            dtype = getattr(torch, dtype_name)
            entry: dict = {"size": label, "tokens": n, "dtype": dtype_name}
            # the logits, one float32 log-softmax of them, and room for the masks' own working set
            need = n * plan.vocab * (torch.finfo(dtype).bits // 8 + 4) + (4 << 30)
            free = torch.cuda.mem_get_info()[0] if cuda else None
            if cuda and need > free:
                entry["skipped"] = (f"does not fit: the logits and one float32 log_softmax of them need "
                                    f"{need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free")  # fmt: skip
            elif time.monotonic() > deadline:
                entry["skipped"] = "out of time (the check's budget)"
            else:
                inputs = timing_inputs(torch, n, plan.vocab, dtype, dev)
                results = measure(torch, timing_cases(torch, inputs, cuda), plan.repeats, cuda)
                results = ratios(results, goals=cuda)
                del inputs
                if cuda:
                    torch.cuda.empty_cache()
                entry["cases"] = results
            out["sizes"].append(entry)
            report.progress(f"cost {label} {dtype_name}: {entry.get('skipped', 'measured')}")
    out["errors"] = sum("error" in c for e in out["sizes"] for c in e.get("cases", {}).values())
    out["ok"] = out["errors"] == 0
    return out


def ratios(results: dict, goals: bool) -> dict:
    """Each case's time and peak memory as ratios; against the goals where `goals` (a GPU)."""
    base, base32 = results["log_softmax"], results["log_softmax->fp32"]
    for name, r in results.items():
        if "error" in r:
            continue
        family = "tv" if "topk_tv" in name else "kl"
        dppo = results[f"dppo topk_{family}"]
        r["x_log_softmax"] = r["ms"] / base.get("ms", math.nan)
        r["x_log_softmax_fp32"] = r["ms"] / base32.get("ms", math.nan)
        r["x_dppo"] = r["ms"] / dppo.get("ms", math.nan)
        if r["peak_extra_bytes"] is not None and base.get("peak_extra_bytes"):
            r["peak_x_log_softmax"] = r["peak_extra_bytes"] / base["peak_extra_bytes"]
        if goals and name.startswith("pdm") and "[torch path]" not in name:
            r["goal_met"] = r["x_dppo"] <= GOALS["pdm_vs_dppo"] and r["x_log_softmax"] <= GOALS["pdm_vs_log_softmax"]
        if goals and name.startswith("fused"):
            r["goal_met"] = r["x_log_softmax"] <= GOALS["fused_vs_log_softmax"]
    return results


# ---------------------------------------------------------------------------
# 3. the toy testbed on the device
# ---------------------------------------------------------------------------


def toy(torch, plan: Plan) -> dict:
    """The toy testbed on the device, through the device's default path; if that raises, the error
    and a second run through the torch path (so one device run still learns whether it trains)."""
    try:
        return train_toy(torch, plan)
    except Exception as exc:
        first = one_line(exc)
    with kernel("torch"):
        result = train_toy(torch, plan)
    return {**result, "ok": False, "error_on_default_path": first, "retried_with": "torch path"}


def train_toy(torch, plan: Plan) -> dict:
    from pdmctl import masks
    from pdmctl.backends.base import InMemoryTracker
    from pdmctl.backends.toy import ToyConfig, train

    cfg = ToyConfig(**plan.toy)
    tracker = InMemoryTracker()
    with tempfile.TemporaryDirectory(prefix="pdmctl-device-check-") as work:
        t0 = time.perf_counter()
        final = train(cfg, Path(work), tracker, device=plan.device)
        seconds = time.perf_counter() - t0
        (last,) = sorted((Path(work) / "checkpoints").glob("step_*.pt"))[-1:]
        state = torch.load(last, weights_only=True, map_location="cpu" if plan.device == "cpu" else None)
    weights_on = sorted({str(t.device.type) for t in state["policy"].values()})
    finite = all(math.isfinite(v) for v in final.values())
    logits = torch.zeros(1, 8, device=plan.device)
    return {
        "config": plan.toy,
        "seconds": seconds,
        "steps": cfg.steps,
        "final": final,
        "rewards": [v for _, v in tracker.history("train/reward")],
        "weights_on": weights_on,
        "row_stats_path": "fused kernel" if masks.fused_row_stats(logits) else "torch",
        "ok": finite and weights_on == [torch.device(plan.device).type] and len(tracker.history("train/reward")) == cfg.steps,
    }


# ---------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------


class Report:
    def __init__(self, out: Path, t0: float) -> None:
        self.out, self.t0, self.data = out, t0, {}

    def progress(self, line: str) -> None:
        print(f"[device-check {time.monotonic() - self.t0:5.0f}s] {line}", flush=True)

    def section(self, name: str, value) -> None:
        self.data[name] = value
        self.data["seconds"] = round(time.monotonic() - self.t0, 1)
        (self.out / "device-check.json").write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        (self.out / "device-check.txt").write_text(text(self.data))


def text(data: dict) -> str:
    lines = [f"device check ({data.get('mode')}), {data.get('seconds')} s"]
    env = data.get("environment", {})
    lines.append("  " + ", ".join(f"{k} {v}" for k, v in env.items()))
    failed = {name for name in ("imports", "correctness", "cost", "toy") if "error" in data.get(name, {})}
    for name in sorted(failed):
        lines.append(f"{name}: FAILED: {data[name]['error']}\n{data[name]['traceback']}")
    data = {k: v for k, v in data.items() if k not in failed}
    imp = data.get("imports")
    if imp:
        lines.append(f"imports: {'ok' if imp['ok'] else 'FAIL'}: pdmctl and the check import "
                     f"{', '.join(imp['imported_by_pdmctl_or_the_check'])}; loaded in all: {', '.join(imp['loaded'])}"
                     + (f"; outside torch/Triton/numpy: {', '.join(imp['outside_torch_triton_numpy'])}"
                        if imp["outside_torch_triton_numpy"] else ""))  # fmt: skip
    cor = data.get("correctness")
    if cor:
        lines.append(f"\ncorrectness: {'ok' if cor['ok'] else 'FAIL'}: V={cor['vocab']} K={cor['k']} delta={cor['delta']}, "
                     f"{cor['plain_rows']} ordinary + {cor['confident_rows']} confident rows, {cor['cases_checked']} "
                     f"comparisons ({cor['errors']} raised), {cor['masked_cpu']} masked tokens on CPU, {cor['decisions_differ']} decisions "
                     f"differ, {cor['unexplained']} not explained by rounding, {cor['values_disagree']} cases with "
                     f"D or r apart by more than {AGREE:g}")  # fmt: skip
        for path, by_dtype in cor["paths"].items():
            for dtype, all_cases in by_dtype.items():
                for case, e in all_cases.items():
                    if "error" in e:
                        lines.append(f"  {path:6s} {dtype:8s} {case}: FAILED: {e['error']}")
                cases = {c: e for c, e in all_cases.items() if "error" not in e}
                if not cases:
                    continue
                worst_d = max(e["max_diff_D"] for e in cases.values())
                worst_r = max(e["max_rel_diff_ratio"] for e in cases.values())
                worst_dd = max(e["max_rel_diff_Ddot"] for e in cases.values())
                lines.append(f"  {path:6s} {dtype:8s} {len(cases)} cases: max |dD|/max(1,D) {worst_d:.2e}, "
                             f"max rel dr {worst_r:.2e}, max rel dDdot {worst_dd:.2e}")  # fmt: skip
                for case, e in cases.items():
                    for diff in e["differences"]:
                        margins = "; ".join(f"{q} cpu {m['cpu']:+.3e} device {m['device']:+.3e}"
                                            for q, m in diff["margins"].items())  # fmt: skip
                        lines.append(f"    differs: {case} token {diff['token']} ({diff['row_kind']}): {margins}"
                                     f"{'' if diff['explained_by_rounding'] else '  UNEXPLAINED'}")  # fmt: skip
    cost_ = data.get("cost")
    if cost_:
        lines.append(f"\ncost: median of {cost_['repeats']}; goals: PDM <= {GOALS['pdm_vs_dppo']} x DPPO and <= "
                     f"{GOALS['pdm_vs_log_softmax']} x log_softmax, fused row stats <= 1 x log_softmax")  # fmt: skip
        for entry in cost_["sizes"]:
            head = f"  {entry['size']} ({entry['tokens']} tokens x V={cost_['vocab']}) {entry['dtype']}"
            if "skipped" in entry:
                lines.append(f"{head}: {entry['skipped']}")
                continue
            lines.append(head)
            lines.append(f"    {'case':32s} {'ms':>9s} {'x lsm':>7s} {'x lsm32':>7s} {'x dppo':>7s} {'peak GiB':>9s} "
                         f"{'peak x':>7s} goal")  # fmt: skip
            for name, r in entry["cases"].items():
                if "error" in r:
                    lines.append(f"    {name:32s} FAILED: {r['error']}")
                    continue
                peak = "" if r["peak_extra_bytes"] is None else f"{r['peak_extra_bytes'] / 2**30:.3f}"
                peak_x = f"{r['peak_x_log_softmax']:.3f}" if "peak_x_log_softmax" in r else ""
                goal = {True: "met", False: "MISSED"}.get(r.get("goal_met"), "")
                lines.append(f"    {name:32s} {r['ms']:9.2f} {r['x_log_softmax']:7.3f} {r['x_log_softmax_fp32']:7.3f} "
                             f"{r['x_dppo']:7.3f} {peak:>9s} {peak_x:>7s} {goal}")  # fmt: skip
    t = data.get("toy")
    if t and "error_on_default_path" in t:
        lines.append(f"\ntoy: FAILED on the device's default path: {t['error_on_default_path']}; again through the torch path:")
    if t:
        lines.append(f"\ntoy: {'ok' if t['ok'] else 'FAIL'}: {t['steps']} steps in {t['seconds']:.1f} s on "
                     f"{','.join(t['weights_on'])}, row statistics by {t['row_stats_path']}, rewards "
                     f"{', '.join(f'{r:.3f}' for r in t['rewards'])}")  # fmt: skip
    if "ok" in data:
        lines.append(f"\n{'ALL CHECKS PASSED' if data['ok'] else 'SOME CHECK FAILED'}")
    return "\n".join(lines) + "\n"


def guarded(fn, *args) -> dict:
    """A section's result, or its error (one line and the traceback's end): the next section runs."""
    try:
        return fn(*args)
    except Exception as exc:
        return {"ok": False, "error": one_line(exc), "traceback": traceback.format_exc()[-3000:]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="device-check", description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path, help="where device-check.json and device-check.txt go")
    ap.add_argument("--cpu", action="store_true", help="the CPU half: small sizes, Triton's interpreter")
    ap.add_argument("--budget-s", type=float, default=400.0, help="stop timing new sizes after this many seconds")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    if args.out_dir.exists() and not args.out_dir.is_dir():
        print(f"device-check: {args.out_dir} is not a directory", file=sys.stderr)
        return 2
    if args.cpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: the kernel runs in numpy
    watch = ImportWatch()
    sys.meta_path.insert(0, watch)
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("device-check: no CUDA device here; run with --cpu for the CPU half", file=sys.stderr)
        return 2
    try:
        args.out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"device-check: {args.out_dir}: {exc.strerror}", file=sys.stderr)
        return 2
    plan = plan_for(args.cpu)
    report = Report(args.out_dir, t0)
    report.section("mode", "cpu" if args.cpu else "cuda")
    report.section("environment", environment(torch))
    report.progress(f"{report.data['environment']}")
    report.section("correctness", guarded(correctness, torch, plan, report))
    report.section("cost", guarded(cost, torch, plan, report, t0 + args.budget_s))
    report.section("toy", guarded(toy, torch, plan))
    report.progress("toy trained")
    report.section("imports", guarded(imports_check, watch))
    ok = all(report.data[s]["ok"] for s in ("correctness", "cost", "toy", "imports"))
    report.section("ok", ok)
    print(text(report.data), end="")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
