"""Masks, testbed presets and data sets from another installed package (pdmctl.plugins): found through their
entry points, composed as config options, trained on the testbed and reported against PDM, registered as
VeRL losses; each way a plugin can be wrong is refused in one line naming it, exit code 2.

A plugin package here is a folder on PYTHONPATH with a `.dist-info` beside its module, as pip leaves an
installed one: importlib.metadata finds its entry points as it finds any installed package's.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import FAST, pdmctl

# "keep a token unless D > δ, A·Ḋ > 0 and |r − 1| > 0.1": PDM's mask, left alone where the ratio barely moved
MINE = '''
import os

from pdmctl.plugins import MaskPlugin


def keep(t):
    if os.environ.get("PDMCTL_TEST_KEEP_CALLED"):
        open(os.environ["PDMCTL_TEST_KEEP_CALLED"], "a").close()
    return ~((t.divergence > t.delta) & (t.advantages * t.ddot > 0) & ((t.ratio - 1).abs() > 0.1))


MASK = MaskPlugin(name="mine", keep=keep, config={"divergence": "topk_kl", "estimator": "agg"})
'''

# a smaller model than toy-small on its task, and held-out sets of sums that carry
PRESET = {"d_model": 16, "n_layers": 1, "n_heads": 2, "warmup_steps": 4000, "warmup_batch": 256, "warmup_lr": 1e-2,
          "warmup_weight_decay": 0.1, "warmup_criterion": 0.97, "warmup_check_every": 50, "warmup_anneal_steps": 300,
          "label_smoothing": 0.01, "label_noise": 0.15, "lead_label_noise": 0.5, "careful_lead_label_noise": 0.1}
TESTBED = '''
import dataclasses
import random
from pathlib import Path

import torch

from pdmctl.backends.toy import task as addition
from pdmctl.backends.toy.presets import ModelPreset
from pdmctl.backends.toy.tasks import TASKS
from pdmctl.plugins import DataPlugin, ModelPlugin

HERE = Path(__file__).parent
MODEL = ModelPlugin(name="toy-mini", preset=ModelPreset(**{preset}), weights=HERE / "toy-mini.pt",
                    sha256="{digest}")


def _carries(seed):
    rng, pairs = random.Random(seed), []
    while len(pairs) < 8:
        a, b = rng.randint(0, addition.MAX_OPERAND), rng.randint(0, addition.MAX_OPERAND)
        if a % 10 + b % 10 >= 10:
            pairs.append((a, b))
    return torch.tensor(pairs, dtype=torch.long)


HELDOUT = {{"carry24": _carries(24), "carry25": _carries(25)}}
TASK = dataclasses.replace(TASKS["addition"], name="carries", heldout=lambda name: addition.encode(HELDOUT[name]),
                           eval_sets=("carry24", "carry25"))
DATA = DataPlugin(name="carries", task=TASK, base_task="addition")
'''


def install(root: Path, dist: str, modules: dict[str, str], entry_points: str) -> dict[str, str]:
    """A package `dist` of `modules` (name -> source) declaring `entry_points` (entry_points.txt's text), as
    installed under `root`; the environment that has it on the path."""
    root.mkdir(parents=True, exist_ok=True)
    for name, source in modules.items():
        (root / f"{name}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    return {"PYTHONPATH": os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}


def error_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_a_plugin_mask_trains_on_the_testbed_and_the_report_compares_it_with_pdm(workdir: Path, tmp_path: Path):
    """`mask=mine,pdm_agg` composes the plugin's node beside the shipped one; the plugin's keep decision is what
    the testbed's job trains with (it is called there); status and report read the runs, and the report's
    comparison is mine against pdm_agg."""
    env = install(tmp_path / "site", "my-masks", {"my_masks": MINE}, "[pdmctl.masks]\nmine = my_masks:MASK\n")
    called = tmp_path / "keep-called"
    env["PDMCTL_TEST_KEEP_CALLED"] = str(called)
    res = pdmctl("sweep", "--name", "mine", "mask=mine,pdm_agg", "seed=0", *FAST, "--wait", cwd=workdir, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert called.exists()  # the job ran the plugin's keep decision

    from pdmctl import api

    rows = {row["summary"].split()[0]: row for row in api.status("mine")}  # no plugin in this process
    assert {name: row["state"] for name, row in rows.items()} == {"mine": "finished", "pdm_agg": "finished"}
    mask = rows["mine"]["config"]["mask"]
    assert (mask["method"], mask["divergence"], mask["ratio_cap"]) == ("mine", "topk_kl", 10.0)  # pdm_agg's defaults
    assert rows["mine"]["step"] == 6 and rows["mine"]["avg16"] is not None

    res = pdmctl("report", "mine", "--baseline", "pdm_agg", "--panels", "none", cwd=workdir, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    with open(workdir / "reports" / "mine" / "comparison.csv") as fh:
        compared = {(row["mask"], row["baseline"]) for row in csv.DictReader(fh)}
    assert compared == {("mine", "pdm_agg")}


def test_a_plugin_model_preset_and_data_set_train_on_the_testbed(workdir: Path, tmp_path: Path):
    """`model=toy-mini data=carries`: the plugin's preset starts from its own recorded base model and the run
    evaluates on the plugin's held-out sets (eval/carry24, eval/carry25, the node's `eval:`)."""
    import torch

    from pdmctl.backends.toy.model import TinyTransformer
    from pdmctl.backends.toy.presets import ModelPreset

    site = tmp_path / "site"
    site.mkdir()
    preset = ModelPreset(**PRESET)
    weights = site / "toy-mini.pt"  # a base model in the shipped files' format (random weights: a fast test)
    torch.manual_seed(0)
    torch.save({"format": 1, "recipe": {"preset": "toy-mini", **dataclasses.asdict(preset)},
                "state_dict": TinyTransformer(preset).state_dict()}, weights)  # fmt: skip
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    env = install(site, "my-testbed", {"my_testbed": TESTBED.format(preset=repr(PRESET), digest=digest)},
                  "[pdmctl.models]\ntoy-mini = my_testbed:MODEL\n[pdmctl.data]\ncarries = my_testbed:DATA\n")
    res = pdmctl("sweep", "--name", "mini", "model=toy-mini", "data=carries", "seed=0", "backend.steps=2",
                 "backend.eval_every=2", "backend.checkpoint_every=2", "backend.prompts_per_step=8",
                 "backend.eval_samples=2", "--wait", cwd=workdir, env=env)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    from pdmctl import api

    (row,) = api.status("mini")
    assert row["state"] == "finished", row
    assert row["config"]["data"] == {"name": "carries", "eval": ["carry24", "carry25"]}
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    logged = set(client.get_run(row["run_id"]).data.metrics)
    assert {"eval/carry24", "eval/carry25"} <= logged and "eval/toy24" not in logged

    # the recorded base model is checked: a changed file is refused before any run
    weights.write_bytes(weights.read_bytes() + b"\0")
    res = pdmctl("sweep", "--name", "mini2", "model=toy-mini", "seed=0", "--dry-run", cwd=workdir, env=env)
    assert res.returncode == 2 and "toy-mini.pt: SHA-256" in error_line(res)
    res = pdmctl("sweep", "--name", "mini3", "model=toy-llm", "data=carries", "--dry-run", cwd=workdir, env=env)
    assert res.returncode == 2 and "data: 'carries' is in the layout of the 'addition' task" in error_line(res)


BAD = {
    "pdm_agg": ("from pdmctl.plugins import MaskPlugin\nMASK = MaskPlugin(name='pdm_agg', keep=lambda t: t.ratio > 0)\n",
                "mask plugin 'pdm_agg' (evil:MASK in evil-masks 0.1): 'pdm_agg' is the name of a built-in mask"),
    "pdm": ("from pdmctl.plugins import MaskPlugin\nMASK = MaskPlugin(name='pdm', keep=lambda t: t.ratio > 0)\n",
            "mask plugin 'pdm' (evil:MASK in evil-masks 0.1): 'pdm' is the name of a built-in mask"),
    "broken": ("import no_such_module_for_a_pdmctl_test\n",
               "mask plugin 'broken' (evil:MASK in evil-masks 0.1): does not import: ModuleNotFoundError: No module "
               "named 'no_such_module_for_a_pdmctl_test'"),
    "floats": ("from pdmctl.plugins import MaskPlugin\nMASK = MaskPlugin(name='floats', keep=lambda t: t.ratio - 1)\n",
               "mask plugin 'floats' (evil:MASK in evil-masks 0.1): keep returned torch.float64 of shape (4,); it "
               "must return a torch.bool tensor of shape (4,), one decision per token"),
    "rows": ("from pdmctl.plugins import MaskPlugin\n"
             "MASK = MaskPlugin(name='rows', keep=lambda t: (t.ratio > 1)[:, None])\n",
             "keep returned torch.bool of shape (4, 1); it must return a torch.bool tensor of shape (4,)"),
    "function": ("def MASK(t):\n    return t.ratio > 0\n",
                 "mask plugin 'function' (evil:MASK in evil-masks 0.1): is a function, not a "
                 "pdmctl.plugins.MaskPlugin"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_a_plugin_that_cannot_be_used_is_one_line_and_exit_2(workdir: Path, tmp_path: Path, name: str):
    """Named like a built-in (a shipped option, a method), failing to import, deciding with anything but one
    bool per token, not a MaskPlugin: refused before any run, in one line naming the plugin and its package."""
    source, expected = BAD[name]
    env = install(tmp_path / "site", "evil-masks", {"evil": source}, f"[pdmctl.masks]\n{name} = evil:MASK\n")
    res = pdmctl("sweep", f"mask={name}", "--dry-run", cwd=workdir, env=env)
    assert res.returncode == 2 and expected in error_line(res), res.stderr


def test_a_plugin_that_fails_to_import_stops_only_the_sweeps_that_name_it(workdir: Path, tmp_path: Path):
    """Built-in masks never load a plugin: with a broken one installed, `mask=pdm_agg,dppo_topk_kl` plans."""
    source, _ = BAD["broken"]
    env = install(tmp_path / "site", "evil-masks", {"evil": source}, "[pdmctl.masks]\nbroken = evil:MASK\n")
    res = pdmctl("sweep", "mask=pdm_agg,dppo_topk_kl", "--dry-run", cwd=workdir, env=env)
    assert res.returncode == 0, res.stderr


def test_a_keep_decision_of_the_wrong_shape_in_training_is_one_line_naming_the_plugin() -> None:
    """The check runs on every call, not only on the probe: a decision right on four tokens and wrong on more
    raises PluginError naming the plugin, which a job records as the run's one-line reason."""
    import torch

    from pdmctl import masks, plugins

    plugin = plugins.MaskPlugin("sly", keep=lambda t: torch.ones(4, dtype=torch.bool))
    masked = plugins._masked(plugin, "mask plugin 'sly'")
    assert masked(plugins._probe()).tolist() == [False] * 4
    n = 6
    f64 = torch.zeros(n, dtype=torch.float64)
    inputs = masks.MaskInputs(f64, f64 + 1, f64, f64, f64 + 0.15, 0.2, 0.28, 10.0)
    with pytest.raises(plugins.PluginError, match=r"^mask plugin 'sly': keep returned torch.bool of shape \(4,\); "
                                                  r"it must return a torch.bool tensor of shape \(6,\)"):  # fmt: skip
        masked(inputs)


