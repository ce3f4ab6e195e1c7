"""The array's order: answers first by default (replicate 0 of every setting, then replicate 1, ...; inside a
replicate setting by setting, all its arms together, the cheapest first, a sweep file's priority before), so
that each setting's first comparison comes as early as its runs allow and a sweep stopped after a replicate
holds complete paired comparisons; seed-major (settings taking turns) and setting by setting on request."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

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
    default = pdmctl("sweep", "seed=0,1,2", "k=10,20", "--dry-run", cwd=workdir)
    assert default.returncode == 0, default.stderr
    assert ("order: answers: runs 1-2 are replicate 0 (each arm's lowest seed), runs 3-4 replicate 1, runs 5-6 "
            "replicate 2;") in default.stdout  # fmt: skip
    seed = pdmctl("sweep", "seed=0,1,2", "k=10,20", "--order", "seed", "--dry-run", cwd=workdir)
    assert "order: seed: runs 1-2 are replicate 0" in seed.stdout, seed.stderr
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
    assert bad.returncode == 2 and bad.stderr.strip() == "error: --order: unknown order 'random'; choose from answers, seed, setting"
    (workdir / "s.yaml").write_text("name: s\norder: arm\ngrid: {k: [10, 20]}\n")
    from_file = pdmctl("sweep", "--file", str(workdir / "s.yaml"), "--dry-run", cwd=workdir)
    lines = from_file.stderr.strip().splitlines()
    assert from_file.returncode == 2 and len(lines) == 1 and "order: unknown order 'arm'" in lines[0], from_file.stderr


def _h20_of_four_nodes(tmp_path: Path) -> Path:
    """The shipped h20 profile on a partition of 4 nodes: one 4-node run at a time."""
    text = (Path(__file__).resolve().parents[1] / "clusters" / "h20.yaml").read_text()
    path = tmp_path / "h20-4.yaml"
    path.write_text(text.replace("max_concurrent: 4 ", "max_concurrent: 1 "))
    return path


def _first_answer_days(stdout: str) -> dict[str, tuple[float, float, float]]:
    lines = stdout.split("first complete comparison per setting", 1)[1].splitlines()[1:]
    out = {}
    for line in lines:
        m = re.match(r"^  verl: (.+): day ([\d.]+) \(([\d.]+)-([\d.]+)\)$", line)
        if not m:
            break
        out[m[1]] = (float(m[2]), float(m[3]), float(m[4]))
    return out


def test_paper_main_on_four_nodes_has_its_4b_comparison_in_the_first_three_days(workdir: Path) -> None:
    """On a 4-node partition, the default order runs the four 4B arms first, and the dry run says each
    setting's first complete comparison day: 4B within 3 days, every setting's in the order the array has
    them; seed-major order (settings taking turns) brings no comparison before the 30B runs of replicate 0."""
    profile = _h20_of_four_nodes(workdir)
    plan = pdmctl("sweep", "--file", "paper-main", "--cluster", str(profile), "--dry-run", cwd=workdir)
    assert plan.returncode == 0, plan.stderr
    days = _first_answer_days(plan.stdout)
    assert list(days) == ["qwen3-4b-base bf16 on megatron", "qwen3-8b-base bf16 on megatron",
                          "qwen3-30b-a3b-base fp8_e2e on megatron", "qwen3-30b-a3b-base fp8_rollout on megatron"]  # fmt: skip
    assert days["qwen3-4b-base bf16 on megatron"][0] <= 3.0
    for expected, low, high in days.values():
        assert low <= expected <= high
    rows = re.findall(r"^│ (\d+) +│ \w+ +│ (.+?) +│", plan.stdout, flags=re.M)
    assert [cfg.rsplit(" ", 2)[1] for _, cfg in rows[:4]] == ["qwen3-4b-base"] * 4
    seed = pdmctl("sweep", "--file", "paper-main", "--cluster", str(profile), "--dry-run", "--order", "seed", cwd=workdir)
    seed_days = _first_answer_days(seed.stdout)
    assert seed_days["qwen3-4b-base bf16 on megatron"][0] > 5 * days["qwen3-4b-base bf16 on megatron"][0]
    assert list(workdir.iterdir()) == [profile]  # a dry run writes nothing


def test_answers_order_ranks_settings_by_cost_then_by_the_sweep_files_priority() -> None:
    """Inside a replicate, the cheaper setting's arms all come first; a priority naming the dearer setting
    puts it first; replicates still come one after the other."""
    from pdmctl.order import order_runs
    from pdmctl.spec import SpecError

    specs = expand(["precision=bf16,fp8_rollout", "k=10,20", "seed=0,1"], None, "s")
    dear = {s.key: (100.0 if s.config["precision"]["name"] == "bf16" else 10.0) for s in specs}
    ordered = order_runs(specs, "answers", dear)
    assert [(s.seed, s.config["precision"]["name"]) for s in ordered] == [
        (0, "fp8_rollout"), (0, "fp8_rollout"), (0, "bf16"), (0, "bf16"),
        (1, "fp8_rollout"), (1, "fp8_rollout"), (1, "bf16"), (1, "bf16")]  # fmt: skip
    first = order_runs(specs, "answers", dear, ("precision=bf16",))
    assert [s.config["precision"]["name"] for s in first[:2]] == ["bf16", "bf16"]
    assert order_runs(specs, "answers", {}) == order_runs(specs, "answers", None)  # no costs: grid order of settings
    with pytest.raises(SpecError, match=r"^priority: no run of the sweep has model=nosuch"):
        order_runs(specs, "answers", dear, ("model=nosuch",))


@pytest.mark.parametrize("priority, message", [
    ("[model]", "'model' is not key=value"),
    ("[]", "a list of key=value items"),
    ("[model=nosuch]", "priority: no run of the sweep has model=nosuch"),
])  # fmt: skip
def test_a_bad_priority_is_one_line_and_exit_2_and_nothing_written(workdir: Path, priority: str, message: str) -> None:
    (workdir / "s.yaml").write_text(f"name: s\npriority: {priority}\ngrid: {{k: [10, 20]}}\n")
    for extra in (["--dry-run"], []):
        result = pdmctl("sweep", "--file", str(workdir / "s.yaml"), *extra, cwd=workdir)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and message in lines[0], result.stderr
    assert sorted(p.name for p in workdir.iterdir()) == ["s.yaml"]
