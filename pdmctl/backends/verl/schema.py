"""VeRL's own config schema, read off the installed VeRL: the keys its trainer config has and each one's type.

A grid sets any VeRL key as `verl.<key>=<value>` (kept in the run config as `backend.verl`); before
anything is submitted, `check` holds each one against what VeRL ships:

* the key, against VeRL's trainer config flattened as `main_ppo` composes it
  (`verl/trainer/config/_generated_ppo_trainer.yaml`, and `_generated_ppo_megatron_trainer.yaml` for
  `model_engine=megatron`: VeRL generates both from its Hydra configs and checks them in its CI);
* a key that yaml leaves out, against the dataclass VeRL instantiates the node as (the nearest
  `_target_` above the key): one of its fields (VeRL then takes it with Hydra's `+`), or a key inside
  a field typed as an open mapping (`engine_kwargs.vllm.*`, `override_transformer_config.*`); any
  other key would fail on the allocation, at VeRL's instantiation or never be read;
* the value, against the type that dataclass gives the field (`RolloutConfig.gpu_memory_utilization:
  float`, through OmegaConf as VeRL converts it), else against the type of VeRL's default.

Nothing here imports VeRL: the yaml and the dataclasses are read from its files (`dataclass_source`; its
import takes torch and seconds); `check` needs it installed (the `[verl]` extra).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import typing
from collections.abc import Mapping
from typing import Any

from pdmctl.backends.verl.quoting import quoted

GENERATED_CONFIGS = {"dp": "_generated_ppo_trainer.yaml", "megatron": "_generated_ppo_megatron_trainer.yaml"}


class SchemaError(ValueError):
    """A VeRL key that VeRL's config does not have, or a value of the wrong type; one line."""


def check(key: str, value: Any, engine: str) -> bool:
    """Raise SchemaError for `verl.<key>=<value>` where VeRL would refuse or ignore it; return whether the key
    is in VeRL's yaml (a plain Hydra override) or only in its dataclasses or an open mapping (`+key`)."""
    try:
        return _check(key, value, engine)
    except SchemaError as exc:
        other = next(e for e in GENERATED_CONFIGS if e != engine)
        if "not in VeRL's config" in str(exc) and _declared(key, other):
            raise SchemaError(f"verl.{key}: a key of VeRL's {other} engine, and this run trains on {engine} "
                              f"(backend.strategy={'megatron' if other == 'megatron' else 'fsdp2'} changes it)") from None
        raise


def _declared(key: str, engine: str) -> bool:
    node: Any = _config(engine)
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _check(key: str, value: Any, engine: str) -> bool:
    name = f"verl.{key}"
    parts = key.split(".")
    if not all(part.strip() for part in parts):
        raise SchemaError(f"{name}: not a VeRL config key (empty part between dots)")
    node: Any = _config(engine)
    depth, owner = 0, None  # owner: (the dataclass VeRL instantiates a node as, the depth of its fields)
    while True:
        if isinstance(node, dict) and "_target_" in node:
            owner = (str(node["_target_"]), depth)
        if depth == len(parts) or not isinstance(node, dict) or parts[depth] not in node:
            break
        node, depth = node[parts[depth]], depth + 1
    declared = depth == len(parts)
    fields = _fields(owner[0]) if owner else None
    field = parts[owner[1]] if owner and owner[1] < len(parts) else None
    if declared:
        if owner and owner[1] == len(parts) - 1 and fields and field in fields:
            _check_typed(name, value, owner[0], field, default=node)
        else:
            _check_like(name, value, node)
        return True
    if owner and fields is not None:
        if field not in fields:
            raise SchemaError(_unknown(name, parts[owner[1]], [*fields, *(node if isinstance(node, dict) else ())],
                                       f"{_short(owner[0])} has no field {field!r}"))  # fmt: skip
        if owner[1] == len(parts) - 1:
            _check_typed(name, value, owner[0], field, default=None)
            return False
        if _open(owner[0], field):
            return False
        raise SchemaError(f"{name}: {_short(owner[0])}.{field} takes no key {'.'.join(parts[owner[1] + 1:])!r} "
                          "(not in VeRL's config)")  # fmt: skip
    if node is None or node == {}:  # a mapping VeRL leaves open: any key
        return False
    raise SchemaError(_unknown(name, parts[depth], list(node) if isinstance(node, dict) else [],
                               f"VeRL's config has no {'.'.join(parts[: depth + 1])}"))  # fmt: skip


