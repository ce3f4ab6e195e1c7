"""Masks, testbed model presets and testbed data sets from other installed packages: entry points.

A package adds one without touching pdmctl by declaring an entry point in its own `pyproject.toml`:

    [project.entry-points."pdmctl.masks"]
    mine = "my_masks:MASK"            # a MaskPlugin whose name is "mine"

(`pdmctl.models`: a ModelPlugin, `pdmctl.data`: a DataPlugin; docs/EXTENDING.md walks through one). Its name
becomes an option of the config group (`mask=mine`, `model=...`, `data=...`), composed from the node the plugin
gives; a mask's name is also its method (`mask.method: mine`, a new entry of `pdmctl.masks.METHODS`).

Finding the plugins reads the installed packages' metadata only. A plugin's module is imported when a
sweep or a run names it, in each process that needs it (the sweep, the job, VeRL's workers), so a plugin that
fails to import stops only the sweeps that name it; built-in masks, presets and data sets never load one.
Refused, in one line naming the plugin (`PluginError`, exit code 2 at the command line): a plugin named like a
built-in (a method of `masks.METHODS`, a shipped `configs/<group>/` file, a testbed preset), one that does not
import, one that is not the kind its group takes, a node that is not a valid option of its group, and a keep
decision that does not return one bool per token (checked on four probe tokens when the plugin loads, and on
every call in training).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

GROUPS = {"mask": "pdmctl.masks", "model": "pdmctl.models", "data": "pdmctl.data"}  # config group -> entry points
LOSSES = ("masked", "clipped")  # pdmctl's token losses (masks.token_loss): DPPO's and PDM's, or GRPO's PPO clip
MASK_FIELDS = ("name", "method", "divergence", "estimator", "eps_low", "eps_high", "ratio_cap", "loss_agg_mode")
Node = Mapping[str, Any] | str | os.PathLike | None  # a config node, or a YAML file that holds it


class PluginError(ValueError):
    """A plugin that cannot be used; the message is one line naming it."""


@dataclass(frozen=True)
class MaskPlugin:
    """A trust-region mask. `keep(t)` takes `pdmctl.masks.MaskInputs` (per token, float64 [N]: advantages A,
    ratio r, divergence D, ddot Ḋ, delta δ (δ_low where A < 0); eps_low, eps_high, ratio_cap) and returns a
    bool tensor [N], True where the token's gradient is kept. D and Ḋ are computed for every method, with the
    run's divergence and estimator; `uses_divergence` and `uses_ddot` say which the decision reads (a mask
    without Ḋ drops the estimator from its run key, as DPPO's does). `loss`: "masked" (DPPO's and PDM's
    −A · sg(min(r, C)) · M · log π_k) or "clipped" (VeRL's PPO clip, GRPO's, with the mask where it has no
    gradient). `config`: the mask group's node (`mask=<name>`), or a YAML file holding it; fields it leaves
    out are the shipped `pdm_agg`'s."""

    name: str
    keep: Callable[[Any], Any]
    uses_divergence: bool = True
    uses_ddot: bool = True
    loss: str = "masked"
    config: Node = None


@dataclass(frozen=True)
class ModelPlugin:
    """A testbed model preset (`pdmctl.backends.toy.presets.ModelPreset`, or its LLMPreset and ForkPreset).
    Its base model is `weights` (a file as `python -m pdmctl.backends.toy.rebuild_base --preset NAME` writes
    it), checked against `sha256`; without weights, the warm-up's, built on first use and cached on the
    machine (as PDMCTL_TOY_BASE=warmup builds the shipped presets'). `config`: the model group's node
    (default: name and `backend: toy`)."""

    name: str
    preset: Any
    weights: str | os.PathLike | None = None
    sha256: str | None = None
    config: Node = None


@dataclass(frozen=True)
class DataPlugin:
    """A testbed data set: `task`, a `pdmctl.backends.toy.tasks.Task` (its training problems, held-out sets
    `eval_sets` and grader) in the token layout of the built-in task `base_task` ("addition": toy-small's,
    "chain": toy-llm's, "fork": toy-fork's), which the run's model must have. `config`: the data group's node
    (default: name and `eval:` the task's held-out sets, the columns avg@16 averages). Without a task, a node
    only (the names of a VeRL data set's files), which the testbed refuses."""

    name: str
    task: Any = None
    base_task: str = "addition"
    config: Node = None


