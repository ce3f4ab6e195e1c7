"""Search spaces in Hydra's override grammar -> Optuna distributions, as hydra-optuna-sweeper reads them.

    delta=interval(0.02,0.3)                  FloatDistribution(0.02, 0.3)
    backend.lr=tag(log,interval(1e-4,3e-3))   FloatDistribution(1e-4, 3e-3, log=True)
    k=int(interval(10,50))                    IntDistribution(10, 50)  (or interval(10,50) on an int field)
    k=range(10,60,10)                         IntDistribution(10, 50, step=10)
    k=choice(10,20,50)  mask=pdm_agg,pdm_uni  CategoricalDistribution

Overrides without a sweep are fixed settings of every trial. Hydra's own parser
reads them; a trial's parameters go back into overrides (`delta=0.1234`) and
through the grid's composition, so a trial's config is exactly what `pdmctl
sweep` would build from the same overrides.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdmctl.grid import GridError, _hydra, _parse_one, compose, expand_globs
from pdmctl.spec import RunSpec

CategoricalValue = str | int | float | bool | None


@dataclass(frozen=True)
class Param:
    """One searched setting: its override key (with any `+`/`++` prefix) and its Optuna distribution."""

    prefix: str
    name: str
    distribution: Any  # optuna.distributions.BaseDistribution

    def override(self, value: Any) -> str:
        return f"{self.prefix}{self.name}={hydra_literal(value)}"


@dataclass(frozen=True)
class SearchSpace:
    params: tuple[Param, ...]
    fixed: tuple[str, ...]  # overrides every trial carries

    @property
    def distributions(self) -> dict[str, Any]:
        return {p.name: p.distribution for p in self.params}

    def overrides(self, values: Mapping[str, Any]) -> list[str]:
        return [*self.fixed, *(p.override(values[p.name]) for p in self.params)]

    def specs(self, sweep: str, values: Mapping[str, Any], seeds: int) -> list[RunSpec]:
        """The trial's runs: its config with seed 0..seeds-1 (inside `hydra_session()`)."""
        base = self.overrides(values)
        if seeds == 1:
            return [RunSpec.from_config(sweep, compose(base))]
        return [RunSpec.from_config(sweep, compose([*base, f"seed={s}"])) for s in range(seeds)]

    def describe(self) -> list[tuple[str, str]]:
        return [(p.name, describe(p.distribution)) for p in self.params]


def hydra_session() -> _hydra:
    """Hydra's global state for composing trial configs (one per driver: composition is cached)."""
    return _hydra()


def hydra_literal(value: Any) -> str:
    """A value as the override grammar reads it back unchanged (repr keeps every digit of a float)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        from hydra.core.override_parser.types import Transformer

        return Transformer.encode(value)
    return str(value)


def parse_space(overrides: Sequence[str]) -> SearchSpace:
    """Split overrides into searched parameters and fixed settings; raise GridError (one line) on bad input."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    searched: list[tuple[str, Any]] = []
    fixed: list[str] = []
    seen: set[str] = set()
    for text in expand_globs(overrides):  # `mask=glob(pdm_*)`: a choice among the options it matches
        override = _parse_one(text)
        key = override.key_or_group
        if key in seen:
            raise GridError(f"{key}: given twice")
        seen.add(key)
        if not override.is_sweep_override():
            fixed.append(text)
            continue
        if override.is_delete():
            raise GridError(f"{text}: a deletion cannot be searched")
        searched.append((text, override))
    if not searched:
        raise GridError("tune: nothing to search; give at least one interval(...), choice(...) or range(...)")

    with _hydra():
        base = compose(fixed + [Param(_prefix(t), o.key_or_group, None).override(next(iter(o.sweep_iterator())))
                                for t, o in searched if o.is_choice_sweep()])  # fmt: skip
        params = []
        for text, override in searched:
            key, prefix = override.key_or_group, _prefix(text)
            value = override.value()
            if override.is_choice_sweep():
                choices = tuple(override.sweep_iterator())
                if len(set(map(repr, choices))) != len(choices):
                    raise GridError(f"{key}: choice(...) lists a value twice")
                dist = CategoricalDistribution(choices)
            else:
                current = _lookup(base, key, prefix)
                if isinstance(current, bool | str | dict | list):
                    what = (
                        "a config group" if isinstance(current, dict) else f"a {type(current).__name__} field"
                    )
                    raise GridError(f"{key}: {text.split('=', 1)[1]} needs a numeric field, {key} is {what}")
                is_int = isinstance(current, int)
                if override.is_range_sweep():
                    dist = _range(key, value, is_int, IntDistribution, FloatDistribution)
                else:
                    dist = _interval(key, value, is_int, IntDistribution, FloatDistribution)
            params.append(Param(prefix, key, dist))
        space = SearchSpace(tuple(params), tuple(fixed))
        for corner in _corners(space):  # every choice and both ends of every range compose and validate
            compose(space.overrides(corner))
    return space


