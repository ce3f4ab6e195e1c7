"""The report's HTML page in a real browser: Debian's headless Chromium opens it, takes a screenshot and
dumps the DOM after a load handler has counted the images that decoded and measured every table."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from pdmctl.report.build import build_report
from pdmctl.report.definition import load_definition
from pdmctl.report.write import write_report

sys.path.insert(0, str(Path(__file__).parent))  # the synthetic-sweep helpers beside this file
from test_report_synthetic import finish, make_sweep, write_points

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.chromium, pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium")]

# appended to a copy of the page: the product page itself carries no test hooks
COUNT_IMAGES = """<script>
window.addEventListener("load", () => {
  const images = [...document.images];
  document.body.dataset.images = images.length;
  document.body.dataset.loaded = images.filter(i => i.complete && i.naturalWidth > 0).length;
});
</script>"""


def chromium(profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--hide-scrollbars"]  # fmt: skip
    assert CHROMIUM is not None
    return subprocess.run([CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=120, check=True)


def test_html_page_opens_in_chromium_with_its_table_and_every_image(tmp_path: Path) -> None:
    sweep = make_sweep(f"sqlite:///{tmp_path / 'mlflow.db'}", "html", ["mask=pdm_agg,dppo_topk_kl", "seed=0,1,2"])
    points = []
    for rid, spec in sweep.specs.items():
        lift = 0.04 * (spec.config["mask"]["name"] == "pdm_agg") + 0.01 * spec.seed
        for step in (0, 5, 10):
            points += [(rid, "eval/toy24", step, 0.2 + lift + step / 50), (rid, "eval/toy25", step, 0.18 + step / 60),
                       (rid, "train/reward", step, 0.3), (rid, "train/response_length", step, 3.0 + step / 10),
                       (rid, "train/ppo_kl", step, 0.01), (rid, "train/mask_frac", step, 0.02)]  # fmt: skip
    write_points(sweep.ledger, points)
    finish(sweep.ledger, list(sweep.specs))
    out = tmp_path / "report"
    write_report(build_report(sweep.ledger, ["html"], load_definition("default")), out)
    page = out / "index.html"
    assert "src=\"data:image/png;base64," in page.read_text() and "http" not in page.read_text().split("<body>")[1]

    shot = tmp_path / "screenshot.png"
    chromium(tmp_path / "profile", "--window-size=1280,2400", f"--screenshot={shot}", page.as_uri())
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000

    probe = out / "probe.html"
    probe.write_text(page.read_text().replace("</body>", COUNT_IMAGES + "</body>"))
    dom = chromium(tmp_path / "profile", "--virtual-time-budget=10000", "--dump-dom", probe.as_uri()).stdout
    body = re.search(r"<body([^>]*)>", dom)
    assert body is not None, dom[:500]
    images = re.search(r'data-images="(\d+)"', body.group(1))
    loaded = re.search(r'data-loaded="(\d+)"', body.group(1))
    assert images and loaded, body.group(0)
    assert int(images.group(1)) == 2  # the setting's learning curves and its training dynamics
    assert loaded.group(1) == images.group(1)  # every image decoded (naturalWidth > 0)
    results = re.search(r'<table id="results">(.*?)</table>', dom, re.S)
    assert results is not None
    assert results.group(1).count("<tr>") == 4  # two header rows (the set, then mean/low/high) and one per mask
    assert "pdm_agg" in results.group(1) and "toy24" in results.group(1)  # the set the runs logged, by its name
    assert '<table id="comparison">' in dom and "AIME" not in dom


# appended to a copy of the page: where each table ends and how wide the page is, as Chromium lays them out
MEASURE_TABLES = """<script>
window.addEventListener("load", () => {
  const tables = [...document.querySelectorAll("table")];
  document.body.dataset.tables = tables.map(t => t.id + ":" + Math.ceil(t.getBoundingClientRect().right)).join(" ");
  document.body.dataset.page = document.documentElement.scrollWidth;
});
</script>"""


class Tables(HTMLParser):
    """Every table of a page as rows of (tag, text) cells."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[tuple[str, str]]]] = {}
        self._table: list[list[tuple[str, str]]] | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table":
            self._table = self.tables.setdefault(dict(attrs).get("id") or str(len(self.tables)), [])
        elif tag == "tr" and self._table is not None:
            self._table.append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None and self._table is not None:
            self._table[-1].append((tag, "".join(self._cell).strip()))
            self._cell = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def interval_ends(rows: list[list[tuple[str, str]]]) -> list[float]:
    """The numbers under every `low` and `high` header of a table (its last header row names them)."""
    header = [text for tag, text in [r for r in rows if r and r[0][0] == "th"][-1]]
    columns = [i for i, name in enumerate(header) if name in ("low", "high")]
    body = [r for r in rows if r and r[0][0] == "td"]
    return [float(r[i][1]) for r in body for i in columns if i < len(r) and r[i][1] not in ("", "n/a")]


