"""The command line's help to its users (mounted by pdmctl.cli): `--version`, an examples section in every
command's help, a mistyped flag named as a flag with the one meant, an unknown sweep named with the known
ones, and `pdmctl init`, which copies the shipped YAML out for editing (pdmctl.resources)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pdmctl.terminal import console, fail
from pdmctl.terminal import guard as _guard

# each command's help ends with these (rich markup: no square brackets unescaped)
EXAMPLES = {
    "sweep": ["pdmctl sweep delta=0.05 --dry-run", "pdmctl sweep mask=pdm_agg,dppo_topk_kl seeds=3 --wait",
              "pdmctl sweep --file paper-main --cluster h20"],
    "status": ["pdmctl status", "pdmctl status paper-main --watch"],
    "resume": ["pdmctl resume paper-main --dry-run", "pdmctl resume paper-main --max-attempts 3 --wait"],
    "cancel": ["pdmctl cancel paper-main", "pdmctl cancel 3f2a9c (a run key prefix or MLflow run id)"],
    "logs": ["pdmctl logs 3f2a9c", "pdmctl logs 3f2a9c --follow --attempt 1"],
    "server start": ["pdmctl server start --host 10.0.0.5 --port 5000", "pdmctl server start --tls"],
    "server stop": ["pdmctl server stop", "pdmctl server stop --dir /local/pdmctl-server"],
    "server status": ["pdmctl server status", "pdmctl server status --dir /local/pdmctl-server"],
    "server user add": ["pdmctl server user add bob (asks bob's password twice)",
                        "pdmctl server user add bob --password-stdin < bobs-password.txt"],
    "server user remove": ["pdmctl server user remove bob"],
    "server share": ["pdmctl server share paper-main bob carol",
                     "pdmctl server share paper-main dave --read (reads it only)"],
    "doctor": ["pdmctl doctor --cluster h20", "pdmctl doctor --cluster h20 --job --file paper-main"],
    "init": ["pdmctl init (copies configs/, sweeps/, clusters/, reports/ here)",
             "pdmctl init ~/.config/pdmctl (the user's folder, searched after the working directory's)"],
    "report": ["pdmctl report", "pdmctl report paper-main --baseline dppo_topk_kl --interval bca"],
    "analyze": ["pdmctl analyze --seeds 5 --json direction.json", "pdmctl analyze precision=fp8_rollout k=50"],
    "tune": ["pdmctl tune --file tune-testbed --dry-run", "pdmctl tune --file tune-testbed --trials 20 --parallel 2"],
    "seeds": ["pdmctl seeds paper-main", "pdmctl seeds paper-main --max-seeds 8 --submit"],
    "preflight": ["pdmctl preflight --file paper-main --cluster h20 --dry-run",
                  "pdmctl preflight --file paper-main --cluster h20 --wait (then: the same, each setting's verdict)"],
    "docs": ["pdmctl docs (the folder of pdmctl's Markdown docs)", "pdmctl docs docs/CLUSTER.md",
             'bash "$(pdmctl docs scripts/engine-env.sh)" --cuda --pdmctl pdmctl-0.1.0-py3-none-any.whl DIR'],
    "data prepare": ["pdmctl data prepare /shared/data/dapo-math",
                "pdmctl data prepare /shared/data/dapo-math --max-prompt-chars 4000"],
}  # fmt: skip
# under the command list of `pdmctl --help`
DOCS_EPILOG = ("Help and messages name files as pdmctl's repository holds them (docs/CLUSTER.md, "
               "scripts/engine-env.sh): pdmctl docs PATH prints where this installation keeps each one.")


def version_line() -> str:
    """`pdmctl 0.1.0`, with the commit of pdmctl's own clone it runs from, or the one its wheel was built from
    (`provenance.git_state`); without it where neither is known."""
    from pdmctl import __version__
    from pdmctl.provenance import git_state

    state = git_state()
    if state["commit"] == "unknown":
        return f"pdmctl {__version__}"
    return f"pdmctl {__version__} (commit {state['commit'][:12]}{', modified' if state['dirty'] == 'yes' else ''})"


class OverridesCommand(typer.core.TyperCommand):
    """A command whose free words are grid overrides (`key=value`): a word that starts with '-' is not an
    override but a mistyped flag, reported as one with the closest flag (or override key) it resembles."""

    def parse_args(self, ctx, args):
        _refuse_unknown_flags(self, ctx, list(args))
        return super().parse_args(ctx, args)


def _refuse_unknown_flags(command, ctx, args: list[str]) -> None:
    try:  # typer >= 0.24 carries its own click
        from typer._click import exceptions as click_exceptions
    except ImportError:  # pragma: no cover (older typer: click itself)
        from click import exceptions as click_exceptions

    takes_value = {o for p in command.params if not getattr(p, "is_flag", False) and p.param_type_name == "option"
                   for o in (*p.opts, *p.secondary_opts)}  # fmt: skip
    known = {o for p in command.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
    previous = None
    for arg in args:
        if arg == "--":
            return
        flag = arg.split("=", 1)[0]
        if arg.startswith("-") and len(arg) > 1 and previous not in takes_value and flag not in known:
            raise click_exceptions.UsageError(f"no such option {flag}{_flag_hint(flag, known)}", ctx=ctx)
        previous = arg if "=" not in arg else None


def _flag_hint(flag: str, known: set[str]) -> str:
    """` (did you mean --wait?)`; for a word that is no flag but resembles an override key, the override."""
    import difflib

    match = difflib.get_close_matches(flag, sorted(o for o in known if o.startswith("--")), n=1, cutoff=0.6)
    if match:
        return f" (did you mean {match[0]}?)"
    try:
        from pdmctl.grid import override_keys

        keys = override_keys()
    except Exception:  # a config tree that cannot compose: no key to suggest
        return ""
    match = difflib.get_close_matches(flag.lstrip("-"), keys, n=1, cutoff=0.6)
    return f" (did you mean the override {match[0]}=...?)" if match else ""


def _redacted(uri: str) -> str:
    from pdmctl.ledger import _redact

    return _redact(uri)


def _shown(name: str) -> str:
    return repr(name if len(name) <= 200 else f"{name[:200]}...")


def known_sweeps(ctx) -> list[str] | None:
    """The sweeps in the store; None when there is no store yet."""
    from pdmctl.ledger import ledger_exists, open_ledger

    return open_ledger(ctx.tracking_uri).sweeps() if ledger_exists(ctx.tracking_uri) else None


def check_sweep(ctx, name: str | None, change: bool = False) -> None:
    """A sweep name the store does not hold: one line naming the known ones (and the closest), exit 2; on a
    tracking server with logins, one of another login's too, unread, or with `change` unless shared with this
    one (SweepOwnerError, pdmctl.ledger.check_owner)."""
    from pdmctl.ledger import check_owner
    from pdmctl.yamlfiles import did_you_mean

    if name is None:
        return
    check_owner(ctx.tracking_uri, name, write=change)
    sweeps = known_sweeps(ctx)
    if sweeps is None:
        fail(f"sweep {_shown(name)}: no runs (no store at {_redacted(ctx.tracking_uri)} yet)")
    elif name not in sweeps:
        fail(f"sweep {_shown(name)}: no runs in {_redacted(ctx.tracking_uri)}{did_you_mean(name, sweeps)} "
             f"(known sweeps: {', '.join(sweeps) or 'none'})")


def check_target(ctx, target: str | None) -> None:
    """`cancel`'s target: a sweep, or a run (key, key prefix or MLflow run id); neither: one line, exit 2. A
    sweep of another login's (a tracking server's) is SweepOwnerError, as orchestrate.cancel makes a run of
    one. No store yet: left to pdmctl.orchestrate.cancel, which says so."""
    from pdmctl import orchestrate
    from pdmctl.ledger import check_owner
    from pdmctl.yamlfiles import did_you_mean

    check_owner(ctx.tracking_uri, target)
    sweeps = known_sweeps(ctx)
    if target is None or sweeps is None or target in sweeps:
        return
    try:
        orchestrate.find_run(orchestrate.status(ctx, None), target)
    except orchestrate.RunNotFound as exc:
        if "ambiguous" in str(exc):
            raise
        fail(f"{_shown(target)}: no such sweep or run in {_redacted(ctx.tracking_uri)}"
             f"{did_you_mean(target, sweeps)} (known sweeps: {', '.join(sweeps) or 'none'})")


def owner_notes(views) -> list[str]:
    """The lines under `status` on whose sweeps these runs are (pdmctl.ledger.login_notes)."""
    from pdmctl.ledger import login_notes, tracking_login

    return login_notes([v.record for v in views if v.record], tracking_login())


def init(
    directory: Annotated[
        Path, typer.Argument(metavar="DIR", help="Where to copy them (default: the working directory).")
    ] = Path("."),
) -> None:
    """Copy pdmctl's default config tree, sweep files, cluster profiles and report definitions into
    DIR/configs, DIR/sweeps, DIR/clusters and DIR/reports for editing. pdmctl reads the working directory's
    folders first, then $XDG_CONFIG_HOME/pdmctl (~/.config/pdmctl), then its own. Refuses to overwrite."""
    from pdmctl import resources
    from pdmctl.terminal import check_output

    with _guard():
        target = directory.expanduser()
        check_output(target, "init:", directory=True)
        try:
            written = resources.init(target)
        except FileExistsError as exc:
            fail(f"init: {exc} already exists; pdmctl init never overwrites (move it away or pick another DIR)")
        except OSError as exc:
            fail(f"init: {target}: {exc.strerror or exc}")
    folders = sorted({p.relative_to(target).parts[0] for p in written})
    console.print(f"copied {len(written)} file(s) into {', '.join(str(target / f) for f in folders)}",
                  highlight=False, markup=False, soft_wrap=True)  # fmt: skip


def register(app: typer.Typer) -> None:
    """`init` and `docs`; then, on every command mounted so far: the overrides' flag check, the examples."""
    from pdmctl.shipped import docs

    app.command(name="init")(init)
    app.command(name="docs")(docs)
    if not isinstance(app.info.epilog, str):  # typer's placeholder where none was given
        app.info.epilog = DOCS_EPILOG
    for info in app.registered_commands:  # a command whose free words are overrides refuses mistyped flags
        if (info.context_settings or {}).get("ignore_unknown_options") and info.cls in (None, typer.core.TyperCommand):
            info.cls = OverridesCommand
    _add_examples(app)
    _classic_type_names()


