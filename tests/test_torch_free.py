"""What needs no torch: expanding, checking and describing a grid, and reading the ledger.

Torch is imported only where a run trains or analyses; the names a config is checked against (the testbed's
presets and precisions, the masks' methods, divergences, estimators and aggregations, the shipped base
model's digest) live in modules of their own, held equal here to what the torch modules define.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdmctl import masks
from pdmctl.backends.toy import basemodel, llm_task, model, presets, shipped, task
from pdmctl.backends.toy.config import ToyConfig
from pdmctl.masks import names as mask_names

# the CLI with torch not importable: every `import torch` raises as it does where torch is not installed, and
# the attempt is told on stderr at exit
WITHOUT_TORCH = """
import atexit, runpy, sys
tried = []
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            tried.append(name)
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoTorch())
atexit.register(lambda: tried and print(f"torch looked up: {tried[0]}", file=sys.stderr))
sys.argv = ["pdmctl", *sys.argv[1:]]
runpy.run_module("pdmctl.cli", run_name="__main__")
"""


# each preset's vocabulary and sequence length (its position embeddings)
MODEL_SIZES = {"toy-small": (4096, 10), "toy-llm": (512, 25), "toy-fork": (512, 25)}


def without_torch(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    return subprocess.run([sys.executable, "-c", WITHOUT_TORCH, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**env, "COLUMNS": "200"})  # fmt: skip


def test_the_presets_task_sizes_are_the_tasks() -> None:
    assert presets.VOCAB_SIZE == task.VOCAB_SIZE
    assert presets.PROMPT_LEN == task.PROMPT_LEN
    assert presets.MAX_RESPONSE_LEN == task.MAX_RESPONSE_LEN
    assert presets.LLM_VOCAB_SIZE == llm_task.VOCAB_SIZE
    assert presets.LLM_MAX_RESPONSE_LEN == llm_task.MAX_RESPONSE_LEN
    assert presets.SEQ_LEN == task.PROMPT_LEN + task.MAX_RESPONSE_LEN
    assert {
        name: (p.vocab_size, getattr(p, "seq_len", presets.SEQ_LEN))
        for name, p in presets.MODEL_PRESETS.items()
    } == MODEL_SIZES


def test_the_model_and_the_base_model_use_the_torch_free_presets_and_check() -> None:
    assert model.MODEL_PRESETS is presets.MODEL_PRESETS
    assert (model.ModelPreset, model.LLMPreset, model.ForkPreset) == (
        presets.ModelPreset, presets.LLMPreset, presets.ForkPreset)  # fmt: skip
    assert tuple(model.PRECISIONS) == presets.PRECISION_NAMES
    for name in ("check_shipped", "recipe_of", "sha256_of", "shipped_path", "base_source",
                 "BaseModelError", "SHIPPED_SHA256", "WEIGHTS_DIR", "SOURCES"):  # fmt: skip
        assert getattr(basemodel, name) is getattr(shipped, name), name


def test_the_recipe_of_a_preset_is_its_fields_unchanged() -> None:
    """The shipped files record these recipes: a changed field or value would refuse them."""
    recipe = shipped.recipe_of("toy-small")
    assert recipe["preset"] == "toy-small" and recipe["vocab_size"] == 4096 and recipe["d_model"] == 32
    assert list(recipe) == ["preset", *(f.name for f in dataclasses.fields(presets.ModelPreset))]
    fork = shipped.recipe_of("toy-fork")
    assert (fork["task"], fork["init_scale"], fork["logit_scale"], fork["seq_len"]) == ("fork", 4.0, 32.0, 25)


def test_the_mask_names_are_the_registries() -> None:
    assert tuple(masks.METHODS) == mask_names.METHODS
    assert tuple(masks.DIVERGENCES) == mask_names.DIVERGENCES
    assert tuple(masks.ESTIMATORS) == mask_names.ESTIMATORS
    assert tuple(masks.AGGREGATIONS) == mask_names.AGGREGATIONS
    assert tuple(name for name, spec in masks.METHODS.items() if spec.uses_ddot) == mask_names.USES_DDOT


def test_the_masks_package_reads_its_names_without_torch_and_lends_every_public_name_of_its_loss() -> None:
    """`pdmctl.spec`, `pdmctl.masks` and `pdmctl.masks.names` import no torch; each public name of
    `pdmctl.masks.loss` (`rows`' among them) is read through `pdmctl.masks` as the very same object."""
    code = ("import sys, pdmctl.spec, pdmctl.masks, pdmctl.masks.names\n"
            "from pdmctl.masks import names\n"
            "assert names.is_known('METHODS', 'pdm') and 'torch' not in sys.modules, sorted(sys.modules)")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    from pdmctl.masks import loss, rows

    imported = {"annotations", "dataclass", "Callable"}  # loss.py's own imports, no modules among the names
    public = {name for name, value in vars(loss).items()
              if not name.startswith("_") and not isinstance(value, type(loss)) and name not in imported}  # fmt: skip
    assert {"VocabShard", "fused_row_stats", "kernel_choice"} <= public and rows.VocabShard is loss.VocabShard
    assert public == set(masks._FROM_LOSS)
    assert all(getattr(masks, name) is getattr(loss, name) for name in public)
    with pytest.raises(AttributeError, match="no attribute 'bogus'"):
        masks.bogus  # noqa: B018


@pytest.fixture
def registered_method():
    name = "clip_all"
    masks.register_method(name, uses_divergence=False, uses_ddot=True)(lambda inputs: inputs.ratio > 0)
    yield name
    del masks.METHODS[name]


def test_a_method_registered_at_run_time_validates_and_keys(registered_method: str) -> None:
    from pdmctl.spec import result_config

    assert ToyConfig(method=registered_method).method == registered_method
    assert mask_names.is_known("METHODS", registered_method)
    assert mask_names.uses_ddot(registered_method)
    config = {"mask": {"method": registered_method, "estimator": "agg", "eps_low": 0.2, "eps_high": 0.28}}
    assert result_config(config)["mask"]["estimator"] == "agg"  # its mask reads Ḋ: the estimator changes it


def test_an_unknown_mask_name_lists_every_registered_one(registered_method: str) -> None:
    with pytest.raises(
        ValueError, match=rf"method: unknown 'bogus'; choose from {registered_method}, dppo, grpo"
    ):
        ToyConfig(method="bogus")
    with pytest.raises(ValueError, match="loss_agg_mode: unknown 'bogus'; choose from seq-mean-token-mean"):
        ToyConfig(loss_agg_mode="bogus")


def test_dry_runs_status_report_and_resume_never_look_for_torch(workdir: Path) -> None:
    """Where VeRL is installed too: its config's fields are read from its files, not imported (torch)."""
    testbed = without_torch("sweep", "delta=0.05", "--dry-run", cwd=workdir)
    assert testbed.returncode == 0, testbed.stderr
    assert "would submit 1" in testbed.stdout
    verl = without_torch("sweep", "backend=verl", "model=qwen3-tiny", "--dry-run", cwd=workdir)
    assert verl.returncode == 0, verl.stderr
    assert "qwen3-tiny" in verl.stdout
    status = without_torch("status", cwd=workdir)
    assert status.returncode == 0, status.stderr
    assert "no runs" in status.stdout
    resume = without_torch("resume", cwd=workdir)
    assert resume.returncode == 0, resume.stderr
    report = without_torch("report", cwd=workdir)
    assert report.returncode == 2 and "no ledger" in report.stderr, report.stderr
    helped = without_torch("--help", cwd=workdir)
    assert helped.returncode == 0, helped.stderr
    for result in (testbed, verl, status, resume, report, helped):
        assert "torch looked up" not in result.stderr, result.stderr
    assert list(workdir.iterdir()) == []  # none of them writes anything


def test_a_testbed_sweep_without_torch_is_refused_in_one_line_before_anything_is_written(
    workdir: Path,
) -> None:
    result = without_torch("sweep", "backend.steps=1", cwd=workdir)
    assert result.returncode == 2
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("torch looked up")]
    assert len(lines) == 1 and "torch is not installed" in lines[0], result.stderr
    # the extra that brings it, as pdmctl's installed metadata names it (pyproject's [testbed])
    assert "the toy backend's runs train with it: pip install 'pdmctl[testbed]' (or 'torch" in lines[0], lines[0]
    assert list(workdir.iterdir()) == []


@pytest.mark.verl
def test_verls_config_fields_read_from_its_files_are_the_imported_ones() -> None:
    """Every dataclass VeRL's trainer config instantiates: the same fields in the same order, the same types
    except the classes VeRL defines (checked as their defaults' kinds)."""
    pytest.importorskip("verl")
    import importlib
    import typing

    from pdmctl.backends.verl import dataclass_source, schema

    targets: set[str] = set()

    def walk(node: object) -> None:
        if isinstance(node, dict):
            targets.update([str(node["_target_"])] if "_target_" in node else [])
            for value in node.values():
                walk(value)

    for engine in schema.GENERATED_CONFIGS:
        walk(schema._config(engine))
    compared = 0
    for target in sorted(targets):
        module, _, name = target.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        read = dataclass_source.fields(target)
        if not dataclasses.is_dataclass(cls):
            assert read is None, target
            continue
        hints = typing.get_type_hints(cls)
        imported = {f.name: hints.get(f.name, typing.Any) for f in dataclasses.fields(cls)}
        assert read is not None and list(read) == list(imported), target
        for field, hint in imported.items():
            if "verl." not in repr(hint):
                assert read[field] == hint, (target, field)
                compared += 1
    assert len(targets) > 20 and compared > 200