def test_every_table_fits_a_1400_pixel_page_and_no_interval_leaves_0_to_100(tmp_path: Path) -> None:
    """Three seeds near 100% (and a baseline near 0%) give t intervals past [0, 100]: the page shows them
    clipped there, in the tables and the bands alike, and Chromium lays every table out within a
    1400-pixel window; a panel whose every value is the same is left out and said so once."""
    sweep = make_sweep(f"sqlite:///{tmp_path / 'mlflow.db'}", "wide",
                       ["mask=pdm_agg,pdm_uni,dppo_topk_kl", "delta=0.05,0.15", "k=10,20", "seed=0,1,2"])  # fmt: skip
    points = []
    for rid, spec in sweep.specs.items():
        mask = spec.config["mask"]["name"]
        high = {0: 0.90, 1: 0.99, 2: 1.0}[spec.seed]  # mean 96.3, s = 5.5: a 95% t interval reaches 110
        low = {0: 0.0, 1: 0.01, 2: 0.06}[spec.seed]  # mean 2.3, the interval reaches below 0
        for step in (0, 5, 10):
            top = high if mask != "dppo_topk_kl" else low
            points += [(rid, "eval/toy24", step, top * step / 10), (rid, "eval/toy25", step, low * step / 10),
                       (rid, "train/reward", step, 0.3 + 0.01 * spec.seed), (rid, "train/response_length", step, 3.0),
                       (rid, "train/ppo_kl", step, 0.001 * spec.seed), (rid, "train/mask_frac", step, 0.02)]  # fmt: skip
    write_points(sweep.ledger, points)
    finish(sweep.ledger, list(sweep.specs))
    report = build_report(sweep.ledger, ["wide"], load_definition("default"))
    assert report.clipped > 0  # the t intervals did reach past the range
    for curves in report.curves:
        for lines in curves.eval_panels.values():
            for line in lines:
                assert line.low.min() >= 0 and line.high.max() <= 1
    assert set(report.constant_panels) == {"response length", "mask fraction"}
    out = tmp_path / "report"
    write_report(report, out)
    page = (out / "index.html").read_text()
    assert page.count('<h2 id="methods">Methods</h2>') == 1 and page.count("t the 0.975 quantile") == 1
    assert "AIME" not in page and str(tmp_path) not in page  # the sets by their names; the store by its name
    assert "response length (3 throughout)" in page

    probe = out / "probe.html"
    probe.write_text(page.replace("</body>", MEASURE_TABLES + "</body>"))
    dom = chromium(tmp_path / "profile", "--window-size=1400,3000", "--virtual-time-budget=10000", "--dump-dom",
                   probe.as_uri()).stdout  # fmt: skip
    body = re.search(r"<body([^>]*)>", dom)
    assert body is not None, dom[:500]
    measured = re.search(r'data-tables="([^"]*)"', body.group(1))
    width = re.search(r'data-page="(\d+)"', body.group(1))
    assert measured and width, body.group(0)
    rights = dict(item.split(":") for item in measured.group(1).split())
    assert {"results", "comparison", "power", "provenance"} <= set(rights)
    assert all(int(right) <= 1400 for right in rights.values()), rights
    assert int(width.group(1)) <= 1400

    parsed = Tables()
    parsed.feed(dom)
    results = interval_ends(parsed.tables["results"])
    differences = interval_ends(parsed.tables["comparison"])
    assert len(results) == 12 * 3 * 2 and len(differences) == 8 * 3 * 2  # rows × sets × (low, high)
    assert min(results) >= 0 and max(results) <= 100 and max(results) == 100 and min(results) == 0
    assert min(differences) >= -100 and max(differences) <= 100


