"""Grids: Hydra's override grammar over configs/, sweep files, RunSpec keys, validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdmctl.grid import GridError, expand, load_sweep_file
from pdmctl.spec import RunSpec, SpecError, run_key


def test_cross_product_and_counts():
    specs = expand(["delta=0.05,0.15", "k=10,20,50"])
    assert len(specs) == 6
    assert {(s.config["delta"], s.config["k"]) for s in specs} == {(d, k) for d in (0.05, 0.15) for k in (10, 20, 50)}
    assert all(s.sweep == "default" and s.backend == "toy" for s in specs)
    assert len({s.key for s in specs}) == 6


def test_range_choice_seeds_add_delete_and_quoting():
    specs = expand(["k=range(10,40,10)", "mask=choice(pdm_agg,pdm_uni)", "seeds=2"])
    assert sorted({s.config["k"] for s in specs}) == [10, 20, 30]
    assert {s.config["mask"]["estimator"] for s in specs} == {"agg", "uni"}
    assert {s.seed for s in specs} == {0, 1}
    assert len(specs) == 12
    (spec,) = expand(["+note='a,b'", "~backend.eval_samples", "seed=3"])
    assert spec.config["note"] == "a,b"  # the quoted comma is a value, not a sweep
    assert "eval_samples" not in spec.config["backend"]  # the backend's own default applies
    assert spec.seed == 3
    assert {s.seed for s in expand(["seeds=[4,7]"])} == {4, 7}


def test_group_options_compose():
    (spec,) = expand(["mask=dppo_binary_kl", "precision=fp8_e2e", "model=toy-small"])
    assert spec.config["mask"]["method"] == "dppo"
    assert spec.config["mask"]["divergence"] == "binary_kl"
    assert spec.config["precision"]["name"] == "fp8_e2e"
    assert spec.config["backend"]["steps"] >= 1  # the toy backend's fields come from its config class
    (fast,) = expand(["backend.steps=7"])
    assert fast.config["backend"]["steps"] == 7


def test_key_is_what_changes_the_result():
    a, b = expand(["mask=grpo_clip_higher", "delta=0.05,0.15"]), expand(["mask=pdm_agg", "delta=0.05,0.15"])
    assert len(a) == 1  # GRPO ignores δ: the grid does not train it twice
    assert len(b) == 2
    spec = b[0]
    config = spec.config
    reordered = dict(reversed(list(config.items())))
    assert run_key(reordered) == spec.key  # independent of dict order
    assert RunSpec.from_json(spec.to_json()).key == spec.key
    assert RunSpec.from_config("another-sweep", config).key == spec.key  # the sweep name is not in the key
    renamed = {**config, "mask": {**config["mask"], "name": "my_pdm"}}
    assert run_key(renamed) == spec.key  # a preset's name is not its content
    assert run_key({**config, "seed": 1}) != spec.key
    # stable across releases: a config's key must not drift (a change here orphans every ledger)
    assert len(spec.key) == 12 and all(c in "0123456789abcdef" for c in spec.key)


def test_sweep_files(tmp_path: Path):
    smoke = load_sweep_file("smoke")
    specs = expand([], smoke)
    assert specs and all(s.sweep == "smoke" for s in specs)
    f = tmp_path / "mine.yaml"
    f.write_text(
        "name: mine\ngrid:\n  mask: [pdm_agg, dppo_topk_kl]\n  seeds: 2\n"
        "settings:\n  - {precision: bf16, k: 10}\n  - {precision: fp8_rollout, k: 20}\n"
    )
    specs = expand([], load_sweep_file(str(f)))
    assert len(specs) == 2 * 2 * 2  # settings are zipped, the grid is crossed
    assert {(s.config["precision"]["name"], s.config["k"]) for s in specs} == {("bf16", 10), ("fp8_rollout", 20)}
    # the command line wins over the file, in the grid and in the settings
    specs = expand(["seeds=1", "k=50"], load_sweep_file(str(f)))
    assert {s.config["k"] for s in specs} == {50} and {s.seed for s in specs} == {0}
    assert len(specs) == 4


@pytest.mark.parametrize("name", ["paper-main", "paper-tight", "k-ablation", "k-ablation-qwen3", "smoke"])
def test_named_sweeps_expand(name):
    specs = expand([], load_sweep_file(name))
    assert specs
    if name == "paper-main":
        masks = {s.config["mask"]["name"] for s in specs}
        assert masks == {"grpo_clip_higher", "dppo_topk_kl", "pdm_agg", "pdm_uni"}
        settings = {(s.config["model"]["name"], s.config["precision"]["name"]) for s in specs}
        assert settings == {("qwen3-4b-base", "bf16"), ("qwen3-8b-base", "bf16"),
                            ("qwen3-30b-a3b-base", "fp8_e2e"), ("qwen3-30b-a3b-base", "fp8_rollout")}  # fmt: skip
        assert {s.config["delta"] for s in specs} == {0.15}
    if name.startswith("k-ablation"):
        assert {s.config["k"] for s in specs} == {10, 20, 50}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["foo=1"], r"^foo: unknown key"),
        (["mask=nope"], r"^mask: unknown option 'nope'"),
        (["delta=0"], r"^delta: must be a number > 0"),
        (["delta=-0.1"], r"^delta: must be a number > 0"),
        (["k=0"], r"^k: must be an integer >= 1"),
        (["k=1e12"], r"^k: must be an integer >= 1, got 1e\+12 \(a whole number written as a float; write it as an integer"),
        (["k=20.5"], r"^k: must be an integer >= 1, got 20.5 \(not whole"),
        (["delta=[0.1,"], r"^override 'delta=\[0.1,': malformed"),
        (["delta"], r"^override 'delta': malformed"),
        (["model=qwen3-4b-base"], r"^model: 'qwen3-4b-base' runs on backend=verl"),
        (["precision=fp4"], r"^precision: unknown option 'fp4'"),
        (["backend.group_size=1"], r"group_size"),
        (["k=100000"], r"^k:"),
        (["seeds=0"], r"^seeds: must be >= 1"),
    ],
)
def test_bad_grids_fail_with_one_line(overrides, message):
    with pytest.raises((GridError, SpecError), match=message) as info:
        expand(overrides)
    assert "\n" not in str(info.value)


def test_unknown_sweep_file():
    with pytest.raises(GridError, match=r"^sweep file: 'nope' not found"):
        load_sweep_file("nope")


def test_a_verl_model_brings_its_data_unless_the_run_names_one() -> None:
    """The held-out sets avg@16 is read from (data.eval) follow the model: the testbed's toy24/25 by
    default, AIME-named sets for the VeRL models; `data=...` on the command line still wins."""
    def data(*overrides: str) -> tuple[str, list[str]]:
        (spec,) = expand(list(overrides), None, "d")
        return spec.config["data"]["name"], spec.config["data"]["eval"]

    assert data() == ("toy", ["toy24", "toy25"])
    assert data("backend=verl", "model=qwen3-tiny") == ("tiny-sums", ["aime24", "aime25"])
    assert data("backend=verl", "model=qwen3-4b-base") == ("dapo-math", ["aime24", "aime25"])
    assert data("backend=verl", "model=qwen3-tiny", "data=dapo-math")[0] == "dapo-math"
    specs = expand(["backend=verl", "model=qwen3-tiny,qwen3-8b-base"], None, "d")
    assert [s.config["data"]["name"] for s in specs] == ["tiny-sums", "dapo-math"]
