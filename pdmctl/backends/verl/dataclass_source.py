"""VeRL's config dataclasses as its source files declare them: read, never imported.

Importing any module of VeRL runs `verl/__init__.py`, which imports torch, Ray and VeRL's plugins (pdmctl's
among them): seconds of CPU, where a sweep's check needs a few fields' names and types. The fields are in
the source: each class is found in the module the target names, or through that module's `from ... import`
statements (star imports included), its dataclass bases' fields first, as `dataclasses.fields` orders them.

A field's type is its annotation evaluated over the builtins and `typing`'s names; a name that VeRL defines
(a nested config class, an enum, an alias) stays a class of that name that OmegaConf cannot type, so such a
field is checked as its default's kind (`schema._check_like`), not against VeRL's type.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib.util
import typing
from pathlib import Path
from typing import Any

PACKAGE = "verl"
_MAX_DEPTH = 12  # imports followed, bases climbed: VeRL's run a few deep


def fields(target: str) -> dict[str, Any] | None:
    """The fields of `target` ("verl.workers.config.RolloutConfig") and their types; None where VeRL is not
    installed, the class is not found or is not a dataclass."""
    module, _, name = target.rpartition(".")
    found = _find_class(module, name, 0)
    return None if found is None else _dataclass_fields(*found, 0)


@functools.lru_cache(maxsize=1)
def _root() -> Path | None:
    spec = importlib.util.find_spec(PACKAGE)  # a top-level name: looked up, not imported
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _module_file(module: str) -> Path | None:
    parts = module.split(".")
    root = _root()
    if root is None or parts[0] != PACKAGE:
        return None
    base = root.joinpath(*parts[1:])
    return next((p for p in (base / "__init__.py", base.with_suffix(".py")) if p.is_file()), None)


@functools.lru_cache(maxsize=256)
def _parse(module: str) -> ast.Module | None:
    path = _module_file(module)
    if path is None:
        return None
    try:
        return ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None


def _source_of(module: str, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` of `module` reads."""
    if node.level == 0:
        return node.module or ""
    path = _module_file(module)
    package = module.split(".") if path is not None and path.name == "__init__.py" else module.split(".")[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join([*package, *([node.module] if node.module else [])])


@functools.lru_cache(maxsize=1024)
def _find_class(module: str, name: str, depth: int) -> tuple[str, ast.ClassDef] | None:
    """The module that defines class `name` as `module` sees it, and its definition."""
    tree = _parse(module)
    if tree is None or depth > _MAX_DEPTH:
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return module, node
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name == "*" or (alias.asname or alias.name) == name:
                    wanted = name if alias.name == "*" else alias.name
                    found = _find_class(_source_of(module, node), wanted, depth + 1)
                    if found is not None:
                        return found
    return None


def _is_dataclass_decorator(node: ast.expr) -> bool:
    target = node.func if isinstance(node, ast.Call) else node
    return (isinstance(target, ast.Name) and target.id == "dataclass") or (
        isinstance(target, ast.Attribute) and target.attr == "dataclass"
    )


def _dataclass_fields(module: str, cls: ast.ClassDef, depth: int) -> dict[str, Any] | None:
    """Its bases' fields (the last base's first, as the MRO reversed), then its own; None: not a dataclass."""
    out: dict[str, Any] = {}
    is_dataclass = any(_is_dataclass_decorator(d) for d in cls.decorator_list)
    for base in reversed(cls.bases):
        name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)  # Name, or module.Name
        found = _find_class(module, name, 0) if name and depth < _MAX_DEPTH else None
        inherited = _dataclass_fields(*found, depth + 1) if found is not None else None
        if inherited is not None:
            is_dataclass = True
            out.update(inherited)
    if not is_dataclass:
        return None
    if any(_is_dataclass_decorator(d) for d in cls.decorator_list):
        for node in cls.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                text = ast.unparse(node.annotation)
                if not text.split("[")[0].endswith(("ClassVar", "InitVar")):
                    out[node.target.id] = _hint(text)
    return out


class _Names(dict):
    """The names an annotation is evaluated over: the builtins, `typing` and its names, then a class of its own
    name for any other."""

    def __missing__(self, key: str) -> Any:
        if key in builtins.__dict__:
            return builtins.__dict__[key]
        if key == "typing":
            return typing
        return getattr(typing, key) if hasattr(typing, key) else type(key, (), {})


@functools.lru_cache(maxsize=1024)
def _hint(text: str) -> Any:
    try:
        # the installed package's own text, which importing it would run
        return eval(text, {"__builtins__": builtins.__dict__}, _Names())
    except Exception:  # an attribute of an unknown name (torch.dtype), a subscript it does not take
        return type(text, (), {})
