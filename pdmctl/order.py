"""The array's order: which runs a sweep submits first (grid.ORDERS).

"answers" (the default) runs replicate 0 (each arm's lowest seed) of every setting before replicate 1, and
inside a replicate one setting at a time, all its arms together, the cheapest setting first (a sweep file's
`priority:` first, where it names one): every setting's first complete comparison comes as early as its own
runs allow, and a sweep stopped after a replicate still holds complete paired comparisons of every arm.
"seed" is replicate by replicate with the settings taking turns arm by arm; "setting" one run of each setting,
then the rest in grid order. A setting is a backend's engine path (VeRL's model, precision and strategy; the
testbed's preset), its arms the runs of one replicate that differ in the rest (mask, δ, K, ...).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from pdmctl.spec import RunSpec, SpecError


def order_runs(specs: Sequence[RunSpec], order: str = "answers", run_seconds: Mapping[str, float] | None = None,
               priority: Sequence[str] = ()) -> list[RunSpec]:
    """The runs in array order. `run_seconds`: each run's expected time (the cost model's), which ranks the
    settings for "answers" (a setting without one for every run goes after those with, in grid order);
    `priority`: `key=value` items of a sweep file's `priority:`, the settings whose runs match the first
    one first, and so on."""
    if order == "setting":
        return settings_first(specs)
    if order == "seed":
        return seed_major(specs)
    if order != "answers":
        raise ValueError(f"order: unknown {order!r}")
    return answers_first(specs, run_seconds or {}, priority)


def setting_of(spec: RunSpec) -> str:
    """A run's setting as the plan names it: `backend: its engine path`."""
    from pdmctl.backends.registry import flat_config, get_backend

    return f"{spec.backend}: {get_backend(spec.backend).setting(flat_config(spec.config))}"


def answers_first(specs: Sequence[RunSpec], run_seconds: Mapping[str, float],
                  priority: Sequence[str] = ()) -> list[RunSpec]:
    """Replicate by replicate; inside one, setting by setting (all its arms together), ranked by `priority`,
    then by the expected time of one replicate of the setting (its arms' times summed), then grid order."""
    replicate_of = replicates(specs)
    setting = {spec.key: setting_of(spec) for spec in specs}
    first_position: dict[str, int] = {}
    seconds: dict[str, float | None] = {}
    rank: dict[str, int] = {}
    for position, spec in enumerate(specs):
        name = setting[spec.key]
        first_position.setdefault(name, position)
        if replicate_of[spec.key] == 0:
            known, have = seconds.get(name, 0.0), run_seconds.get(spec.key)
            seconds[name] = None if known is None or have is None else known + have
        matched = [i for i, item in enumerate(priority) if _matches(spec, item)]
        rank[name] = min(rank.get(name, len(priority)), *matched, len(priority))
    missing = [item for item in priority if not any(_matches(spec, item) for spec in specs)]
    if missing:
        raise SpecError(f"priority: no run of the sweep has {missing[0]} (a setting's key=value, as in its config)")

    def key(item: tuple[int, RunSpec]) -> tuple:
        position, spec = item
        name = setting[spec.key]
        cost = seconds.get(name)
        return (replicate_of[spec.key], rank[name], cost is None, cost or 0.0, first_position[name], position)

    return [spec for _, spec in sorted(enumerate(specs), key=key)]


def _matches(spec: RunSpec, item: str) -> bool:
    """A run matches `key=value` where its flat config's `key` reads `value` (`model=qwen3-4b-base`)."""
    from pdmctl.backends.registry import flat_config

    key, _, value = item.partition("=")
    flat = flat_config(spec.config)
    return key in flat and _text(flat[key]) == value


