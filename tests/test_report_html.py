"""The report's HTML page in a real browser: Debian's headless Chromium opens it, takes a screenshot and
dumps the DOM after a load handler has counted the images that decoded."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
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
    assert results.group(1).count("<tr>") == 3  # the header and one row per mask
    assert "pdm_agg" in results.group(1) and "AIME24" in results.group(1)
    assert '<table id="comparison">' in dom