# typer >= 0.2x shows each parameter's Python annotation in help (`<bool>` beside every flag, `<list[str]>`):
# click's names instead, none beside a flag (it takes no value)
CLASSIC_TYPES = {"<str>": "TEXT", "<int>": "INTEGER", "<float>": "FLOAT", "<path>": "PATH", "<list[str]>": "TEXT ...",
                 "<list[path]>": "PATH ...", "<list[int]>": "INTEGER ...", "<list[float]>": "FLOAT ..."}  # fmt: skip


def _classic_type_names() -> None:
    core = typer.core
    for cls in (getattr(core, "TyperOption", None), getattr(core, "TyperArgument", None)):
        shown = getattr(cls, "display_type_rich", None)
        if shown is None or getattr(shown, "_pdmctl_classic", False):
            continue

        def display_type_rich(self, ctx, _shown=shown):  # type: ignore[no-untyped-def]
            if getattr(self, "is_flag", False) and not getattr(self, "count", False):
                return None
            label = _shown(self, ctx)
            return CLASSIC_TYPES.get(label, label) if isinstance(label, str) else label

        display_type_rich._pdmctl_classic = True  # type: ignore[attr-defined]
        cls.display_type_rich = display_type_rich  # type: ignore[method-assign]


def _add_examples(typer_app: typer.Typer, prefix: tuple[str, ...] = ()) -> None:
    """Each command's exit codes (pdmctl.shell.exits) and examples, by its words under `pdmctl` (`server status`
    is not `status`)."""
    from pdmctl.shell.exits import help_text

    for info in typer_app.registered_commands:
        name = " ".join((*prefix, info.name or (info.callback.__name__ if info.callback else "")))
        if name in EXAMPLES and info.epilog is None:
            info.epilog = help_text(name) + "Examples:\n" + "\n".join(EXAMPLES[name])
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            words = group.name or group.typer_instance.info.name
            _add_examples(group.typer_instance, (*prefix, words) if isinstance(words, str) else prefix)
