"""The array's order: seed-major by default (replicate 0 of every arm of every setting, then replicate 1, ...),
so that a sweep stopped after a replicate holds complete paired comparisons; setting by setting on request."""

from __future__ import annotations

from pathlib import Path

from pdmctl.grid import expand, load_sweep_file
from pdmctl.orchestrate import order_runs, replicates, settings_first
from tests.conftest import pdmctl


def _arm(spec) -> str:
    return spec.summary.rsplit(" seed=", 1)[0]


def test_paper_main_runs_seed_zero_of_every_arm_of_every_setting_before_any_seed_one() -> None:
    specs = expand([], load_sweep_file("paper-main"))
    ordered = order_runs(specs, "seed")
    assert sorted(s.key for s in ordered) == sorted(s.key for s in specs)
    assert [s.seed for s in ordered] == [0] * 16 + [1] * 16 + [2] * 16
    for start in (0, 16, 32):  # each replicate: the 16 arms (4 masks x 4 settings), each once
        assert sorted(_arm(s) for s in ordered[start:start + 16]) == sorted({_arm(s) for s in specs})
    settings = [(s.config["model"]["name"], s.config["precision"]["name"]) for s in ordered[:4]]
    assert settings == [("qwen3-4b-base", "bf16"), ("qwen3-8b-base", "bf16"),
                        ("qwen3-30b-a3b-base", "fp8_e2e"), ("qwen3-30b-a3b-base", "fp8_rollout")]  # fmt: skip
    masks = [s.config["mask"]["name"] for s in ordered[:16:4]]  # settings take turns: arm by arm
    assert masks == ["grpo_clip_higher", "dppo_topk_kl", "pdm_agg", "pdm_uni"]


def test_the_setting_order_is_the_one_run_of_each_setting_then_grid_order() -> None:
    specs = expand([], load_sweep_file("paper-main"))
    assert order_runs(specs, "setting") == settings_first(specs)
    assert [s.seed for s in order_runs(specs, "setting")[4:7]] == [1, 2, 0]  # 4B grpo's seeds 1, 2; dppo's 0


def test_a_replicate_is_a_seeds_rank_within_its_arm() -> None:
    """Arms with their own seeds (7, 9 for one setting, 0, 1 for another) pair by rank, not by value."""
    specs = expand(["precision=bf16,fp8_rollout", "seed=0,1,7,9"], None, "s")
    bf16 = [s for s in specs if s.config["precision"]["name"] == "bf16" and s.seed in (7, 9)]
    fp8 = [s for s in specs if s.config["precision"]["name"] == "fp8_rollout" and s.seed in (0, 1)]
    ordered = order_runs(bf16 + fp8, "seed")
    assert [(s.config["precision"]["name"], s.seed) for s in ordered] == [
        ("bf16", 7), ("fp8_rollout", 0), ("bf16", 9), ("fp8_rollout", 1)]  # fmt: skip
    assert [replicates(ordered)[s.key] for s in ordered] == [0, 0, 1, 1]


def test_the_dry_run_shows_the_order_and_takes_it_from_the_option_or_the_sweep_file(workdir: Path) -> None:
    seed = pdmctl("sweep", "seed=0,1,2", "k=10,20", "--dry-run", cwd=workdir)
    assert seed.returncode == 0, seed.stderr
    assert ("order: seed: runs 1-2 are replicate 0 (each arm's lowest seed), runs 3-4 replicate 1, runs 5-6 "
            "replicate 2;") in seed.stdout  # fmt: skip
    setting = pdmctl("sweep", "k=10,20", "seed=0,1,2", "--order", "setting", "--dry-run", cwd=workdir)
    assert setting.returncode == 0, setting.stderr
    assert "order: setting: one run of each setting" in setting.stdout
    (workdir / "s.yaml").write_text("name: s\norder: setting\ngrid: {k: [10, 20], seeds: 2}\n")
    from_file = pdmctl("sweep", "--file", str(workdir / "s.yaml"), "--dry-run", cwd=workdir)
    assert "order: setting: " in from_file.stdout, from_file.stderr
    overridden = pdmctl("sweep", "--file", str(workdir / "s.yaml"), "--order", "seed", "--dry-run", cwd=workdir)
    assert "order: seed: runs 1-2 are replicate 0" in overridden.stdout, overridden.stderr
    assert sorted(p.name for p in workdir.iterdir()) == ["s.yaml"]  # a dry run writes nothing


def test_an_unknown_order_is_one_line_and_exit_2(workdir: Path) -> None:
    bad = pdmctl("sweep", "k=10,20", "--order", "random", "--dry-run", cwd=workdir)
    assert bad.returncode == 2 and bad.stderr.strip() == "error: --order: unknown order 'random'; choose from seed, setting"
    (workdir / "s.yaml").write_text("name: s\norder: arm\ngrid: {k: [10, 20]}\n")
    from_file = pdmctl("sweep", "--file", str(workdir / "s.yaml"), "--dry-run", cwd=workdir)
    lines = from_file.stderr.strip().splitlines()
    assert from_file.returncode == 2 and len(lines) == 1 and "order: unknown order 'arm'" in lines[0], from_file.stderr