def test_the_study_page_shares_the_report_pages_header_and_stylesheet(tmp_path: Path) -> None:
    """`pdmctl report --tune` draws from the same templates: one stylesheet, and a header naming pdmctl's
    version and commit and the store by its name (never this machine's directories)."""
    from pdmctl import __version__
    from pdmctl.report.page import code_commit
    from pdmctl.tune.page import render
    from pdmctl.tune.study import StudyView, TrialView

    trials = [TrialView(0, "complete", 0.41, {"delta": 0.1}, ("k0",), None),
              TrialView(1, "pruned", None, {"delta": 0.2}, ("k1",), None)]  # fmt: skip
    study = render(StudyView("toy", None, "maximize", trials, trials[0]), [], f"sqlite:///{tmp_path}/optuna.db")
    sweep = make_sweep(f"sqlite:///{tmp_path / 'mlflow.db'}", "one", ["mask=pdm_agg", "seed=0"])
    write_points(sweep.ledger, [(rid, "eval/toy24", 1, 0.5) for rid in sweep.specs] +
                 [(rid, "eval/toy25", 1, 0.5) for rid in sweep.specs])  # fmt: skip
    finish(sweep.ledger, list(sweep.specs))
    write_report(build_report(sweep.ledger, ["one"], load_definition("default")), tmp_path / "report")
    report = (tmp_path / "report" / "index.html").read_text()
    style = re.compile(r"<style>.*?</style>", re.S)
    assert style.search(study).group(0) == style.search(report).group(0)  # type: ignore[union-attr]
    for page, store in ((study, "optuna.db (sqlite)"), (report, "mlflow.db (sqlite)")):
        assert f"{__version__}" in page and code_commit() in page and store in page and str(tmp_path) not in page
    assert study.count("<tr><td class='num'>") == 2 and "pruned" in study and "<code>k0</code>" in study


# appended to a copy of the page, which opens in a frame of the width under test (Chromium's own window is
# at least 500 pixels wide); it posts what it measured to the frame's host, whose DOM Chromium dumps
MEASURE_FIT = r"""<script>
window.addEventListener("load", () => {
  const width = window.innerWidth;
  const scroller = e => {
    for (let a = e.parentElement; a; a = a.parentElement) {
      if (["auto", "scroll"].includes(getComputedStyle(a).overflowX)) return a;
    }
    return null;
  };
  const lines = range => new Set([...range.getClientRects()].filter(r => r.width > 0).map(r => Math.round(r.bottom))).size;
  const split = [];
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let node; (node = walker.nextNode()); ) {
    if (node.parentElement.closest("script")) continue;
    // a word: letters, digits and _, a number with its sign and decimals
    for (const m of node.data.matchAll(/(?:[+\u2212-](?=\p{N}))?[\p{L}\p{N}_]+(?:[.,]\p{N}+)*/gu)) {
      const range = document.createRange();
      range.setStart(node, m.index);
      range.setEnd(node, m.index + m[0].length);
      if (lines(range) > 1) split.push(m[0]);
    }
  }
  for (const cell of document.querySelectorAll("td.num, td.key")) {
    const range = document.createRange();
    range.selectNodeContents(cell);
    if (cell.textContent.trim() && lines(range) > 1) split.push(cell.textContent);
  }
  const elements = [...document.body.querySelectorAll("*")].filter(e => e.tagName !== "SCRIPT");
  parent.postMessage(JSON.stringify({
    width, page: document.documentElement.scrollWidth, split,
    wide: elements.filter(e => e.getBoundingClientRect().right > width + 0.5 && !scroller(e)).map(e => e.outerHTML.slice(0, 80)),
    cells: [...document.querySelectorAll("td, th")].filter(c => c.scrollWidth > c.clientWidth).map(c => c.textContent),
    captions: [...document.querySelectorAll("caption")].filter(c => c.getBoundingClientRect().right > width + 0.5).map(c => c.textContent),
    tables: [...document.querySelectorAll("table")].map(t => t.id),
    scrolling: [...document.querySelectorAll("table")].filter(t => scroller(t) && scroller(t).scrollWidth > scroller(t).clientWidth).map(t => t.id),
  }), "*");
});
</script>"""


