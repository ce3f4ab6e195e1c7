"""Named YAML files (sweeps/, clusters/, reports/): found by name or path, read with one-line errors.

Every YAML file pdmctl reads from a user goes through `safe_load`, or through `refuse_bomb` or
`refuse_bombs_under` ahead of a loader of its own (Hydra's, OmegaConf's): a file whose aliases expand to
more than MAX_EXPANSION nodes (a "billion laughs" of under 1 KB expands to a billion) is refused in one
line before anything is built from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

MAX_BYTES = 1 << 20  # a sweep file, report definition, cluster profile or config is a few KB
# The nodes that aliases may add to a file's own: the shipped files use no aliases, and a file that repeats
# a block by alias a thousand times stays far below it. Walking this many nodes takes well under a second.
MAX_EXPANSION = 100_000
MAX_DEPTH = 100  # levels of nesting: the shipped files nest a few; reading and walking the data recurses
# libyaml's composer first (fast), then PyYAML's own: its error messages, and whatever libyaml refuses
_LOADERS: tuple[type, ...] = (
    (yaml.CSafeLoader, yaml.SafeLoader) if getattr(yaml, "__with_libyaml__", False) else (yaml.SafeLoader,)
)


class YamlRefused(ValueError):
    """A YAML text that is not loaded; the message is one line, naming the file."""


def safe_load(text: str, name: object) -> Any:
    """`yaml.safe_load(text)`, with `text` read from `name`: YamlRefused in one line naming `name` for
    invalid YAML, for aliases that would expand past MAX_EXPANSION nodes or into themselves, and for
    nesting deeper than MAX_DEPTH.

    The text is composed first (linear in its length: an alias is the node it names, shared), the
    node graph checked, and only then constructed.
    """
    error: yaml.YAMLError | None = None
    for loader_class in _LOADERS:
        loader = loader_class(text)
        try:
            node = _compose(loader, name)
            if node is None:
                return None
            _check_expansion(node, name)
            return loader.construct_document(node)
        except yaml.YAMLError as exc:
            error = exc
        finally:
            loader.dispose()
    raise YamlRefused(f"{name} is not valid YAML: {str(error).splitlines()[0]}") from error


def refuse_bomb(text: str, name: object) -> None:
    """YamlRefused where `safe_load` would refuse `text`'s aliases; nothing for valid or invalid YAML
    otherwise (for a reader with a loader of its own, which reports its own errors)."""
    for loader_class in _LOADERS:
        loader = loader_class(text)
        try:
            node = _compose(loader, name)
        except yaml.YAMLError:
            continue
        finally:
            loader.dispose()
        if node is not None:
            _check_expansion(node, name)
        return


def read_text(path: Path, what: str, error: type[Exception]) -> str:
    """`path`'s UTF-8 text, of at most MAX_BYTES: else `error` in one line starting with `what`."""
    try:
        raw = _read_bounded(path)
    except OSError as exc:
        raise error(f"{what}: {path} cannot be read ({exc.strerror or exc})") from exc
    if raw is None:
        raise error(f"{what}: {path} is larger than {MAX_BYTES // 2**20} MiB (a {what} is a few KB)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        byte = raw[exc.start : exc.start + 1]
        raise error(f"{what}: {path} is not UTF-8 text (byte {exc.start}: {byte!r})") from exc


_SOUND: set[tuple[Path, int, int]] = set()  # (path, mtime, size) of the files `refuse_bombs_under` passed


def refuse_bombs_under(root: Path, what: str, error: type[Exception]) -> None:
    """`error` in one line starting with `what` for a `*.yaml` file under `root` over MAX_BYTES or whose
    aliases `safe_load` refuses: for a tree that a loader of its own reads (Hydra's builds all that
    aliases expand to). Each file is read once until it changes; one that cannot be read or is not valid
    YAML is left to that loader to report, if it reads it."""
    for path in sorted(root.rglob("*.yaml")):
        try:
            info = path.stat()
            key = (path, info.st_mtime_ns, info.st_size)
            if key in _SOUND or not path.is_file():
                continue
            raw = _read_bounded(path)
        except OSError:
            continue
        if raw is None:
            raise error(f"{what}: {path} is larger than {MAX_BYTES // 2**20} MiB (a {what} is a few KB)")
        try:
            refuse_bomb(raw.decode("utf-8", "replace"), path)
        except YamlRefused as exc:
            raise error(f"{what}: {exc}") from None
        _SOUND.add(key)


def _read_bounded(path: Path) -> bytes | None:
    """The bytes of `path`, or None when it holds more than MAX_BYTES (only one more is read)."""
    with path.open("rb") as fh:
        raw = fh.read(MAX_BYTES + 1)
    return None if len(raw) > MAX_BYTES else raw


def _compose(loader: Any, name: object) -> yaml.Node | None:
    try:
        return loader.get_single_node()
    except RecursionError:  # the composer recurses once per level
        raise YamlRefused(f"{name}: nests deeper than {MAX_DEPTH} levels") from None


def _check_expansion(root: yaml.Node, name: object) -> None:
    """YamlRefused when walking `root` with every alias expanded would visit more than MAX_EXPANSION nodes
    beyond the graph's own, or would never end (an alias inside the node it names), or when it nests deeper
    than MAX_DEPTH. The walk stops there."""
    seen: set[int] = set()
    inside: set[int] = set()  # the nodes the walk is in: an alias to one of them is a loop
    extra = 0
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, leaving = stack.pop()
        if leaving:
            inside.discard(id(node))
            continue
        if id(node) in inside:
            raise YamlRefused(f"{name}: an alias inside the node it names (a structure that contains itself)")
        if id(node) in seen:
            extra += 1
            if extra > MAX_EXPANSION:
                raise YamlRefused(f"{name}: alias expansion exceeds {MAX_EXPANSION:,} nodes (a YAML bomb?)")
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [child for pair in node.value for child in pair]
        else:
            continue
        inside.add(id(node))
        if len(inside) > MAX_DEPTH:
            raise YamlRefused(f"{name}: nests deeper than {MAX_DEPTH} levels")
        stack.append((node, True))
        stack.extend((child, False) for child in reversed(children))


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a name too long for the file system, a loop of links: not a file we can read
        return False


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    """` (did you mean 'x'?)` for the closest of `choices` to a mistyped `word`, else ''."""
    import difflib

    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


def load_named(
    name_or_path: str, directory: Path | Sequence[Path], what: str, error: type[Exception]
) -> tuple[Path, dict[str, Any]]:
    """`directory/NAME.yaml`, a bare NAME or file found there, or any path -> (path, mapping).

    `directory` may be a search path (a list of folders): the first that holds NAME wins.
    Every problem raises `error` with one line starting with `what`.
    """
    directories = [directory] if isinstance(directory, Path) else list(directory)
    path = Path(name_or_path)
    if not _is_file(path):
        candidates = [c for d in directories for c in (d / name_or_path, d / f"{name_or_path}.yaml")]
        path = next((c for c in candidates if _is_file(c)), path)
    if not _is_file(path):
        names = sorted({p.stem for d in directories for p in d.glob("*.yaml")})
        shown = name_or_path if len(name_or_path) <= 200 else f"{name_or_path[:200]}..."
        hint = did_you_mean(Path(name_or_path).stem, names) if len(name_or_path) <= 200 else ""
        try:
            is_dir, is_link = path.is_dir(), path.is_symlink()
        except OSError:  # a name too long for the filesystem: not found
            is_dir = is_link = False
        if is_dir:
            raise error(f"{what}: {shown!r} is a directory, not a YAML file")
        if is_link:
            raise error(f"{what}: {shown!r} is a link that leads to no file (broken, or a loop)")
        raise error(f"{what}: {shown!r} not found{hint} (known: {', '.join(names) or 'none'})")
    text = read_text(path, what, error)
    try:
        data = safe_load(text, path) or {}
    except YamlRefused as exc:
        raise error(f"{what}: {exc}") from exc
    if not isinstance(data, dict):
        raise error(f"{what}: {path} must be a mapping")
    return path, data
