"""Shell completion of the names pdmctl's arguments take (typer's `autocompletion=`): the sweeps in the store,
the runs' keys, cluster profiles (clusters/*.yaml), sweep files (sweeps/*.yaml), report definitions, mask names
and, for a grid override `GROUP=...`, the config group's options.

Each function takes click's context (the options typed so far: `--cluster`, `--tracking-uri`) and the word
being completed, and returns the names that start with it, sorted. A completion never fails: where a store
cannot be read (none yet, a server that does not answer) it offers nothing. `pdmctl --install-completion`
installs it in the shell; docs/SWEEPS.md, "Shell completion".
"""

from __future__ import annotations

from typing import Any

GROUPS = ("backend", "data", "mask", "model", "precision")  # the config groups a grid override picks from


def _starting(names: list[str] | set[str], incomplete: str) -> list[str]:
    return sorted(n for n in set(names) if n.startswith(incomplete or ""))


def _store(ctx: Any) -> Any:
    """The ledger the command line so far names (its --cluster and --tracking-uri), or None."""
    from pdmctl.ledger import ledger_exists, open_ledger
    from pdmctl.orchestrate import make_context

    params = getattr(ctx, "params", None) or {}
    made = make_context(params.get("cluster") or "local", params.get("tracking_uri"))
    return open_ledger(made.tracking_uri) if ledger_exists(made.tracking_uri) else None


def sweeps(ctx: Any, incomplete: str) -> list[str]:
    """The sweeps in the store."""
    try:
        store = _store(ctx)
        return _starting(store.sweeps(), incomplete) if store is not None else []
    except Exception:  # a completion says nothing rather than a traceback into the shell
        return []


def runs(ctx: Any, incomplete: str) -> list[tuple[str, str]]:
    """The runs' keys, each with its sweep and summary as the shell's help."""
    try:
        store = _store(ctx)
        records = store.runs() if store is not None else []
    except Exception:
        return []
    return sorted({(r.key, f"{r.sweep}: {r.summary}") for r in records if r.key.startswith(incomplete or "")})


def sweeps_and_runs(ctx: Any, incomplete: str) -> list[str | tuple[str, str]]:
    """`cancel`'s target: a sweep, or a run's key."""
    return [*sweeps(ctx, incomplete), *runs(ctx, incomplete)]


def _resources(kind: str, incomplete: str) -> list[str]:
    try:
        from pdmctl.resources import known

        return _starting(known(kind), incomplete)
    except Exception:
        return []


def clusters(incomplete: str) -> list[str]:
    """The cluster profiles along the search path (clusters/*.yaml: the working directory's, the user's, the
    shipped ones)."""
    return _resources("clusters", incomplete)


def sweep_files(incomplete: str) -> list[str]:
    """The sweep files along the search path (sweeps/*.yaml)."""
    return _resources("sweeps", incomplete)


def report_definitions(incomplete: str) -> list[str]:
    """The report definitions along the search path (reports/*.yaml)."""
    return _resources("reports", incomplete)


def group_options(group: str) -> list[str]:
    """A config group's options (configs/<group>/*.yaml; for backend, the backends), without Hydra."""
    try:
        from pdmctl.resources import config_dir

        options = {p.stem for p in (config_dir() / group).glob("*.yaml") if p.is_file()}
        if group == "backend":
            from pdmctl.backends.registry import BACKENDS

            options |= set(BACKENDS)
        return sorted(options)
    except Exception:
        return []


def masks(incomplete: str) -> list[str]:
    """The mask names (configs/mask/*.yaml): pdm_agg, dppo_topk_kl, grpo_clip_higher, ..."""
    return _starting(group_options("mask"), incomplete)


def overrides(ctx: Any, incomplete: str) -> list[str]:
    """A grid override: after `GROUP=` (and after each comma of a list) the group's options; before any `=`,
    the groups themselves (`mask=`, `model=`, ...) and `seeds=`. Bash splits a word at `=` (the overrides
    so far end `mask`, `=`; the word is `pdm`) and replaces only what follows it: there the options alone,
    once a first letter follows the `=`."""
    args = list((getattr(ctx, "params", None) or {}).get("overrides") or [])
    if len(args) >= 2 and args[-1] == "=" and args[-2] in GROUPS:  # bash: `mask=pdm`
        return _values(args[-2], incomplete)
    key, eq, value = (incomplete or "").partition("=")
    if not eq:
        return _starting([f"{g}=" for g in (*GROUPS, "seeds")], key)
    return [f"{key}={v}" for v in _values(key, value)] if key in GROUPS else []


def _values(group: str, value: str) -> list[str]:
    """`value` completed to each of the group's options it starts, after the options listed before its last
    comma (none twice)."""
    done, _, last = value.rpartition(",")
    head = f"{done}," if done else ""
    chosen = set(done.split(",")) if done else set()
    return [head + o for o in group_options(group) if o.startswith(last) and o not in chosen]