def test_an_unloaded_plugin_methods_run_key_is_the_loaded_ones() -> None:
    """A plugin mask's key keeps its estimator whether or not the plugin is installed where the key is computed
    (status and report read its runs without it)."""
    from pdmctl import spec
    from pdmctl.masks import names as mask_names

    config = {"seed": 0, "delta": 0.15, "k": 20, "data": {"name": "toy"},
              "mask": {"name": "gone", "method": "gone-plugin", "divergence": "topk_kl", "estimator": "uni"}}  # fmt: skip
    assert mask_names.uses_ddot("gone-plugin")
    assert spec.result_config(config)["mask"]["estimator"] == "uni"


@pytest.mark.verl
def test_verls_loss_registry_has_a_loss_for_each_installed_plugin_mask(tmp_path: Path) -> None:
    """Importing pdmctl's VeRL plugin registers `pdmctl_mine` beside pdmctl_pdm; a broken plugin is skipped there
    and named in the check that a run's loss is registered."""
    pytest.importorskip("verl")
    env = install(tmp_path / "site", "my-masks", {"my_masks": MINE, "bad_masks": BAD["broken"][0]},
                  "[pdmctl.masks]\nmine = my_masks:MASK\nbroken = bad_masks:MASK\n")
    code = ("import json; from pdmctl.backends.verl import plugin; "
            "print(json.dumps([plugin.registered_losses(), plugin.PLUGIN_PROBLEMS]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env})  # fmt: skip
    assert done.returncode == 0, done.stderr
    losses, problems = json.loads(done.stdout.strip().splitlines()[-1])
    assert {"pdmctl_mine", "pdmctl_pdm", "pdmctl_dppo", "pdmctl_grpo"} <= set(losses)
    assert len(problems) == 1 and problems[0].startswith("mask plugin 'broken'")
