"""The report where its readers read it: the terminal's tables at the terminal's width, the LaTeX table a
paper takes, and the figures as SVG beside PNG; each from a real report of a small sweep in a real SQLite
MLflow store."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from rich.cells import cell_len

from pdmctl.report import plots
from pdmctl.report.build import build_report
from pdmctl.report.definition import load_definition
from pdmctl.report.tables import TextTable, results_table
from pdmctl.report.write import write_report

sys.path.insert(0, str(Path(__file__).parent))  # the synthetic-sweep helpers beside this file
from test_report_synthetic import SyntheticSweep, finish, make_sweep, write_points

SWEEP = "fit"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> SyntheticSweep:
    """Two masks × two δ × two K × two seeds: a results table of 4 key and 10 value columns."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlflow.db'}"
    made = make_sweep(uri, SWEEP, ["mask=pdm_agg,dppo_topk_kl", "delta=0.05,0.15", "k=10,20", "seed=0,1"])
    points = []
    for rid, spec in made.specs.items():
        config = spec.config
        lift = 0.05 * (config["mask"]["name"] == "pdm_agg") + 0.3 * config["delta"] + 0.001 * config["k"]
        for step in (0, 5, 10):
            ramp = step / 10
            points += [(rid, "eval/toy24", step, ramp * (0.3 + lift + 0.02 * spec.seed)),
                       (rid, "eval/toy25", step, ramp * (0.2 + lift - 0.01 * spec.seed)),
                       (rid, "train/reward", step, 0.3 + 0.01 * spec.seed + ramp),
                       (rid, "train/ppo_kl", step, 0.001 * (1 + spec.seed) * ramp)]  # fmt: skip
    write_points(made.ledger, points)
    finish(made.ledger, list(made.specs))
    return made


