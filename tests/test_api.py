"""pdmctl.api: a notebook's sweep, status, wait and report go through the command line's code, and bad input is
an exception with the command's one line, never an exit."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdmctl import api

SYN = ["backend=synthetic", "model=synthetic", "backend.steps=2"]


def test_a_sweep_from_python_runs_waits_and_reports(workdir: Path) -> None:
    """sweep(wait=True) returns once every run has ended; status gives one dict per run; report writes the
    page and returns the tables' data, the comparison against the baseline included."""
    s = api.sweep([*SYN, "mask=pdm_agg,dppo_topk_kl", "seed=0"], name="nb", wait=True, timeout=300, poll=0.5)
    assert (s.name, len(s.keys), len(s.job_ids), s.cluster) == ("nb", 2, 2, "local")
    rows = api.status(s)
    assert [row["state"] for row in rows] == ["finished"] * 2
    assert {row["key"] for row in rows} == set(s.keys)
    assert all(row["step"] == 2 and row["avg16"] is not None and row["config"]["seed"] == 0 for row in rows)
    again = api.sweep([*SYN, "mask=pdm_agg,dppo_topk_kl", "seed=0"], name="nb")  # served: nothing submitted
    assert again.keys == s.keys and again.job_ids == ()
    assert api.wait("nb", timeout=60) == api.status("nb")

    r = api.report([s], baseline="dppo_topk_kl", panels="none")
    assert r.out_dir == Path("reports/nb") and r.files[-1].name == "index.html" and all(f.exists() for f in r.files)
    assert [c.row.mask for c in r.data.comparisons] == ["pdm_agg"] and r.data.cost  # hours spent, as the command


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: api.sweep(["delta=-1", *SYN]), r"^delta: must be a number > 0, got -1$"),
        (lambda: api.sweep(["mask=nope", *SYN]), r"^mask: unknown option 'nope'"),
        (lambda: api.sweep("delta=0.1"), r"^overrides: a list of strings"),
        (lambda: api.sweep(SYN, file="no-such-sweep-file"), r"^sweep file: 'no-such-sweep-file' not found"),
        (lambda: api.status("nope"), r"^sweep 'nope': no runs in sqlite:///"),
        (lambda: api.report(["nope"]), r"^no ledger at sqlite:///"),
        (lambda: api.report(["nb"], definition="no-such-definition"), r"no-such-definition"),
    ],
)
def test_bad_input_raises_bad_input_with_one_line(workdir: Path, call, message: str) -> None:
    with pytest.raises(api.BadInput, match=message) as caught:
        call()
    assert "\n" not in str(caught.value)
    assert not (workdir / "mlflow.db").exists()  # refused before anything was written
