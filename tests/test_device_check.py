"""scripts/device-check.sh: its CPU half runs here as it will on a GPU machine, so it cannot rot before
one is lent; the parts only a GPU takes (the fused kernel's timing cases, the margins of a decision
that differs) run here on CPU at toy sizes."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "device-check.sh"


def _module():
    spec = importlib.util.spec_from_file_location("device_check", ROOT / "bench" / "device_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("device_check", module)  # its dataclasses look their module up there
    spec.loader.exec_module(sys.modules["device_check"])
    return sys.modules["device_check"]


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=timeout)


def test_the_cpu_half_passes_and_imports_only_torch_triton_numpy(tmp_path):
    out = tmp_path / "check"
    proc = _run(str(out), "--cpu")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "device-check.json").read_text())
    assert data["mode"] == "cpu" and data["ok"] is True
    cor = data["correctness"]
    assert cor["cases_checked"] == 24 and cor["masked_cpu"] > 0 and cor["unexplained"] == 0
    assert set(cor["paths"]) == {"fused"}  # the kernel, under Triton's interpreter
    (b16, f32) = data["cost"]["sizes"]
    assert (b16["dtype"], f32["dtype"]) == ("bfloat16", "float32")
    for entry in (b16, f32):
        assert {"log_softmax", "dppo topk_kl", "pdm exact topk_tv"} <= set(entry["cases"])
        assert all(c["ms"] > 0 and c["x_log_softmax"] > 0 and "goal_met" not in c for c in entry["cases"].values())
    toy = data["toy"]
    assert toy["ok"] and toy["weights_on"] == ["cpu"] and len(toy["rewards"]) == 2
    assert all(math.isfinite(v) for v in toy["final"].values())
    imports = data["imports"]
    assert imports["ok"] and {"torch", "triton", "pdmctl"} <= set(imports["imported_by_pdmctl_or_the_check"])
    assert not {"typer", "mlflow", "hydra", "omegaconf", "rich", "yaml", "scipy"} & set(imports["loaded"])
    assert (out / "device-check.txt").read_text().rstrip().endswith("ALL CHECKS PASSED")


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    for args, message in (
        ((), "usage: bash scripts/device-check.sh OUT_DIR [--cpu]"),
        ((str(tmp_path / "out"), "--gpu"), "usage: bash scripts/device-check.sh OUT_DIR [--cpu]"),
    ):
        proc = _run(*args)
        assert (proc.returncode, proc.stderr) == (2, f"device-check.sh: {message}\n")
    a_file = tmp_path / "file"
    a_file.write_text("")
    proc = _run(str(a_file), "--cpu")
    assert (proc.returncode, proc.stderr) == (2, f"device-check: {a_file} is not a directory\n")
    if not torch.cuda.is_available():
        proc = _run(str(tmp_path / "gpu"))
        assert (proc.returncode, proc.stderr) == (2, "device-check: no CUDA device here; run with --cpu for the CPU half\n")
        assert not (tmp_path / "gpu").exists()


def test_the_gpu_only_timing_cases_run(monkeypatch):
    """The cases only a GPU times (the fused kernel's row statistics, masks through the torch path), at
    toy size on CPU under the interpreter, with their ratios against the goals."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    check = _module()
    inputs = check.timing_inputs(torch, 4, 96, torch.bfloat16, torch.device("cpu"))
    results = check.ratios(check.measure(torch, check.timing_cases(torch, inputs, True), 1, False), goals=True)
    assert {"fused row stats (exact)", "dppo topk_kl [torch path]", "pdm exact topk_kl [torch path]"} <= set(results)
    assert isinstance(results["fused row stats (exact)"]["goal_met"], bool)
    assert isinstance(results["pdm agg topk_kl"]["goal_met"], bool)
    assert results["dppo topk_tv"]["x_dppo"] == 1.0


def test_a_decision_that_differs_is_listed_and_fails_unless_a_tie():
    """`compare` lists every decision the two paths take differently with its deciding quantities; one
    whose quantities agree in sign on both sides (no tie) counts as unexplained: the check fails."""
    from pdmctl.masks import token_diagnostics
    from tests.test_masks import make_batch

    check = _module()
    z, sampled, ids, lps, slp, adv = make_batch(n=16, vocab=50, k=5, seed=3, dtype=torch.float32)
    args = (z, sampled, ids, lps.float(), slp.float(), adv.float())
    ref = token_diagnostics(*args, method="dppo", delta=check.DELTA)
    inputs = {"adv": adv.float(), "kind": ["plain"] * 16}
    assert check.compare(torch, "dppo", ref, ref, inputs)["decisions_differ"] == 0
    out = int((ref.out_of_region & ((adv * (ref.ratio - 1)) > 0)).nonzero()[0])  # a masked token, far from δ
    flipped = type(ref)(**{**ref.__dict__, "keep": ref.keep.clone()})
    flipped.keep[out] = ~flipped.keep[out]
    far = check.compare(torch, "dppo", ref, flipped, inputs)
    assert far["decisions_differ"] == 1 and far["unexplained"] == 1
    (listed,) = far["differences"]
    assert listed["token"] == out and not listed["explained_by_rounding"]
    assert listed["margins"]["D - delta"]["cpu"] == pytest.approx(float(ref.divergence[out]) - check.DELTA)
    tie = type(ref)(**{**flipped.__dict__, "divergence": ref.divergence.clone()})
    tie.divergence[out] = check.DELTA - 1e-7  # on the device D fell just under δ: the paths' own rounding
    ref_at_tie = type(ref)(**{**ref.__dict__, "divergence": ref.divergence.clone()})
    ref_at_tie.divergence[out] = check.DELTA + 1e-7
    near = check.compare(torch, "dppo", ref_at_tie, tie, inputs)
    assert near["decisions_differ"] == 1 and near["unexplained"] == 0 and near["values_agree"]
    wrong = type(ref)(**{**flipped.__dict__, "divergence": ref.divergence.clone()})
    wrong.divergence[out] = check.DELTA - 0.01  # under δ on the device, but far from CPU's D: a bug
    bug = check.compare(torch, "dppo", ref, wrong, inputs)
    assert bug["unexplained"] == 1 and not bug["values_agree"]


def test_the_import_check_names_what_pdmctl_imports_beyond_torch():
    """A module that pdmctl's code imports and torch, Triton and numpy do not need fails the check;
    one that torch imports of its own accord (dill, tqdm where installed) does not."""
    code = (
        "import sys; sys.path.insert(0, 'bench'); import device_check as c; w = c.ImportWatch(); "
        "sys.meta_path.insert(0, w); exec('import yaml', {'__name__': 'pdmctl.fake'}); "
        "exec('import tqdm', {'__name__': 'torch.hub'}); r = c.imports_check(w); "
        "print(r['outside_torch_triton_numpy'], r['imported_by_pdmctl_or_the_check'], r['ok'])"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.stdout == "['yaml'] ['yaml'] False\n", proc.stderr
