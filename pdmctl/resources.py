"""Where pdmctl's YAML lives: the config tree, sweep files, cluster profiles and report definitions.

Each kind is looked up along a search path, first match wins:

1. the working directory's own folder (`./configs`, `./sweeps`, `./clusters`, `./reports`);
2. the user's folder, `$XDG_CONFIG_HOME/pdmctl/<kind>` (default `~/.config/pdmctl/<kind>`);
3. the defaults shipped with pdmctl: in an installed wheel `pdmctl/_data/<kind>`, in a source checkout
   (an editable install) the repository's top-level folder.

`PDMCTL_CONFIG_DIR`, `PDMCTL_SWEEP_DIR`, `PDMCTL_CLUSTER_DIR` and `PDMCTL_REPORT_DIR` name one folder that
replaces the search. Named files (sweeps, clusters, reports) are found file by file along the path; the
config tree is taken whole from the first folder that holds its `run.yaml` (Hydra composes one tree).
`pdmctl init` copies the shipped defaults out for editing.
"""

from __future__ import annotations

import os
from pathlib import Path

KINDS = ("configs", "sweeps", "clusters", "reports")
ENV = {
    "configs": "PDMCTL_CONFIG_DIR",
    "sweeps": "PDMCTL_SWEEP_DIR",
    "clusters": "PDMCTL_CLUSTER_DIR",
    "reports": "PDMCTL_REPORT_DIR",
}
# the files of each kind that ship and that `pdmctl init` copies (reports/ also holds rendered reports)
PATTERNS = {"configs": "**/*.yaml", "sweeps": "*.yaml", "clusters": "*.yaml", "reports": "*.yaml"}
CONFIG_ROOT = "run.yaml"  # the file that makes a folder a config tree
_PACKAGE = Path(__file__).resolve().parent


def _check(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown resource kind {kind!r} (one of {', '.join(KINDS)})")


def package_dir(kind: str) -> Path:
    """The defaults shipped with pdmctl: the wheel's `pdmctl/_data/<kind>`, else the checkout's `<kind>/`."""
    _check(kind)
    bundled = _PACKAGE / "_data" / kind
    return bundled if bundled.is_dir() else _PACKAGE.parent / kind


def user_dir() -> Path:
    """The user's own pdmctl folder: `$XDG_CONFIG_HOME/pdmctl`, or `~/.config/pdmctl`."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base).expanduser() / "pdmctl"


def _cwd() -> Path | None:
    try:
        return Path.cwd()
    except OSError:  # the working directory was removed under us
        return None


def search_path(kind: str) -> list[Path]:
    """The folders searched for `kind`, first match wins (only folders that exist; no duplicates)."""
    _check(kind)
    override = os.environ.get(ENV[kind])
    if override:
        return [Path(override).expanduser()]
    cwd = _cwd()
    candidates = [*([cwd / kind] if cwd else []), user_dir() / kind, package_dir(kind)]
    out: list[Path] = []
    seen: set[Path] = set()
    for path in candidates:
        try:
            if not path.is_dir():
                continue
            real = path.resolve()
        except OSError:
            continue
        if real not in seen:
            seen.add(real)
            out.append(path)
    return out or [package_dir(kind)]


def config_dir() -> Path:
    """The config tree Hydra composes: the first folder on the search path that holds `run.yaml`."""
    dirs = search_path("configs")
    return next((d for d in dirs if (d / CONFIG_ROOT).is_file()), dirs[0])


def known(kind: str) -> list[str]:
    """The names of `kind`'s files (`paper-main`, `local`, ...) along the whole search path, sorted."""
    return sorted({p.stem for d in search_path(kind) for p in d.glob("*.yaml") if p.is_file()})


def find(kind: str, name: str) -> Path | None:
    """`<folder>/NAME.yaml` (or `<folder>/NAME`) in the first folder of the search path that has it."""
    for directory in search_path(kind):
        for candidate in (directory / f"{name}.yaml", directory / name):
            try:
                if candidate.is_file():
                    return candidate
            except OSError:  # a name too long for the file system
                continue
    return None


def default_files() -> list[tuple[str, Path, Path]]:
    """Every shipped file as (kind, its source, its path relative to the kind's folder)."""
    out = []
    for kind in KINDS:
        source = package_dir(kind)
        out += [(kind, p, p.relative_to(source)) for p in sorted(source.glob(PATTERNS[kind])) if p.is_file()]
    return out


def init(target: Path) -> list[Path]:
    """Copy the shipped defaults into `target/<kind>/`; refuses (FileExistsError naming the first file)
    before writing anything if any destination file exists. Returns the files written."""
    import shutil

    plan = [(src, target / kind / rel) for kind, src, rel in default_files()]
    clash = next((dest for _, dest in plan if dest.exists()), None)
    if clash is not None:
        raise FileExistsError(str(clash))
    for src, dest in plan:
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)
    return [dest for _, dest in plan]
