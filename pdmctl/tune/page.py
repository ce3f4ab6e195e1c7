"""`pdmctl report --tune NAME`: one self-contained HTML page for a study.

The trial table (state, value, parameters, runs) from the study and the
ledger, and Optuna's own matplotlib figures: optimisation history,
intermediate values (where pruning cut curves short), parameter importances.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdmctl.orchestrate import Context
from pdmctl.tune.study import StudyView, load_study, storage_url, study_view

_CSS = """
body{font-family:system-ui,sans-serif;margin:2rem auto;max-width:1200px;padding:0 1rem;color:#222}
table{border-collapse:collapse;margin:1rem 0;font-size:.9rem}
th,td{padding:.25rem .6rem;border-bottom:1px solid #ddd;text-align:left;white-space:nowrap}
th{border-bottom:2px solid #444}.num{text-align:right;font-variant-numeric:tabular-nums}
.meta{color:#555;font-size:.85rem}figure{margin:1rem 0}img{max-width:100%}
"""


def write_study_report(name: str, ctx: Context, out_dir: Path, storage: str | None = None) -> Path:
    """Write out_dir/index.html (and the figures as PNG beside it); return the page's path."""
    url = storage_url(ctx.tracking_uri, storage)
    view = study_view(name, url, ctx)
    figures = study_figures(load_study(name, url))
    out_dir.mkdir(parents=True, exist_ok=True)
    for file_name, _, png in figures:
        (out_dir / file_name).write_bytes(png)
    page = out_dir / "index.html"
    page.write_text(render(view, figures, url))
    return page


def study_figures(study) -> list[tuple[str, str, bytes]]:
    """(file name, caption, PNG) for each of Optuna's figures the study has data for."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna
    from optuna.visualization import matplotlib as vis

    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    wanted: list[tuple[str, str, Callable[[], Any]]] = []
    if complete:
        wanted.append(("history.png", "Optimisation history: each trial's value and the best so far.",
                       lambda: vis.plot_optimization_history(study)))  # fmt: skip
    if any(t.intermediate_values for t in study.get_trials(deepcopy=False)):
        wanted.append(("intermediate.png", "Intermediate values: the objective at each evaluation; pruned "
                       "trials stop early.", lambda: vis.plot_intermediate_values(study)))  # fmt: skip
    if len(complete) >= 2 and len(study.best_trial.params) >= 1:
        wanted.append(("importances.png", "Parameter importances (fANOVA over the completed trials).",
                       lambda: vis.plot_param_importances(study)))  # fmt: skip
    out = []
    for file_name, caption, draw in wanted:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Optuna marks its matplotlib module experimental
            axes = draw()
        fig = axes.figure if hasattr(axes, "figure") else axes.flat[0].figure
        fig.set_size_inches(8, 4.5)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110)
        plt.close(fig)
        out.append((file_name, caption, buf.getvalue()))
    return out


def render(view: StudyView, figures: list[tuple[str, str, bytes]], storage: str) -> str:
    esc = html.escape
    counts = ", ".join(f"{n} {s}" for s, n in sorted(view.counts().items())) or "no trials"
    request = view.request
    lines = [f"<!doctype html><html><head><meta charset='utf-8'><title>study {esc(view.name)}</title>",
             f"<style>{_CSS}</style></head><body><h1>study {esc(view.name)}</h1>"]  # fmt: skip
    if request is not None:
        lines.append(f"<p class='meta'>{esc(request.direction)} {esc(request.objective)} at the {esc(request.at)} "
                     f"evaluation; pruner {esc(request.pruner)}; {request.seeds_per_trial} seed(s) per trial; "
                     f"space: <code>{esc(' '.join(request.overrides))}</code></p>")  # fmt: skip
    lines.append(f"<p class='meta'>trials: {esc(counts)}; storage {esc(storage)}</p>")
    if view.best is not None:
        params = ", ".join(f"{k} = {_fmt(v)}" for k, v in view.best.params.items())
        lines.append(f"<p><b>best</b>: trial {view.best.number}, value {view.best.value:.4f} ({esc(params)}); "
                     f"run {esc(' '.join(view.best.keys))}</p>")  # fmt: skip
    names = sorted({k for t in view.trials for k in t.params})
    head = "".join(f"<th>{esc(n)}</th>" for n in ("#", "state", "value", *names, "runs", "run state"))
    rows = []
    for t in view.trials:
        cells = [f"<td class='num'>{t.number}</td>", f"<td>{esc(t.state)}</td>",
                 f"<td class='num'>{'' if t.value is None else f'{t.value:.4f}'}</td>",
                 *(f"<td class='num'>{esc(_fmt(t.params.get(n)))}</td>" for n in names),
                 f"<td><code>{esc(' '.join(t.keys))}</code></td>", f"<td>{esc(t.run_state or '')}</td>"]  # fmt: skip
        rows.append(f"<tr>{''.join(cells)}</tr>")
    lines.append(f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>")
    for _, caption, png in figures:
        data = base64.b64encode(png).decode()
        lines.append(
            f"<figure><img src='data:image/png;base64,{data}'><figcaption>{esc(caption)}</figcaption></figure>"
        )
    lines.append("</body></html>")
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    return f"{value:.4g}" if isinstance(value, float) else str(value)
