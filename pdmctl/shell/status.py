"""`pdmctl status`'s output: the table of runs (rich, or aligned plain rows where rich would be slow), what it
prints under the table, and the same runs as one JSON document (`--json`, docs/JSON.md)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from rich.table import Table
from rich.text import Text

STATE_STYLE = {
    "finished": "green", "running": "cyan", "queued": "blue", "not started": "dim", "new": "dim",
    "failed": "red", "lost": "red", "cancelled": "yellow", "timeout": "magenta", "preempted": "magenta",
    "pruned": "yellow", "stopped": "yellow",
}  # fmt: skip
STATUS_COLUMNS = (("sweep", "left"), ("key", "left"), ("config", "left"), ("state", "left"), ("step", "right"),
                  ("avg@16 %", "right"), ("attempts", "right"), ("job", "left"))  # fmt: skip
RICH_TABLE_MAX_ROWS = 200  # rich lays out every cell; beyond this, aligned plain rows render 10x faster


def note(view) -> str | None:
    """Why a run stands where it does (its failure, its stop, a notice), as the table shows it after its state."""
    from pdmctl.orchestrate import ACTIVE

    r = view.record
    text = (r.reason if view.state != "finished" else None) or r.notice if r else None
    # a failed attempt whose job lives on (orchestrate.run_state)
    if r is not None and r.status == "FAILED" and view.state in ACTIVE:
        text = f"its job lives on; attempt {r.attempt} failed: {r.reason or 'no reason given'}"
    return text


def status_rows(views) -> list[tuple[list[str], str]]:
    rows = []
    for v in sorted(views, key=lambda v: (v.sweep, v.summary)):
        r = v.record
        state = str(v.state)
        why = note(v)
        if why:
            state += f" ({why[:100]})"
        step, avg = (r.step, r.avg16) if r else (None, None)
        cells = [v.sweep, v.key, v.summary, state, "" if step is None else str(step),
                 "" if avg is None else f"{100 * avg:.1f}", str(r.attempt if r else 0), (r.job_id or "") if r else ""]  # fmt: skip
        rows.append((cells, STATE_STYLE.get(str(v.state), "")))
    return rows


def counts_caption(views) -> str:
    counts = Counter(str(v.state) for v in views)
    return ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no runs"


def status_table(views, title: str):
    caption = counts_caption(views)
    rows = status_rows(views)
    if len(rows) > RICH_TABLE_MAX_ROWS:
        return _plain_table(rows, title, caption)
    table = Table(title=title, caption=caption)
    for col, justify in STATUS_COLUMNS:
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for cells, style in rows:
        table.add_row(*cells[:3], Text(cells[3], style=style), *cells[4:])
    return table


def _plain_table(rows: list[tuple[list[str], str]], title: str, caption: str) -> Text:
    widths = [max(len(h), *(len(c[i]) for c, _ in rows)) for i, (h, _) in enumerate(STATUS_COLUMNS)]

    def line(cells: list[str]) -> list[str]:
        return [c.rjust(w) if j == "right" else c.ljust(w) for c, w, (_, j) in zip(cells, widths, STATUS_COLUMNS,
                                                                                    strict=True)]  # fmt: skip

    out = Text(f"{title}\n", style="bold")
    out.append("  ".join(line([h for h, _ in STATUS_COLUMNS])).rstrip() + "\n", style="bold")
    for cells, style in rows:
        parts = line(cells)
        out.append("  ".join(parts[:3]) + "  ")
        out.append(parts[3], style=style)
        out.append(("  " + "  ".join(parts[4:])).rstrip() + "\n")
    out.append(caption)
    return out


def print_status(views, ctx, title: str, as_json: bool, sweep_name: str | None) -> None:
    """The table and, under it, whose sweeps these are and the hours spent; with `as_json` the runs as one
    document on stdout and those lines on stderr."""
    from pdmctl import usage
    from pdmctl.budget.spent import status_output
    from pdmctl.terminal import console, err

    out = console
    if as_json:
        from pdmctl.shell import print_document

        print_document(status_document(views, ctx, sweep_name))
        out = err
    else:
        console.print(status_table(views, title))
    for part in [*usage.owner_notes(views), *status_output(views, ctx)]:  # whose sweeps; hours spent
        if isinstance(part, str):
            out.print(part, highlight=False, markup=False, soft_wrap=True)
        else:
            out.print(part)


def status_document(views, ctx, sweep_name: str | None) -> dict[str, Any]:
    """`status --json`: every run as the table shows it, with its numbers as numbers (docs/JSON.md)."""
    from pdmctl.ledger import _redact
    from pdmctl.shell import number

    runs = []
    for v in sorted(views, key=lambda v: (v.sweep, v.summary)):
        r = v.record
        runs.append({
            "sweep": v.sweep, "key": v.key, "run_id": r.run_id if r else None, "summary": v.summary,
            "state": str(v.state), "note": note(v), "step": r.step if r else None,
            "avg16_pct": number(100 * r.avg16) if r and r.avg16 is not None else None, "attempts": r.attempt if r else 0,
            "job_id": (r.job_id or None) if r else None, "run_dir": r.run_dir if r else None,
        })  # fmt: skip
    return {"command": "status", "sweep": sweep_name, "tracking_uri": _redact(ctx.tracking_uri),
            "counts": dict(sorted(Counter(str(v.state) for v in views).items())), "runs": runs}  # fmt: skip