def hydra_value(value: Any) -> str:
    """A value as Hydra's override grammar writes it, read back as the same value (strings quoted)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise SchemaError(f"{value}: not a finite number")
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    return quoted(value)


@functools.lru_cache(maxsize=4)
def _config(engine: str) -> dict[str, Any]:
    """VeRL's flattened trainer config for an engine (dp or megatron), unresolved, as plain data: read from
    the installed package's files, without importing VeRL (seconds: it imports torch)."""
    import importlib.util
    from pathlib import Path

    from omegaconf import OmegaConf

    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise SchemaError("verl.*: VeRL is not installed here, so its keys cannot be checked against its "
                          "config (pip install 'pdmctl[verl]')")  # fmt: skip
    from pdmctl.yamlfiles import YamlRefused, refuse_bomb

    path = Path(next(iter(spec.submodule_search_locations))) / "trainer" / "config" / GENERATED_CONFIGS[engine]
    try:
        refuse_bomb(path.read_text(encoding="utf-8"), path)  # OmegaConf's loader builds what aliases expand to
    except YamlRefused as exc:
        raise SchemaError(f"verl.*: VeRL's config {exc}") from None
    container = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    assert isinstance(container, dict)
    return container


@functools.lru_cache(maxsize=128)
def _fields(target: str) -> dict[str, Any] | None:
    """A VeRL config dataclass's fields and their type hints, read from VeRL's source without importing it
    (its import takes torch; `dataclass_source`). None: not a dataclass, or not found."""
    from pdmctl.backends.verl.dataclass_source import fields

    found = fields(target)
    return None if found is None else {name: hint for name, hint in found.items() if not name.startswith("_")}


def _open(target: str, field: str) -> bool:
    """Whether a dataclass field takes any key below it (dict, Mapping or Any, optionally None)."""
    hint = (_fields(target) or {}).get(field, Any)
    options = [a for a in typing.get_args(hint) if a is not type(None)] if _is_union(hint) else [hint]
    return any(h is Any or typing.get_origin(h) in (dict, Mapping) or h in (dict, Mapping) for h in options)


def _is_union(hint: Any) -> bool:
    import types

    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def field_schema(target: str, field: str):
    """An OmegaConf schema of one field of one of VeRL's config dataclasses, typed as VeRL types it
    (None where VeRL is not installed or OmegaConf cannot type the hint)."""
    hint = (_fields(target) or {}).get(field)
    return None if hint is None else _schema(target, field, hint)


@functools.lru_cache(maxsize=256)
def _schema(target: str, field: str, hint: Any):
    from omegaconf import MISSING, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.structured(dataclasses.make_dataclass(f"{_short(target)}_{field}", [(field, hint, MISSING)]))
    except (OmegaConfBaseException, TypeError, ValueError):
        return None


def _check_typed(name: str, value: Any, target: str, field: str, default: Any) -> None:
    if not check_field(name, value, target, field):
        _check_like(name, value, default)


def check_field(name: str, value: Any, target: str, field: str) -> bool:
    """SchemaError in one line when `value` does not fit VeRL's typed `target.field`; False when VeRL
    is not installed here or the field has no type to check against (nothing was checked)."""
    schema = field_schema(target, field)
    if schema is None:
        return False
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        OmegaConf.merge(schema, {field: value})
    except OmegaConfBaseException as exc:
        why = str(exc).splitlines()[0]
        raise SchemaError(f"{name}: {value!r} does not fit VeRL's {_short(target)}.{field} ({why})") from None
    return True


def _check_like(name: str, value: Any, default: Any) -> None:
    """A value of the kind VeRL's default is (where the default says: not null, not an interpolation)."""
    if default is None or (isinstance(default, str) and (default == "???" or "${" in default)):
        return
    number = isinstance(value, int | float) and not isinstance(value, bool)
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: number,
        str: isinstance(value, str) or number,
        list: isinstance(value, list),
        dict: isinstance(value, Mapping),
    }.get(type(default), True)
    if not ok:
        kind = {bool: "true or false", int: "a whole number", float: "a number", str: "a string",
                list: "a list", dict: "a mapping"}[type(default)]  # fmt: skip
        raise SchemaError(f"{name}: must be {kind} (VeRL's default is {default!r}), got {value!r}")


def _unknown(name: str, part: str, candidates: list[str], why: str) -> str:
    close = difflib.get_close_matches(part, [c for c in candidates if not c.startswith("_")], n=1)
    return f"{name}: not in VeRL's config ({why}{f'; did you mean {close[0]!r}?' if close else ''})"


def _short(target: str) -> str:
    return target.rsplit(".", 1)[-1]