def measure_at(width: int, page: Path, profile: Path) -> dict:
    """What MEASURE_FIT finds on `page` laid out `width` CSS pixels wide."""
    import html
    import json

    probe = page.with_name(f"probe{width}.html")
    probe.write_text(page.read_text().replace("</body>", MEASURE_FIT + "</body>"))
    host = page.with_name(f"host{width}.html")
    host.write_text(f'<!DOCTYPE html><html><body style="margin:0"><iframe src="{probe.name}" width="{width}" '
                    'height="2000" style="border:0"></iframe><script>addEventListener("message", e => {'
                    'const p = document.createElement("pre"); p.id = "measured"; p.textContent = e.data; '
                    "document.body.append(p); });</script></body></html>")  # fmt: skip
    dom = chromium(profile, f"--window-size={width + 100},2100", "--virtual-time-budget=10000", "--dump-dom",
                   host.as_uri()).stdout  # fmt: skip
    found = re.search(r'<pre id="measured">(.*?)</pre>', dom, re.S)
    assert found is not None, dom[-2000:]
    return json.loads(html.unescape(found.group(1)))


def test_the_page_reads_at_1400_and_390_pixels_no_word_split_nothing_wider(tmp_path: Path) -> None:
    """Laid out by Chromium 1400 and 390 CSS pixels wide: no word or number is broken across lines, no table
    cell's text spills out of it, no caption runs past the window, and nothing is wider than the window but
    inside a box that scrolls sideways; at 390 pixels the wide tables scroll in theirs, at 1400 none needs to."""
    sweep = make_sweep(f"sqlite:///{tmp_path / 'mlflow.db'}", "narrow",
                       ["mask=pdm_agg,pdm_uni,dppo_topk_kl", "delta=0.05,0.15", "k=10,20", "seed=0,1"])  # fmt: skip
    points = []
    for rid, spec in sweep.specs.items():
        lift = 0.04 * (spec.config["mask"]["name"] != "dppo_topk_kl") + 0.1 * spec.config["delta"]
        for step in (0, 5, 10):
            points += [(rid, "eval/toy24", step, (0.3 + lift + 0.02 * spec.seed) * step / 10),
                       (rid, "eval/toy25", step, (0.2 + lift - 0.01 * spec.seed) * step / 10),
                       (rid, "train/reward", step, 0.3 + 0.01 * spec.seed + step / 20)]  # fmt: skip
    write_points(sweep.ledger, points)
    failed = sweep.run_id("pdm_uni", 1, delta=0.15, k=20)  # a row of one seed (n/a) and a run left out
    finish(sweep.ledger, [rid for rid in sweep.specs if rid != failed])
    finish(sweep.ledger, [failed], "FAILED", "CUDA out of memory while allocating the rollout buffer: absent")
    out = tmp_path / "report"
    write_report(build_report(sweep.ledger, ["narrow"], load_definition("default")), out)
    page = out / "index.html"
    assert "overflow-wrap:anywhere" not in page.read_text()

    for width in (1400, 390):
        m = measure_at(width, page, tmp_path / "profile")
        assert m["width"] == width and m["page"] <= width, m
        assert {"results", "comparison", "power", "provenance", "excluded"} <= set(m["tables"])
        assert m["split"] == [] and m["cells"] == [] and m["captions"] == [], m
        assert m["wide"] == [], m["wide"]
        if width == 390:
            assert {"results", "comparison", "power"} <= set(m["scrolling"]), m["scrolling"]
        else:
            assert m["scrolling"] == [], m["scrolling"]
