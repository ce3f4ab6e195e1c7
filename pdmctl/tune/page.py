"""`pdmctl report --tune NAME`: one self-contained HTML page for a study.

The trial table (state, value, parameters, runs) from the study and the
ledger, and Optuna's own matplotlib figures: optimisation history,
intermediate values (where pruning cut curves short), parameter importances.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdmctl.orchestrate import Context
from pdmctl.tune.study import StudyView, load_study, storage_url, study_view


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
    """The study's page from templates/study.html.j2 (the report's header and stylesheet)."""
    from pdmctl.report.page import header
    from pdmctl.report.page import render as render_page

    counts = ", ".join(f"{n} {s}" for s, n in sorted(view.counts().items())) or "no trials"
    request = view.request
    meta = []
    if request is not None:
        meta.append(f"{request.direction} {request.objective} at the {request.at} evaluation; pruner "
                    f"{request.pruner}; {request.seeds_per_trial} seed(s) per trial; space: "
                    f"{' '.join(request.overrides)}")  # fmt: skip
    meta.append(f"trials: {counts}")
    best = None
    if view.best is not None:
        params = ", ".join(f"{k} = {_fmt(v)}" for k, v in view.best.params.items())
        best = f"trial {view.best.number}, value {view.best.value:.4f} ({params}); run {' '.join(view.best.keys)}"
    names = sorted({k for t in view.trials for k in t.params})
    headers = ("#", "state", "value", *names, "runs", "run state")
    rows = [(str(t.number), t.state, "" if t.value is None else f"{t.value:.4f}",
             *(_fmt(t.params.get(n)) for n in names), " ".join(t.keys), t.run_state or "")
            for t in view.trials]  # fmt: skip
    return render_page(
        "study.html.j2",
        title=f"study {view.name}",
        header=header(storage),
        generated=None,
        meta=meta,
        best=best,
        headers=headers,
        rows=rows,
        numeric={0, 2, *range(3, 3 + len(names))},
        code=3 + len(names),
        figures=[{"data": base64.b64encode(png).decode(), "caption": caption} for _, caption, png in figures],
    )


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    return f"{value:.4g}" if isinstance(value, float) else str(value)
