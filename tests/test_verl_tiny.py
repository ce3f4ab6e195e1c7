"""The engine's tiny Qwen3 is the same model whatever CPU kernels build it (the question a
fixed-length warm-up raises, for tiny.py's): its supervised warm-up is short and far from any transition, so the scalar
kernels and the machine's own give the same greedy answers to every problem."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("pyarrow")

pytestmark = pytest.mark.verl

_BUILD_AND_ANSWER = """
import json, sys, tempfile, torch
from pathlib import Path
from pdmctl.backends.verl import tiny
from transformers import AutoModelForCausalLM, AutoTokenizer
out = Path(tempfile.mkdtemp())
tiny.build(out)
tok = AutoTokenizer.from_pretrained(out / "model")
model = AutoModelForCausalLM.from_pretrained(out / "model")
answers = {}
for split in ("train", "aime24", "aime25"):
    for question, _ in tiny.problems(split):
        prompt = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        greedy = model.generate(ids, max_new_tokens=8, do_sample=False)
        answers[question] = tok.decode(greedy[0, ids.shape[1]:], skip_special_tokens=True)
weights = {name: p.detach().flatten()[:4096].tolist() for name, p in model.named_parameters()}
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "answers": answers, "weights": weights}))
"""


def _build(capability: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if capability:
        env["ATEN_CPU_CAPABILITY"] = capability
    proc = subprocess.run([sys.executable, "-c", _BUILD_AND_ANSWER], capture_output=True, text=True, env=env,
                          timeout=600, check=True)  # fmt: skip
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_tiny_qwen3_is_the_same_model_under_scalar_and_native_kernels() -> None:
    scalar, native = _build("default"), _build(None)
    assert scalar["capability"] == "DEFAULT"
    assert scalar["answers"] == native["answers"]
    correct = sum(a.strip() == f"Answer: {sum(map(int, q[:-1].split('+')))}" for q, a in native["answers"].items())
    assert 0 < correct < len(native["answers"])  # rewards neither all 0 nor all 1
    drift = max(
        abs(a - b) for name in native["weights"] for a, b in zip(scalar["weights"][name], native["weights"][name],
                                                                  strict=True)
    )  # fmt: skip
    assert drift < 1e-2, drift