def drawn_tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every table rich drew in `text` (its heavy-head box): the header cells and the rows, each cell's
    wrapped lines joined back with a space; a line whose second cell is empty continues the row above."""
    out: list[tuple[list[str], list[list[str]]]] = []
    part = None
    for line in text.splitlines():
        if line.startswith("┏"):
            out.append(([], []))
            part = "head"
        elif line.startswith("┡"):
            part = "body"
        elif line.startswith("└"):
            part = None
        elif part is not None and line.startswith("┃│"[part == "body"]):
            cells = [c.strip() for c in line.rstrip()[1:-1].split("┃│"[part == "body"])]
            head, rows = out[-1]
            if part == "head":
                head[:] = [f"{a} {b}".strip() for a, b in zip(head, cells, strict=True)] if head else cells
            elif cells[1] or not rows:
                rows.append(cells)
            else:
                rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cells, strict=True)]
    return out


def report_at(width: int, tracking_uri: str, out: Path) -> str:
    """`pdmctl report` piped, as a terminal of `width` columns sets $COLUMNS."""
    env = {**os.environ, "COLUMNS": str(width), "PYTHONIOENCODING": "utf-8"}
    env.pop("MLFLOW_TRACKING_URI", None)
    done = subprocess.run([sys.executable, "-m", "pdmctl.entry", "report", SWEEP, "--tracking-uri", tracking_uri,
                           "--out", str(out), "--panels", "none"], capture_output=True, text=True, env=env,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.parametrize("width", [100, 120])
def test_every_column_of_the_results_table_is_shown_whole_at_the_terminals_width(
    sweep: SyntheticSweep, tmp_path: Path, width: int
) -> None:
    """Piped with $COLUMNS set, no line is wider than the terminal, and the results table, too wide for it,
    is split into stacked tables that each repeat the row's key columns: every column's header and every
    cell of every row read back in order, none cropped; the note under it is there word for word."""
    table: TextTable = results_table(build_report(sweep.ledger, [SWEEP], load_definition("default")))
    text = report_at(width, sweep.ledger.uri, tmp_path / "out")
    assert max(cell_len(line) for line in text.splitlines()) <= width
    parts = [p for p in drawn_tables(text) if p[0][: table.keys] == list(table.flat_headers()[: table.keys])
             and p[0][table.keys :] and set(p[0][table.keys :]) <= set(table.flat_headers())]  # fmt: skip
    assert len(parts) >= 2 if width == 100 else parts  # 14 columns do not fit 100: split, not cropped
    assert [h for head, _ in parts for h in head[table.keys :]] == list(table.flat_headers()[table.keys :])
    for head, rows in parts:
        assert len(rows) == len(table.rows)
        for drawn, row in zip(rows, table.rows, strict=True):
            assert drawn[: table.keys] == list(row[: table.keys])  # the row's key, repeated in every part
        first = table.flat_headers().index(head[table.keys])
        values = [list(row[first : first + len(head) - table.keys]) for row in table.rows]
        assert [drawn[table.keys :] for drawn in rows] == values
    words = " ".join(text.split())  # rich wraps the titles and the note at the width
    assert " ".join(table.note.split()) in words  # the caption, whole
    assert words.count(f"{table.title} (continued from above)") == len(parts) - 1


def test_the_latex_table_has_booktabs_rules_and_one_interval_column_per_set(
    sweep: SyntheticSweep, tmp_path: Path
) -> None:
    """results.tex: booktabs rules, and per held-out set one column `value [low, high]` headed by the set,
    the metric and the interval's level, where the other renderings give the mean, low and high apart."""
    report = build_report(sweep.ledger, [SWEEP], load_definition("default"))
    table = results_table(report)
    write_report(report, tmp_path / "out")
    tex = (tmp_path / "out" / "results.tex").read_text()
    body = tex.split(r"\label{tab:results}")[1].split(r"\end{tabular}")[0]
    spec = re.search(r"\\begin\{tabular\}\{(\w+)\}", body)
    assert spec is not None and spec.group(1) == "l" * table.keys + "r" * 4  # 3 sets and n, not 10 columns
    lines = [line.removesuffix(r" \\") for line in body.splitlines()]
    assert [line for line in lines if line.startswith("\\") and "rule" in line] == [r"\toprule", r"\midrule",
                                                                                    r"\bottomrule"]  # fmt: skip
    head = lines[lines.index(r"\toprule") + 1].split(" & ")
    assert head[table.keys :] == [r"toy24 avg@16 [95\% CI]", r"toy25 avg@16 [95\% CI]",
                                  r"Average avg@16 [95\% CI]", "n"]  # fmt: skip
    rows = [line.split(" & ") for line in lines[lines.index(r"\midrule") + 1 : lines.index(r"\bottomrule")]]
    assert len(rows) == len(table.rows) == 8
    for drawn, row in zip(rows, table.rows, strict=True):
        ends = [f"{row[i]} [{row[i + 1]}, {row[i + 2]}]" for i in range(table.keys, table.keys + 9, 3)]
        assert drawn[table.keys :] == [*ends, row[-1]]
    assert r"$\Delta$ (pp) [95\% CI]" in tex  # the comparisons: a difference and its interval, one column


def test_every_figure_is_written_as_svg_beside_its_png_and_linked_from_the_page(
    sweep: SyntheticSweep, tmp_path: Path
) -> None:
    """Each figure of the report: a PNG and an SVG of the same name under figures/, the SVG a vector drawing
    (the same bytes when drawn again), both linked from the page's caption and the Markdown."""
    report = build_report(sweep.ledger, [SWEEP], load_definition("default"))
    out = tmp_path / "out"
    write_report(report, out)
    pngs = sorted(p.stem for p in (out / "figures").glob("*.png"))
    assert pngs == ["curves_toy-small_bf16", "dynamics_toy-small_bf16"]
    assert sorted(p.stem for p in (out / "figures").glob("*.svg")) == pngs
    page, markdown = (out / "index.html").read_text(), (out / "results.md").read_text()
    for stem in pngs:
        svg = (out / "figures" / f"{stem}.svg").read_bytes()
        root = ET.fromstring(svg)
        assert root.tag == "{http://www.w3.org/2000/svg}svg" and root.iter("{http://www.w3.org/2000/svg}path")
        assert len(list(root.iter("{http://www.w3.org/2000/svg}path"))) > 10  # lines, bands and axes as paths
        assert f'<a href="figures/{stem}.png">PNG</a> · <a href="figures/{stem}.svg">SVG</a>' in page
        assert f"[SVG](figures/{stem}.svg)" in markdown
    again = plots.curve_figure(report.curves[0], "95% t band", report.names)
    assert again[1] == plots.curve_figure(report.curves[0], "95% t band", report.names)[1]
    assert again[0][:8] == b"\x89PNG\r\n\x1a\n"