KINDS: dict[str, type] = {"mask": MaskPlugin, "model": ModelPlugin, "data": DataPlugin}


@dataclass(frozen=True)
class Loaded:
    plugin: Any
    node: dict[str, Any]  # its config group's node, as `mask=<name>` composes it
    where: str  # how errors name it: `mask plugin 'mine' (my_masks:MASK in my-masks 0.1)`


_LOADED: dict[tuple[str, str], Loaded] = {}


# ---------------------------------------------------------------------------
# Finding them (metadata only)
# ---------------------------------------------------------------------------


def names(group: str) -> set[str]:
    """The installed plugins' names in a config group (empty for a group plugins do not extend), without
    importing any; PluginError where one is named like a built-in option of the group."""
    if group not in GROUPS:
        return set()
    found = set(_entry_points(GROUPS[group], tuple(sys.path)))
    for name in sorted(found):
        _refuse_builtin(group, name, _where(group, name), methods=False)  # masks' methods: at load (torch)
    return found


@lru_cache(maxsize=16)
def _entry_points(entry_group: str, path: tuple[str, ...]) -> dict[str, Any]:
    """name -> entry point, once per search path (a grid of 1,000 runs lists the options for each)."""
    from importlib import metadata

    out: dict[str, Any] = {}
    for ep in metadata.entry_points(group=entry_group):
        seen = out.get(ep.name)
        if seen is not None and (seen.value, _dist(seen)) != (ep.value, _dist(ep)):
            raise PluginError(f"{entry_group} plugin {ep.name!r}: declared twice, by {_dist(seen)} ({seen.value}) "
                              f"and {_dist(ep)} ({ep.value}); uninstall one")  # fmt: skip
        out[ep.name] = ep
    return out


def _dist(ep: Any) -> str:
    dist = getattr(ep, "dist", None)
    return f"{dist.name} {dist.version}" if dist is not None else "an unnamed package"


def _where(group: str, name: str) -> str:
    ep = _entry_points(GROUPS[group], tuple(sys.path)).get(name)
    return f"{group} plugin {name!r}" + (f" ({ep.value} in {_dist(ep)})" if ep is not None else "")


def _refuse_builtin(group: str, name: str, where: str, methods: bool = True) -> None:
    """A plugin may not take a built-in's name: `mask=pdm_agg` would then mean two things."""
    from pdmctl.resources import package_dir

    shipped = (package_dir("configs") / group / f"{name}.yaml").is_file()
    builtin = shipped or (group == "mask" and methods and name in _builtin_methods()) or (
        group == "model" and name in _builtin_presets())  # fmt: skip
    if builtin:
        raise PluginError(f"{where}: {name!r} is the name of a built-in {group}; rename the plugin "
                          "(its entry point's name and its own), or uninstall it")  # fmt: skip


def _builtin_methods() -> set[str]:
    from pdmctl import masks

    return set(masks.METHODS) - {name for group, name in _LOADED if group == "mask"}


def _builtin_presets() -> set[str]:
    from pdmctl.backends.toy.presets import MODEL_PRESETS

    loaded = {name for group, name in _LOADED if group == "model"}
    return set(MODEL_PRESETS) - loaded


# ---------------------------------------------------------------------------
# Loading one (its module imported, its parts registered)
# ---------------------------------------------------------------------------


def load(group: str, name: object) -> Loaded | None:
    """The plugin `name` of a config group, imported and registered once per process; None where no installed
    package declares one (a built-in name, or a typo the caller reports)."""
    if group not in GROUPS or not isinstance(name, str):
        return None
    if (group, name) in _LOADED:
        return _LOADED[(group, name)]
    ep = _entry_points(GROUPS[group], tuple(sys.path)).get(name)
    if ep is None:
        return None
    where = _where(group, name)
    _refuse_builtin(group, name, where)
    try:
        plugin = ep.load()
    except (Exception, SystemExit) as exc:  # ImportError, a SyntaxError, whatever its module raises, exit() too
        raise PluginError(f"{where}: does not import: {_first_line(exc)}") from exc
    kind = KINDS[group]
    if not isinstance(plugin, kind):
        raise PluginError(f"{where}: is a {type(plugin).__name__}, not a pdmctl.plugins.{kind.__name__}")
    if plugin.name != name:
        raise PluginError(f"{where}: names itself {plugin.name!r}; its entry point and its name must agree")
    node = _node(group, plugin, where)
    {"mask": _install_mask, "model": _install_model, "data": _install_data}[group](plugin, where)
    _store(group, name, node)
    loaded = _LOADED[(group, name)] = Loaded(plugin, node, where)
    return loaded