def _prefix(override: str) -> str:
    return override[: len(override) - len(override.lstrip("+"))]


def _lookup(config: Mapping[str, Any], key: str, prefix: str) -> Any:
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            if prefix:  # `+key=interval(...)` adds a field: numeric by construction
                return 0.0
            raise GridError(f"{key}: unknown key (no such field in the run config)")
        node = node[part]
    return node


def _interval(key: str, sweep, is_int: bool, int_dist, float_dist):
    low, high, log = sweep.start, sweep.end, "log" in sweep.tags
    if not low < high:
        raise GridError(
            f"{key}: interval({low:g},{high:g}) is empty or inverted (the start must be below the end)"
        )
    if log and low <= 0:
        raise GridError(f"{key}: tag(log,...) needs a positive interval, got interval({low:g},{high:g})")
    if is_int:
        if not (float(low).is_integer() and float(high).is_integer()):
            raise GridError(
                f"{key}: an integer field; give interval(...) integer ends, got ({low:g},{high:g})"
            )
        return int_dist(int(low), int(high), log=log)
    return float_dist(float(low), float(high), log=log)


def _range(key: str, sweep, is_int: bool, int_dist, float_dist):
    start, stop, step = sweep.start, sweep.stop, sweep.step
    if step <= 0 or not start < stop:
        raise GridError(f"{key}: range({start:g},{stop:g},{step:g}) is empty or inverted")
    if all(float(v).is_integer() for v in (start, stop, step)):
        last = int(start) + (math.ceil((stop - start) / step) - 1) * int(step)
        return int_dist(int(start), last, step=int(step))
    if is_int:
        raise GridError(f"{key}: an integer field; give range(...) integer bounds")
    n = math.ceil((stop - start) / step)
    return float_dist(float(start), float(start + (n - 1) * step), step=float(step))


def _corners(space: SearchSpace) -> list[dict[str, Any]]:
    """Parameter sets that between them show every choice and both ends of every range."""
    first = {p.name: _ends(p.distribution)[0] for p in space.params}
    corners = [first]
    for p in space.params:
        corners += [{**first, p.name: v} for v in _ends(p.distribution)[1:]]
    return corners


def _ends(distribution) -> list[Any]:
    from optuna.distributions import CategoricalDistribution

    if isinstance(distribution, CategoricalDistribution):
        return list(distribution.choices)
    return [distribution.low, distribution.high]


def describe(distribution) -> str:
    from optuna.distributions import CategoricalDistribution

    if isinstance(distribution, CategoricalDistribution):
        return f"choice({', '.join(map(str, distribution.choices))})"
    kind = "int " if type(distribution).__name__ == "IntDistribution" else ""
    scale = " log" if distribution.log else ""
    step = f" step {distribution.step:g}" if distribution.step is not None else ""
    return f"{kind}[{distribution.low:g}, {distribution.high:g}]{scale}{step}"