def _text(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def check_priority(items: Any, where: str) -> tuple[str, ...]:
    """A sweep file's `priority:`: a list of `key=value` texts (else SpecError naming the first bad one)."""
    if isinstance(items, str):
        items = [items]
    if not isinstance(items, list) or not items:
        raise SpecError(f"{where}: a list of key=value items (model=qwen3-4b-base), got {items!r}")
    for item in items:
        if not isinstance(item, str) or "=" not in item or not item.split("=", 1)[0].strip():
            raise SpecError(f"{where}: {item!r} is not key=value (model=qwen3-4b-base)")
    return tuple(item.replace(" ", "") for item in items)


def seed_major(specs: Sequence[RunSpec]) -> list[RunSpec]:
    """The runs in array order, replicate by replicate: replicate 0 (each arm's lowest seed) of every arm of
    every setting, then replicate 1, ... An arm is a run's config but its seed; a run's replicate is its
    seed's rank among its arm's seeds. Within a replicate, settings take turns (the first arm of each setting,
    then the second of each, ...), so the array still starts with one run of each setting, and a sweep stopped
    after replicate r holds r + 1 complete paired comparisons of every arm of every setting."""
    replicate_of = replicates(specs)
    setting_index: dict[str, int] = {}
    turn: Counter = Counter()  # (replicate, setting) -> runs of that setting already placed in that replicate
    keyed = []
    for position, spec in enumerate(specs):
        setting = setting_of(spec)
        replicate = replicate_of[spec.key]
        index = setting_index.setdefault(setting, len(setting_index))
        keyed.append(((replicate, turn[(replicate, setting)], index, position), spec))
        turn[(replicate, setting)] += 1
    return [spec for _, spec in sorted(keyed, key=lambda item: item[0])]


def replicates(specs: Sequence[RunSpec]) -> dict[str, int]:
    """run key -> its replicate: its seed's rank among the seeds of its arm (its config but the seed)."""
    arms: dict[str, set[int]] = defaultdict(set)
    arm_of = {}
    for spec in specs:
        arm_of[spec.key] = json.dumps({k: v for k, v in spec.config.items() if k != "seed"}, sort_keys=True)
        arms[arm_of[spec.key]].add(spec.seed)
    ranks = {arm: {seed: rank for rank, seed in enumerate(sorted(seeds))} for arm, seeds in arms.items()}
    return {spec.key: ranks[arm_of[spec.key]][spec.seed] for spec in specs}


def describe_order(specs: Sequence[RunSpec], order: str) -> str:
    """The dry run's line on the array's order (the runs as `order_runs` placed them)."""
    if order == "setting":
        return ("order: setting: one run of each setting, then the rest setting by setting in grid order "
                "(--order answers: replicate by replicate, setting by setting, cheapest first)")  # fmt: skip
    replicate_of = replicates(specs)
    spans: list[tuple[int, int, int]] = []  # (replicate, first, last), 1-based positions
    for i, spec in enumerate(specs, 1):
        r = replicate_of[spec.key]
        if spans and spans[-1][0] == r:
            spans[-1] = (r, spans[-1][1], i)
        else:
            spans.append((r, i, i))
    parts = []
    for r, a, b in spans:
        runs = f"runs {a}-{b}" if a != b else f"run {a}"
        parts.append(f"{runs} are replicate 0 (each arm's lowest seed)" if r == 0 else f"{runs} replicate {r}")
    shown = ", ".join(parts)
    inside = ("inside a replicate one setting at a time, all its arms together, the cheapest first"
              if order == "answers" else "inside a replicate the settings take turns, arm by arm")  # fmt: skip
    return (f"order: {order}: {shown}; {inside}; a prefix that ends a replicate holds complete paired comparisons "
            "of every arm of every setting")  # fmt: skip


def settings_first(specs: Sequence[RunSpec]) -> list[RunSpec]:
    """The runs in array order: one run of each setting first (a backend's engine path: VeRL's model,
    precision and strategy), then the rest in grid order, so that every path starts on the first day."""
    seen: set[str] = set()
    first, rest = [], []
    for spec in specs:
        setting = setting_of(spec)
        (rest if setting in seen else first).append(spec)
        seen.add(setting)
    return first + rest
