"""A design that fits (`sweep --dry-run --days N / --budget H`): the largest part of the grid whose expected
figure fits the limit, costed as the dry run costs the sweep; the grid itself is never changed."""

from __future__ import annotations

import re
from pathlib import Path

from pdmctl.budget.cost import Estimate, Span
from pdmctl.budget.design import candidates, propose
from pdmctl.grid import expand
from tests.conftest import pdmctl


def _estimates(specs, hours_of: dict[str, float]) -> dict[str, Estimate]:
    """Each run of precision P takes hours_of[P] hours on one device (range ±50%)."""
    out = {}
    for s in specs:
        h = hours_of[s.config["precision"]["name"]] * 3600
        out[s.key] = Estimate("GPU", 1, Span(h, h / 2, h * 1.5), h * 2, 1, "stated")
    return out


def test_the_proposal_keeps_the_cheapest_settings_and_at_least_three_seeds_where_that_fits() -> None:
    """Two settings of 1 h and 10 h runs, 2 arms, 4 seeds, one run at a time: 88 h in all. 40 h keeps the
    cheap setting's 4 seeds first and adds no dear run (30 of its hours would not fit beside it: 3 seeds of
    both take 66 h); 70 h fits both settings at 3 seeds; 5 h fits nothing but 2 seeds of the cheap one
    (4 h), and 3 h fits nothing."""
    specs = expand(["precision=bf16,fp8_rollout", "k=10,20", "seed=0,1,2,3"], None, "s")
    estimates = _estimates(specs, {"fp8_rollout": 1.0, "bf16": 10.0})
    designs = candidates(specs, estimates, 1, {s.key: 1 for s in specs}, 1)
    whole = designs[0]
    assert whole.seeds == 4 and whole.runs == 16 and abs(whole.hours.expected - 88) < 1e-9
    assert abs(whole.days.expected * 24 - 88) < 1e-9  # one at a time: the hours are the wall time
    cheap = propose(designs, days=40 / 24)
    assert cheap is not None and (len(cheap.settings), cheap.seeds, cheap.runs) == (1, 4, 8)
    assert "fp8_rollout" in cheap.settings[0]
    both = propose(designs, hours=70)
    assert both is not None and (len(both.settings), both.seeds) == (2, 3)
    two = propose(designs, hours=5)
    assert two is not None and (len(two.settings), two.seeds) == (1, 2)
    assert propose(designs, hours=3) is None


def _h20_of_four_nodes(tmp_path: Path) -> Path:
    text = (Path(__file__).resolve().parents[1] / "clusters" / "h20.yaml").read_text()
    path = tmp_path / "h20-4.yaml"
    path.write_text(text.replace("max_concurrent: 4 ", "max_concurrent: 1 "))
    return path


def test_paper_main_on_four_nodes_for_30_days_proposes_what_fits_and_names_what_it_cannot(workdir: Path) -> None:
    """`--days 30` on a 4-node partition: the grid as given (about 80 days) does not fit; the proposal fits
    30 days, keeps at least 3 seeds an arm, says the smallest difference each kept setting resolves, and
    names every setting it leaves out; the grid's own plan above it is unchanged and nothing is written."""
    profile = _h20_of_four_nodes(workdir)
    plain = pdmctl("sweep", "--file", "paper-main", "--cluster", str(profile), "--dry-run", cwd=workdir)
    result = pdmctl("sweep", "--file", "paper-main", "--cluster", str(profile), "--dry-run", "--days", "30",
                    cwd=workdir)  # fmt: skip
    assert result.returncode == 0, result.stderr
    plan, design = result.stdout.split("design for 30 days: ", 1)
    assert plan == plain.stdout
    grid_days = float(re.search(r"^the grid as given is 48 run\(s\), .*?, ([\d.]+) days of wall", design)[1])
    assert grid_days > 30
    proposed = re.search(r"proposed .*?: (\d+) seed\(s\) an arm, (\d+) of 4 setting\(s\), (\d+) run\(s\), .*?"
                         r"([\d.]+) days of wall time expected", design)  # fmt: skip
    seeds, kept, runs, days = int(proposed[1]), int(proposed[2]), int(proposed[3]), float(proposed[4])
    assert seeds >= 3 and 1 <= kept < 4 and runs == seeds * 4 * kept and days <= 30
    assert design.count("  resolves: ") == kept and design.count("  cannot resolve: ") == 4 - kept
    assert "qwen3-4b-base bf16" in design.split("  resolves: ", 1)[1]  # the cheapest setting is kept
    assert sorted(p.name for p in workdir.iterdir()) == ["h20-4.yaml"]


def test_a_bad_limit_is_one_line_and_exit_2(workdir: Path) -> None:
    for args in (["--days", "30"], ["--dry-run", "--days", "0"], ["--dry-run", "--budget", "inf"],
                 ["--dry-run", "--json", "--days", "3"]):  # fmt: skip
        result = pdmctl("sweep", "backend=synthetic", *args, cwd=workdir)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (args, result.stderr)
    assert list(workdir.iterdir()) == []


def test_a_grid_of_one_seed_an_arm_gets_no_design_and_says_why(workdir: Path) -> None:
    """`--days` on a grid of one seed an arm: the plan as always, then one line saying no design is proposed and
    why (a design compares each arm on 2 seeds or more); exit 0, nothing written."""
    result = pdmctl("sweep", "delta=0.05", "--dry-run", "--days", "3", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip().endswith("design for 3.00 days: not proposed: the grid has one seed an arm, and "
                                           "a design compares each arm on 2 or more (seeds=2)")
    assert list(workdir.iterdir()) == []
