"""Sweeps: Hydra overrides and sweep files -> RunSpecs.

A grid is Hydra's multirun grammar (`delta=0.05,0.15`, `k=range(10,60,20)`,
`seed=choice(0,1)`, `+key=v`, `~key`, quoting) over the config tree in
`configs/`, crossed with an optional list of fixed settings from a sweep file.
Composition is cached by the job's config-group choices: a 1,000-run grid
composes a handful of trees and applies the value overrides to copies.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from pdmctl import engine_bounds
from pdmctl.order import check_priority
from pdmctl.plugins import config_node, names
from pdmctl.resources import config_dir, search_path
from pdmctl.spec import RunSpec, SpecError, validate
from pdmctl.yamlfiles import YamlRefused, did_you_mean, load_named, read_text, refuse_bombs_under, safe_load

MAX_RUNS = 100_000  # a bigger grid is a typo more often than a plan; --max-runs raises it
# The array's order (`--order`, or `order:` in a sweep file; pdmctl.order): "answers" (the default) runs
# replicate 0 of every setting, then replicate 1, ..., inside a replicate setting by setting, the cheapest
# first; "seed" the same with the settings taking turns arm by arm; "setting" one run of each setting, then
# the rest in grid order.
ORDERS = ("answers", "seed", "setting")
_SWEEP_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


class GridError(ValueError):
    """A grid that cannot be expanded; the message is one line."""


@dataclass(frozen=True)
class SweepFile:
    name: str
    description: str = ""
    grid: dict[str, str] = field(default_factory=dict)  # key -> Hydra value (may sweep)
    settings: list[dict[str, str]] = field(default_factory=list)  # fixed combinations, zipped not crossed
    order: str | None = None  # the array's order (ORDERS); None: the default
    priority: tuple[str, ...] = ()  # key=value items: the settings whose runs match go first (pdmctl.order)


def load_sweep_file(path_or_name: str) -> SweepFile:
    """`sweeps/NAME.yaml`, a bare NAME found there, or any path."""
    path, data = load_named(path_or_name, search_path("sweeps"), "sweep file", GridError)
    where = f"sweep file: {path}"
    if not data:  # an empty file would silently sweep nothing but the default config
        raise GridError(f"{where}: empty (give it a grid: or settings:)")
    unknown = set(data) - {"name", "description", "grid", "settings", "tune", "order", "priority"}  # tune: pdmctl tune
    if unknown:
        raise GridError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    if "grid" not in data and "settings" not in data:  # name: alone would sweep the default config
        raise GridError(f"{where}: no grid: or settings: (it would run the default config only)")
    raw_grid, raw_settings = data.get("grid", {}), data.get("settings", [])
    if raw_grid is None:  # `grid:` with every line under it commented out
        raise GridError(f"{where}: grid: is empty (it would run the default config only)")
    if not isinstance(raw_grid, dict):  # 0, false, "": not a grid
        raise GridError(f"{where}: grid: must be a mapping of key: values, got {raw_grid!r}")
    if not isinstance(raw_settings, list) or not all(isinstance(s, dict) for s in raw_settings):
        raise GridError(f"{where}: settings: must be a list of key: value mappings, got {raw_settings!r}")
    if "grid" in data and not raw_grid:
        raise GridError(f"{where}: grid: is empty (it would run the default config only)")
    if "settings" in data and not raw_settings:
        raise GridError(f"{where}: settings: is an empty list (it would run the default config only)")
    grid = {str(k): _hydra_value(v, f"{where}: grid: {k}") for k, v in raw_grid.items()}
    settings = [
        {str(k): _hydra_value(v, f"{where}: settings: {k}") for k, v in s.items()} for s in raw_settings
    ]
    order = data.get("order")
    if order is not None:
        order = check_order(order, f"{where}: order")
    priority = check_priority(data["priority"], f"{where}: priority") if data.get("priority") is not None else ()
    return SweepFile(name=str(data.get("name") or path.stem), description=str(data.get("description") or ""),
                     grid=grid, settings=settings, order=order, priority=priority)  # fmt: skip


def check_order(order: Any, where: str = "order") -> str:
    """One of ORDERS, else GridError naming the choices."""
    if order not in ORDERS:
        raise GridError(f"{where}: unknown order {order!r}; choose from {', '.join(ORDERS)}")
    return str(order)


def _hydra_value(value: Any, where: str) -> str:
    if isinstance(value, list):  # a YAML list in a sweep file is a sweep over its items
        if not value:
            raise GridError(f"{where}: an empty list sweeps over no values")
        return ",".join(_hydra_value(v, where) for v in value)
    if isinstance(value, dict):
        raise GridError(f"{where}: must be a value or a list of values, got a mapping")
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def check_sweep_name(name: str) -> str:
    if not _SWEEP_NAME.match(name):
        raise GridError(f"sweep name: {name!r} must be letters, digits, '.', '_' or '-'")
    return name


# ---------------------------------------------------------------------------
# Expansion
# ---------------------------------------------------------------------------


def expand(
    overrides: Sequence[str],
    sweep_file: SweepFile | None = None,
    sweep: str | None = None,
    *,
    max_runs: int = MAX_RUNS,
) -> list[RunSpec]:
    """Every run of the grid, deduplicated by key, in grid order. Raises GridError/SpecError.

    A grid of more than `max_runs` points is refused before anything is expanded.
    """
    name = check_sweep_name(sweep if sweep is not None else (sweep_file.name if sweep_file else "default"))
    _refuse_repeated_keys(overrides)
    cli = [_expand_seeds(o) for o in overrides]
    grid = dict(sweep_file.grid) if sweep_file else {}
    settings = [dict(s) for s in (sweep_file.settings if sweep_file else [])] or [{}]
    cli_keys = {_override_key(o) for o in cli}
    for key in cli_keys:  # the command line wins over the file (`seeds:` in the file is `seed` too)
        for mapping in (grid, *settings):
            for k in [k for k in mapping if _same_key(k) == key]:
                mapping.pop(k)
    base = [_expand_seeds(f"{k}={v}") for k, v in grid.items()] + cli
    per_setting = [_parse(_special_sweeps([*(_expand_seeds(f"{k}={v}") for k, v in s.items()), *base]))
                   for s in _unique(settings)]  # fmt: skip
    _check_size(per_setting, max_runs)
    jobs: list[list[str]] = []
    for parsed in per_setting:
        jobs.extend([_bare_deletes(o) for o in job] for job in _cross(parsed))
    specs: dict[str, RunSpec] = {}
    with _hydra():
        for job in jobs:
            spec = RunSpec.from_config(name, compose(job))
            specs.setdefault(spec.key, spec)
    return list(specs.values())


def _cross(parsed: Sequence) -> list[list[str]]:
    """One setting's jobs (lists of `key=value`): the product of every key's values, the first varying slowest;
    a key given twice keeps its first place and its last values, as Hydra's multirun does."""
    choices: dict[str, list[str]] = {}
    for override in parsed:
        key = override.get_key_element()  # with its prefix: `+key`, `++key`, `~key`
        if not override.is_sweep_override():
            choices[key] = [f"{key}={override.get_value_element_as_str()}"]
        elif override.is_discrete_sweep():
            choices[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
        else:  # interval() is refused and glob() expanded before this (_special_sweeps)
            raise GridError(f"override {override.input_line!r}: a sweep that cannot be listed as a grid")
    return [list(job) for job in itertools.product(*choices.values())]


def count_runs(parsed: Sequence) -> int:
    """The points of one setting's grid: the product of each sweep's length, nothing expanded."""
    total = 1
    for override in parsed:
        total *= _sweep_length(override)
    return total


def _sweep_length(override) -> int:
    from hydra.core.override_parser.types import ChoiceSweep, RangeSweep

    value = override.value()  # a sweep's own object (ChoiceSweep, RangeSweep, ...), nothing enumerated
    if not override.is_sweep_override():
        return 1
    if isinstance(value, ChoiceSweep):
        return len(value.list)
    if isinstance(value, RangeSweep):
        if value.step == 0:
            raise GridError(f"override {override.input_line!r}: a range with step 0")
        numbers = value.range()
        if isinstance(numbers, range):
            return len(numbers)
        return max(0, math.ceil((numbers.stop - numbers.start) / numbers.step))
    return 1  # glob and interval sweeps: Hydra's sweeper refuses or lists them (config groups: few)


def _check_size(per_setting: Sequence[Sequence], max_runs: int) -> None:
    """Refuse an empty grid (naming the empty sweep) and one above `max_runs`, before expanding either."""
    for parsed in per_setting:
        empty = next((o for o in parsed if _sweep_length(o) == 0), None)
        if empty is not None:
            raise GridError(f"override {empty.input_line!r}: sweeps over no values, so the grid has no runs")
    total = sum(count_runs(parsed) for parsed in per_setting)
    if total > max_runs:
        raise GridError(f"grid: {total:,} runs, more than the limit of {max_runs:,} "
                        "(raise it with --max-runs if you mean it)")  # fmt: skip


def _refuse_repeated_keys(overrides: Sequence[str]) -> None:
    """`k=10 k=20` would silently keep k=20: a key is given once, with all its values."""
    seen: dict[str, str] = {}
    for override in overrides:
        key = _same_key(_override_key(override))  # `seeds=3 seed=7` set one field twice
        if key in seen:
            values = f"{seen[key].partition('=')[2]},{override.partition('=')[2]}"
            if key == "seed":  # `seeds=3` is seeds 0,1,2: the hint joins the seeds, not the texts
                both = [_seed_list(seen[key]), _seed_list(override)]
                values = ",".join(map(str, sorted({*both[0], *both[1]}))) if None not in both else "a,b,c"
            raise GridError(f"{key}: given twice ({seen[key]!r} and {override!r}); give its values once, "
                            f"e.g. {key}={values}")  # fmt: skip
        seen[key] = override


def _seed_list(override: str) -> list[int] | None:
    """The seeds a `seeds=N`, `seeds=a,b` or `seed=a,b` override names; None for anything else (a range)."""
    key, _, value = override.partition("=")
    value = value.strip().strip("[]")
    if key.lstrip("+") == "seeds" and re.fullmatch(r"\d+", value):
        return list(range(int(value)))
    if re.fullmatch(r"\d+(\s*,\s*\d+)*", value):
        return [int(v) for v in value.split(",")]
    return None


def _same_key(key: str) -> str:
    """The field an override key sets: `seeds` sets `seed`."""
    return "seed" if key == "seeds" else key


def _special_sweeps(overrides: Sequence[str]) -> list[str]:
    """Hydra sweeps the basic sweeper cannot expand: `glob()` over a config group's options becomes the
    list of matching options; `interval()` (a search range, not a grid) is refused for `pdmctl tune`."""
    from hydra.core.override_parser.types import IntervalSweep

    for text in overrides:
        if isinstance(_parse_one(text).value(), IntervalSweep):
            raise GridError(f"override {text!r}: interval() is a search range for `pdmctl tune`, not a grid; "
                            "list the values (a,b,c) or use range(start,stop,step)")  # fmt: skip
    return expand_globs(overrides)


def expand_globs(overrides: Sequence[str]) -> list[str]:
    """`glob()` over a config group's options as the list of the options it matches (`mask=pdm_agg,pdm_uni`):
    a grid's values, or a tune search's choices. A glob over anything else, or matching nothing, is refused."""
    from hydra.core.override_parser.types import Glob

    out = []
    for text in overrides:
        override = _parse_one(text)
        value = override.value()  # a glob() as Hydra parsed it, nothing matched yet
        if isinstance(value, Glob):
            group = override.key_or_group
            if group not in _config_groups() or override.is_delete():
                raise GridError(f"override {text!r}: glob() selects options of a config group "
                                f"({', '.join(sorted(_config_groups()))}), not values of {group}")  # fmt: skip
            matches = value.filter(group_options(group))
            if not matches:
                raise GridError(f"override {text!r}: sweeps over no values (no {group} option matches; "
                                f"choose from {', '.join(group_options(group))})")  # fmt: skip
            prefix = text[: len(text) - len(text.lstrip("+~"))]
            text = f"{prefix}{group}={','.join(matches)}"
        out.append(text)
    return out


def group_options(group: str) -> list[str]:
    """A config group's options: its files under configs/, installed plugins' (pdmctl.plugins), the backends."""
    options = {p.stem for p in (config_dir() / group).glob("*.yaml")} | names(group)
    if group == "backend":
        from pdmctl.backends.registry import BACKENDS

        options |= set(BACKENDS)
    return sorted(options)


def _check_options(groups: Sequence[str]) -> None:
    """A config-group option is a name in its group, never a path (`mask=/elsewhere/evil` would load
    /elsewhere/evil.yaml from outside configs/) nor a name the file system cannot hold."""
    for override in _parse(groups):
        group = override.key_or_group
        if group not in _config_groups() or override.is_delete():
            continue  # `mask.eps_low=...`: a value override inside the group's node
        option = override.value()
        options = group_options(group)
        if not isinstance(option, str) or option not in options:
            shown = repr(option) if len(repr(option)) <= 80 else f"{repr(option)[:80]}..."
            hint = did_you_mean(option, options) if isinstance(option, str) and len(option) <= 80 else ""
            raise GridError(f"{group}: unknown option {shown}{hint}; choose from {', '.join(options)}")


def compose(overrides: Sequence[str]) -> dict[str, Any]:
    """The resolved, validated run config for one job's overrides (inside `_hydra()`).

    Config-group choices go through Hydra's composition (cached per choice);
    value overrides are applied to a plain copy with Hydra's semantics (a plain
    `key=v` must name an existing key, `+key` adds a new one, `++key` sets
    either way, `~key` deletes) — the same result as composing every job, at a
    fraction of the cost for a 1,000-run grid.
    """
    groups, values = [], []
    for o in overrides:
        _refuse_engine_node(_override_key(o))
        (groups if _override_key(o).split(".")[0] in _config_groups() else values).append(o)
    _check_options(groups)
    groups += _implied_data(groups)
    config = _copy(_compose_groups(tuple(groups)))
    for override in _parse(values):
        _apply(config, override)
    validate(config)
    _validate_backend(config)
    return config


def _implied_data(groups: Sequence[str]) -> list[str]:
    """`data=<the model's data>` where a model names its data (`data:` in configs/model/<m>.yaml: a
    VeRL model's held-out sets are AIME-named, not the testbed's) and the job chose none."""
    keys = {_override_key(g): g for g in groups}
    if "data" in keys or "model" not in keys:
        return []
    (override,) = _parse([keys["model"]])
    option = override.value()
    node = _plain_option("model", option) if isinstance(option, str) else None
    data = (node or {}).get("data")
    return [f"data={data}"] if isinstance(data, str) else []


def _apply(config: dict[str, Any], override) -> None:
    key = override.key_or_group
    if _apply_engine_key(config, override):
        return
    *parents, leaf = key.split(".")
    node = config
    for i, part in enumerate(parents):
        child = node.get(part)
        if child is None and (override.is_add() or override.is_force_add()):
            child = node[part] = {}
        if not isinstance(child, dict):
            hint = _key_hint(node, parents[:i], part) if child is None else ""
            raise GridError(f"{'.'.join(parents[: i + 1])}: unknown key{hint or ' (no such field in the run config)'}")
        node = child
    if override.is_delete():
        if leaf not in node:
            raise GridError(f"{key}: cannot delete, no such key")
        del node[leaf]
    elif override.is_force_add():
        node[leaf] = override.value()
    elif override.is_add():
        if leaf in node:
            raise GridError(f"{key}: already set; use {key}=... to change it (or ++{key}=...)")
        node[leaf] = override.value()
    else:
        if leaf not in node:
            hint = _key_hint(node, parents, leaf)
            adds = f" (no such field in the run config; '+{key}=...' adds one)"
            raise GridError(f"{key}: unknown key{hint or adds}")
        node[leaf] = override.value()


def _key_hint(node: dict[str, Any], parents: Sequence[str], leaf: str) -> str:
    """` (did you mean 'delta'?)` for a mistyped key, from the keys beside it in the run config."""
    prefix = "".join(f"{p}." for p in parents)
    return _suggest_key(f"{prefix}{leaf}", [f"{prefix}{k}" for k in (*node, *([] if parents else ["seeds"]))])


def _suggest_key(key: str, keys: Sequence[str]) -> str:
    """` (did you mean 'backend.steps'?)`: the closest key beside `key` (the same parent, the leaf compared)."""
    import difflib

    parent, _, leaf = key.rpartition(".")
    siblings = {k.rpartition(".")[2]: k for k in keys if k.rpartition(".")[0] == parent}
    match = difflib.get_close_matches(leaf, list(siblings), n=1, cutoff=0.6) if len(leaf) <= 80 else []
    return f" (did you mean {siblings[match[0]]!r}?)" if match else ""


def override_keys() -> list[str]:
    """The keys a grid override can set on the default run config (`delta`, `backend.steps`, `seeds`, ...)."""
    with _hydra():
        return _default_keys()


def _default_keys() -> list[str]:
    """override_keys() inside `_hydra()`."""
    config = _compose_groups(())
    keys = {"seeds"}

    def walk(node: dict[str, Any], prefix: str) -> None:
        for k, v in node.items():
            keys.add(prefix + k)
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")

    walk(config, "")
    return sorted(keys)


def _apply_engine_key(config: dict[str, Any], override) -> bool:
    """`verl.<key>=v` (`+`, `++` alike; `~` leaves the key to pdmctl and the engine, on the command line over
    a sweep file that sets it too): a key of the run's engine's own config, kept as one flat mapping
    `backend.verl` (in the run key) that the backend checks against the engine's schema. False: not such a key."""
    key = override.key_or_group
    engines = _engine_prefixes()
    prefix, _, rest = key.partition(".")
    if prefix not in engines:
        return False
    backend = config["backend"]["name"]
    if engines[prefix] != backend:
        raise GridError(f"{key}: {prefix}.<key> sets backend={engines[prefix]}'s own config, and this run's "
                        f"backend is {backend}")  # fmt: skip
    if not rest:
        raise GridError(f"{key}: give the key, as {prefix}.<key>=<value>")
    settings = config["backend"].setdefault(prefix, {})
    if override.is_delete():
        settings.pop(rest, None)
        if not settings:
            del config["backend"][prefix]
    else:
        if (problem := engine_bounds.problem(key, override.value())) is not None:
            raise GridError(problem)
        settings[rest] = override.value()
    return True


def _engine_prefixes() -> dict[str, str]:
    """The grid's prefixes for engines' own config keys -> their backend (`verl` -> verl)."""
    from pdmctl.backends.registry import BACKENDS

    return {b.engine_keys: name for name, b in BACKENDS.items() if b.engine_keys}


def _refuse_engine_node(key: str) -> None:
    """`backend.verl...` is where `verl.<key>` settings are kept, set only through that prefix (one key each)."""
    head, _, rest = key.partition(".")
    engine = rest.split(".")[0]
    if head == "backend" and engine in _engine_prefixes():
        raise GridError(f"{key}: set {engine}'s own keys one by one, as {engine}.<key>=<value>")


def _validate_backend(config: dict[str, Any]) -> None:
    from pdmctl.backends.registry import flat_config, get_backend

    try:
        get_backend(config["backend"]["name"]).validate(flat_config(config))
    except SpecError:
        raise
    except ValueError as exc:
        raise SpecError(str(exc).splitlines()[0]) from exc


@lru_cache(maxsize=256)
def _compose_groups(groups: tuple[str, ...]) -> dict[str, Any]:
    """The run config for a set of config-group choices.

    Hydra composes the defaults once; a choice whose option file is a plain
    mapping (no defaults list, no package directive: every file in configs/ so
    far) then just replaces its group's node. Anything fancier goes through
    Hydra's full composition.
    """
    config = _copy(_hydra_compose(()))
    for override in _parse(groups):
        option = override.value() if not override.is_delete() else None
        # a group's option names a file of configs/<group>/; a value inside the group (`backend.data_dir=/x`)
        # never does (its value is no file name: /x.yaml, or one too long for the file system)
        plain = isinstance(option, str) and override.key_or_group in _config_groups()
        node = _plain_option(override.key_or_group, option) if plain else None
        if node is None:
            return _hydra_compose(groups)
        config[override.key_or_group] = node
    return config


@lru_cache(maxsize=256)
def _hydra_compose(groups: tuple[str, ...]) -> dict[str, Any]:
    from hydra import compose as hydra_compose
    from omegaconf import OmegaConf

    try:
        cfg = hydra_compose(config_name="run", overrides=list(groups))
        container = OmegaConf.to_container(cfg, resolve=True)
    except Exception as exc:  # MissingConfigException, ConfigCompositionException, ...
        raise GridError(_one_line(exc, groups)) from exc
    assert isinstance(container, dict)
    return container


@lru_cache(maxsize=256)
def _plain_option(group: str, option: str) -> dict[str, Any] | None:
    """A group option's node when it is a plain mapping, else None (Hydra composes it)."""
    path = config_dir() / group / f"{option}.yaml"
    if path.is_file():
        text = read_text(path, "config file", GridError)
        if "@package" in text:
            return None
        try:
            data = safe_load(text, path) or {}
        except YamlRefused as exc:
            raise GridError(f"config file: {exc}") from None
        if not isinstance(data, dict) or "defaults" in data or any("${" in str(v) for v in data.values()):
            return None
        return data
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    if (node := config_node(group, option)) is not None:  # an installed plugin's option (mask=mine)
        return node
    try:
        stored = ConfigStore.instance().load(f"{group}/{option}.yaml")
    except Exception:
        return None  # unknown option: Hydra's composition reports it
    container = OmegaConf.to_container(OmegaConf.create(stored.node), resolve=True)
    return container if isinstance(container, dict) else None


def _copy(config: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(config))  # plain JSON data; several times faster than deepcopy


class _hydra:
    """Hydra's global state for the config tree, with the backends' own groups registered."""

    def __enter__(self):
        from hydra import initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra

        refuse_bombs_under(config_dir(), "config file", GridError)  # before Hydra's loader reads any
        _register_backend_groups()
        GlobalHydra.instance().clear()
        _compose_groups.cache_clear()
        _hydra_compose.cache_clear()
        with warnings.catch_warnings():  # Hydra 1.4 warns that version_base goes in 1.5; "1.3" is honoured
            warnings.filterwarnings("ignore", message="The version_base parameter is deprecated")
            self._ctx = initialize_config_dir(config_dir=str(config_dir()), version_base="1.3", job_name="pdmctl")
            self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        _compose_groups.cache_clear()
        _hydra_compose.cache_clear()


@lru_cache(maxsize=1)
def _register_backend_groups() -> None:
    """Backends without a yaml file under configs/backend/ get their group from their config class."""
    from hydra.core.config_store import ConfigStore

    from pdmctl.backends.registry import BACKENDS

    store = ConfigStore.instance()
    for name, backend in BACKENDS.items():
        if not (config_dir() / "backend" / f"{name}.yaml").exists():
            store.store(group="backend", name=name, node={"name": name, **backend.defaults()})


@lru_cache(maxsize=1)
def _config_groups() -> frozenset[str]:
    return frozenset(p.name for p in config_dir().iterdir() if p.is_dir()) | {"backend"}


@lru_cache(maxsize=4096)
def _parse_one(override: str):
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        return OverridesParser.create().parse_override(override)
    except HydraException as exc:
        raise GridError(f"override {override!r}: malformed ({str(exc).splitlines()[0]})") from exc


def _parse(overrides: Iterable[str]) -> list:
    return [_parse_one(o) for o in overrides]


def _override_key(override: str) -> str:
    head = override.split("=", 1)[0]
    if "=" not in override and not head.startswith("~"):
        raise GridError(f"override {override!r}: malformed (expected key=value)")
    key = head.lstrip("+~")
    if not key:
        raise GridError(f"override {override!r}: malformed (no key before '=')")
    return key


def _expand_seeds(override: str) -> str:
    """`seeds=N` is N seeds 0..N-1; `seeds=a,b` or `seeds=[a,b]` are those seeds."""
    key, _, value = override.partition("=")
    if key.lstrip("+") != "seeds":
        return override
    value = value.strip().strip("[]")
    if re.fullmatch(r"\d+", value):
        if int(value) < 1:
            raise GridError(f"seeds: must be >= 1, got {value}")
        return f"seed=range(0,{int(value)})"
    if re.fullmatch(r"\d+(\s*,\s*\d+)*", value):
        return f"seed={value.replace(' ', '')}"
    raise GridError(f"seeds: expected a count or a list of integers, got {value!r}")


def _bare_deletes(override: str) -> str:
    """The sweeper writes `~key` as `~key=null`, which would delete only a null value."""
    return override.removesuffix("=null") if override.startswith("~") else override


def _unique(settings: list[dict[str, str]]) -> list[dict[str, str]]:
    seen, out = set(), []
    for s in settings:
        key = tuple(sorted(s.items()))
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def _one_line(exc: BaseException, overrides: Iterable[str]) -> str:
    """Hydra's messages are long and nested; keep the first line that says what is wrong."""
    text = str(exc).strip()
    match = re.search(r"Could not override '([^']+)'", text) or re.search(
        r"Key '([^']+)' is not in struct", text
    )
    if match:
        key = match.group(1)
        try:
            hint = _suggest_key(key, _default_keys())
        except GridError:  # the default config itself does not compose: no key to suggest
            hint = ""
        adds = f" (no such field in the run config; '+{key}=...' adds one)"
        return f"{key}: unknown key{hint or adds}"
    match = re.search(r"Could not find '([^']+)/([^']+)'", text)
    if match:
        group, option = match.groups()
        return f"{group}: unknown option {option!r}; choose from {', '.join(group_options(group))}"
    first = next((line for line in text.splitlines() if line.strip()), text)
    return f"overrides {' '.join(overrides)}: {first}"