def load_all(group: str) -> list[str]:
    """Every installed plugin of a group loaded (VeRL's loss registry takes every mask); what could not be,
    one line each (the run that names one is refused with it)."""
    problems = []
    try:
        found = sorted(_entry_points(GROUPS[group], tuple(sys.path)))
    except PluginError as exc:
        return [str(exc)]
    for name in found:
        try:
            load(group, name)
        except PluginError as exc:
            problems.append(str(exc))
    return problems


def loaded(group: str, name: object) -> bool:
    """Whether `name` is a plugin of `group` this process has loaded."""
    return (group, name) in _LOADED


def config_node(group: str, option: object) -> dict[str, Any] | None:
    """The node `group=option` composes when `option` is a plugin's (a copy), else None."""
    loaded = load(group, option)
    return None if loaded is None else {**loaded.node}


def testbed_task(name: str) -> Any:
    """The testbed task of data set `name` (a DataPlugin's; None for one without a task)."""
    loaded = load("data", name)
    return None if loaded is None else loaded.plugin.task


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _store(group: str, name: str, node: dict[str, Any]) -> None:
    """Hydra's config store knows the node too, for a composition that goes through Hydra itself."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group=group, name=name, node=node)


# ---------------------------------------------------------------------------
# The config nodes
# ---------------------------------------------------------------------------


def _given(node: Node, where: str) -> dict[str, Any]:
    if node is None:
        return {}
    if isinstance(node, Mapping):
        return dict(node)
    if isinstance(node, str | os.PathLike):
        from pdmctl.yamlfiles import YamlRefused, read_text, safe_load

        path = Path(node)
        try:
            data = safe_load(read_text(path, f"{where}: config", PluginError), path)
        except YamlRefused as exc:
            raise PluginError(f"{where}: config: {exc}") from None
        if not isinstance(data, Mapping):
            raise PluginError(f"{where}: config {path}: holds no mapping")
        return dict(data)
    raise PluginError(f"{where}: config: a mapping or a YAML file's path, got {type(node).__name__}")


def _node(group: str, plugin: Any, where: str) -> dict[str, Any]:
    given = _given(plugin.config, where)
    if group == "mask":
        from pdmctl.resources import package_dir
        from pdmctl.yamlfiles import safe_load

        base_file = package_dir("configs") / "mask" / "pdm_agg.yaml"
        base = safe_load(base_file.read_text(), base_file)
        node = {**base, "name": plugin.name, "method": plugin.name, **given}
        allowed = MASK_FIELDS
    elif group == "model":
        node, allowed = {"name": plugin.name, "backend": "toy", **given}, None
        if node["backend"] != "toy":
            raise PluginError(f"{where}: config: backend {node['backend']!r}; a plugin's preset runs on the "
                              "testbed (backend: toy)")  # fmt: skip
    else:
        eval_sets = list(getattr(plugin.task, "eval_sets", None) or [])
        node, allowed = {"name": plugin.name, **({"eval": eval_sets} if eval_sets else {}), **given}, None
        if not isinstance(node.get("eval"), list) or not node["eval"]:
            raise PluginError(f"{where}: config: give `eval:`, the held-out sets avg@16 averages")
    unknown = sorted(set(node) - set(allowed)) if allowed else []
    if unknown:
        raise PluginError(f"{where}: config: unknown field {unknown[0]!r}; a mask's fields: {', '.join(allowed)}")
    for field in ("name", "method"):
        if field in node and node[field] != plugin.name and (field == "name" or group == "mask"):
            raise PluginError(f"{where}: config: {field} is {node[field]!r}, and must be the plugin's name")
    return node


# ---------------------------------------------------------------------------
# Registering the parts
# ---------------------------------------------------------------------------


def _install_mask(plugin: MaskPlugin, where: str) -> None:
    from pdmctl import masks

    if plugin.loss not in LOSSES:
        raise PluginError(f"{where}: loss {plugin.loss!r}; choose from {', '.join(LOSSES)}")
    if not callable(plugin.keep):
        raise PluginError(f"{where}: keep is a {type(plugin.keep).__name__}, not a function")
    masked = _masked(plugin, where)
    masked(_probe())  # a keep decision of the wrong kind is refused here, before any run
    masks.register_method(plugin.name, uses_divergence=bool(plugin.uses_divergence), uses_ddot=bool(plugin.uses_ddot),
                          clipped_surrogate=plugin.loss == "clipped")(masked)  # fmt: skip


def _masked(plugin: MaskPlugin, where: str) -> Callable[[Any], Any]:
    """masks' method function: True where the gradient is dropped, from the plugin's keep decision."""
    import torch

    def masked(t: Any) -> Any:
        n = t.advantages.shape[0]
        try:
            keep = plugin.keep(t)
        except (Exception, SystemExit) as exc:
            raise PluginError(f"{where}: keep raised {_first_line(exc)} (on {n} tokens)") from exc
        if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool or tuple(keep.shape) != (n,):
            got = (f"{keep.dtype} of shape {tuple(keep.shape)}" if isinstance(keep, torch.Tensor)
                   else type(keep).__name__)  # fmt: skip
            raise PluginError(f"{where}: keep returned {got}; it must return a torch.bool tensor of shape "
                              f"({n},), one decision per token")  # fmt: skip
        return ~keep

    masked.__name__ = f"plugin_{plugin.name}"
    return masked


def _probe() -> Any:
    """Four tokens, one of each kind a mask decides on: inside the region, out of it with the directions
    agreeing, disagreeing, and A = 0."""
    import torch

    from pdmctl import masks

    def f64(*values: float) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float64)

    return masks.MaskInputs(advantages=f64(1.0, -1.0, 1.0, 0.0), ratio=f64(1.0, 0.7, 1.3, 1.0),
                            divergence=f64(0.01, 0.3, 0.3, 0.2), ddot=f64(0.1, 0.2, -0.2, 0.05),
                            delta=f64(0.15, 0.15, 0.15, 0.15), eps_low=0.2, eps_high=0.28, ratio_cap=10.0)  # fmt: skip


def _install_model(plugin: ModelPlugin, where: str) -> None:
    from pdmctl.backends.toy import presets, shipped

    if not isinstance(plugin.preset, presets.ModelPreset):
        raise PluginError(f"{where}: preset is a {type(plugin.preset).__name__}, not a "
                          "pdmctl.backends.toy.presets.ModelPreset")  # fmt: skip
    if plugin.weights is not None:
        digest = str(plugin.sha256 or "")
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise PluginError(f"{where}: weights need their sha256 (64 hex digits), got {plugin.sha256!r}")
        shipped.PLUGIN_WEIGHTS[plugin.name] = Path(plugin.weights)
        shipped.SHIPPED_SHA256[plugin.name] = digest
    presets.MODEL_PRESETS[plugin.name] = plugin.preset


def _install_data(plugin: DataPlugin, where: str) -> None:
    if plugin.task is None:
        return
    from pdmctl.backends.toy.tasks import TASKS, Task

    if not isinstance(plugin.task, Task):
        raise PluginError(f"{where}: task is a {type(plugin.task).__name__}, not a pdmctl.backends.toy.tasks.Task")
    if plugin.base_task not in TASKS:
        raise PluginError(f"{where}: base_task {plugin.base_task!r}; choose from {', '.join(sorted(TASKS))}")
    if plugin.task.max_response_len != TASKS[plugin.base_task].max_response_len:
        raise PluginError(f"{where}: its task's responses are {plugin.task.max_response_len} tokens, and "
                          f"{plugin.base_task!r}'s {TASKS[plugin.base_task].max_response_len}")  # fmt: skip
