"""The glibc floor of the CUDA engine environment, computed from scripts/engine-cuda.lock (or engine-cuda12.lock).

For every package the lock pins, the index's files of that version are listed (the simple API, PEP 691 JSON or
PEP 503 HTML) and the wheels an installer may pick for CPython 3.11 on Linux x86_64 are kept (cp311, abi3,
py3-none: packaging's tags). A package's floor is the lowest manylinux glibc among those wheels; a compatible
pure-Python wheel, or no compatible wheel (a source distribution only), sets none. The environment's floor is
the highest of the packages' floors: on an older glibc the installer would build that package from source.

    python scripts/lock_glibc.py [--cuda | --cuda12]
                                     prints the floor of scripts/engine-cuda.lock (--cuda, the default) or
                                     scripts/engine-cuda12.lock (--cuda12) and the packages that set it; fails
                                     (exit 1, one line) when scripts/engine-env.sh's GLIBC_FLOOR and
                                     GLIBC_FLOOR_SET_BY (GLIBC_FLOOR_CUDA12 and GLIBC_FLOOR_CUDA12_SET_BY: the
                                     single source) are not those, when docs/CLUSTER.md states another floor
                                     (one for both locks) or does not name its packages, or when a pin's files
                                     cannot be listed

Run by `bash scripts/engine-lock.sh --check [--cuda12]` (CI). Needs the `packaging` library and the index (network);
nothing is written to disk.
"""

from __future__ import annotations

import functools
import gzip
import json
import re
import ssl
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from html.parser import HTMLParser
from pathlib import Path

try:
    from packaging.tags import Tag, compatible_tags, cpython_tags
    from packaging.utils import (
        InvalidSdistFilename,
        InvalidWheelFilename,
        canonicalize_name,
        parse_sdist_filename,
        parse_wheel_filename,
    )
    from packaging.version import InvalidVersion, Version
except ImportError:  # pragma: no cover - said in one line below
    Tag = None

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "scripts" / "engine-cuda.lock"
# the locks by engine-env.sh's option: the file, and the name of engine-env.sh's variable that states its floor
LOCKS = {"--cuda": (LOCK, "GLIBC_FLOOR"), "--cuda12": (REPO / "scripts" / "engine-cuda12.lock", "GLIBC_FLOOR_CUDA12")}
ENGINE_ENV = REPO / "scripts" / "engine-env.sh"
DOC = REPO / "docs" / "CLUSTER.md"
# engine-lock.sh resolves, and engine-env.sh installs, from this index (--default-index) unless the lock names one
DEFAULT_INDEX = "https://pypi.org/simple"
# manylinux_2_5 .. manylinux_2_60: wide enough for any glibc a wheel names today
GLIBC_MINORS = range(5, 61)
LEGACY_MANYLINUX = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}
PLATFORM = re.compile(r"^manylinux_(\d+)_(\d+)_x86_64$")

Glibc = tuple[int, int]


@functools.cache
def supported_tags() -> frozenset[Tag]:
    """The tags of CPython 3.11 on Linux x86_64 with any manylinux glibc: cp311, abi3 (cp32..cp311), py3-none."""
    platforms = [f"manylinux_2_{m}_x86_64" for m in reversed(GLIBC_MINORS)]
    platforms += [f"{legacy}_x86_64" for legacy in LEGACY_MANYLINUX]
    tags = set(cpython_tags((3, 11), abis=["cp311"], platforms=platforms))
    tags |= set(compatible_tags((3, 11), interpreter="cp311", platforms=platforms))
    return frozenset(tags)


def platform_glibc(platform: str) -> Glibc | None:
    """The glibc a platform tag needs (manylinux_2_31_x86_64 -> (2, 31)); None for `any`."""
    if platform == "any":
        return None
    m = PLATFORM.match(platform)
    if m:
        return int(m.group(1)), int(m.group(2))
    return LEGACY_MANYLINUX[platform.removesuffix("_x86_64")]


@functools.cache
def _version(text: str) -> Version | None:
    try:
        return Version(text)
    except InvalidVersion:
        return None


def file_version(filename: str) -> Version | None:
    """The version a wheel's or source distribution's file name carries, read without parsing its tags (a
    project lists thousands of files; a pin needs a few of them)."""
    if filename.endswith(".whl"):
        parts = filename.split("-")
        return _version(parts[1]) if len(parts) in (5, 6) else None
    for ext in (".tar.gz", ".zip"):
        if filename.endswith(ext) and "-" in filename:
            return _version(filename[: -len(ext)].rsplit("-", 1)[1])
    return None


def package_floor(filenames: Iterable[str], version: str, tags: frozenset[Tag] | None = None) -> Glibc | None:
    """The glibc floor a package's files of `version` set for CPython 3.11 on Linux x86_64: the lowest manylinux
    glibc among the compatible wheels; None when a compatible wheel is pure Python or there is no compatible
    wheel and a source distribution (built where it installs). ValueError when no file of `version` can
    install there."""
    tags = supported_tags() if tags is None else tags
    want = Version(version)
    floors: list[Glibc | None] = []
    sdist = False
    for filename in filenames:
        if file_version(filename) != want:
            continue
        try:
            if filename.endswith(".whl"):
                compatible = parse_wheel_filename(filename)[3] & tags
                if compatible:  # a wheel tagged for several glibcs installs from the lowest of them
                    glibcs = [platform_glibc(t.platform) for t in compatible]
                    floors.append(None if None in glibcs else min(g for g in glibcs if g is not None))
            else:
                sdist = sdist or parse_sdist_filename(filename)[1] == want
        except (InvalidWheelFilename, InvalidSdistFilename, InvalidVersion):
            continue  # a file name no installer reads
    if None in floors or (not floors and sdist):
        return None
    if not floors:
        raise ValueError(f"no wheel for CPython 3.11 on Linux x86_64 and no source distribution of {version}")
    return min(g for g in floors if g is not None)


def environment_floor(floors: dict[str, Glibc | None]) -> tuple[Glibc | None, list[str]]:
    """The highest of the packages' floors and the packages (sorted) that set it."""
    known = [g for g in floors.values() if g is not None]
    if not known:
        return None, []
    top = max(known)
    return top, sorted(name for name, g in floors.items() if g == top)


def read_lock(text: str) -> tuple[list[tuple[str, str, str | None]], list[str]]:
    """The lock's pins as (name, version, the index a `# from URL` annotation names or None), and the indexes
    its option lines name, in the order an installer asks them (extra indexes before the default one)."""
    pins: list[tuple[str, str, str | None]] = []
    default: list[str] = []
    extra: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        option = re.match(r"^(--index-url|-i|--default-index|--extra-index-url|--index)[ =](\S+)", stripped)
        if option:
            url = option.group(2).rstrip("/")
            (default if option.group(1) in ("--index-url", "-i", "--default-index") else extra).append(url)
            continue
        pin = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", line)
        if pin:
            pins.append((canonicalize_name(pin.group(1)), pin.group(2), None))
            continue
        origin = re.match(r"^#\s+from\s+(\S+)$", stripped)
        if origin and pins:
            name, version, _ = pins[-1]
            pins[-1] = (name, version, origin.group(1).rstrip("/"))
    return pins, extra + (default or [DEFAULT_INDEX])


class _Anchors(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self._in_a = False

    def handle_starttag(self, tag: str, attrs) -> None:
        self._in_a = tag == "a"

    def handle_data(self, data: str) -> None:
        if self._in_a and data.strip():
            self.names.append(data.strip())

    def handle_endtag(self, tag: str) -> None:
        self._in_a = False


@functools.cache
def _tls() -> ssl.SSLContext:
    return ssl.create_default_context()  # once: loading the CA bundle costs more than a request


def list_files(index: str, name: str) -> list[str] | None:
    """The file names the index's simple API lists for a project; None when the index has no such project."""
    url = f"{index}/{name}/"
    headers = {"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1", "Accept-Encoding": "gzip"}
    for attempt in range(3):
        try:
            with urllib.request.urlopen(
                urllib.request.Request(url, headers=headers), timeout=30, context=_tls()
            ) as r:
                body, kind = r.read(), r.headers.get("Content-Type", "")
                if r.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
            break
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            if attempt == 2:
                raise
        except (urllib.error.URLError, TimeoutError):
            if attempt == 2:
                raise
        time.sleep(1 + attempt)
    if "json" in kind:
        return [f["filename"] for f in json.loads(body)["files"]]
    parser = _Anchors()
    parser.feed(body.decode("utf-8", "replace"))
    return parser.names


def floor_of_pin(pin: tuple[str, str, str | None], indexes: list[str]) -> Glibc | None:
    """A pin's floor, from the index its annotation names or else the first of `indexes` that has the project
    (uv's first-index strategy). ValueError (the reason) when no index lists a file of that version."""
    name, version, origin = pin
    for index in [origin] if origin else indexes:
        try:
            files = list_files(index, name)
        except (urllib.error.URLError, TimeoutError, OSError, ValueError) as e:
            raise ValueError(f"{index}: {e}") from e
        if files is not None:
            return package_floor(files, version)
    raise ValueError(f"not on {', '.join([origin] if origin else indexes)}")


def check_stated(
    top: Glibc | None, setters: list[str], env_sh: str, doc: str, variable: str = "GLIBC_FLOOR"
) -> str | None:
    """What engine-env.sh (`variable` and `variable`_SET_BY, the single source) or docs/CLUSTER.md (every
    `glibc >= X.Y`, `glibc X.Y`, `manylinux_X_Y`, and the setters by name and version) states otherwise than
    the lock's floor `top` set by `setters`; None when they agree."""
    env_name, doc_name = ENGINE_ENV.relative_to(REPO), DOC.relative_to(REPO)
    floor = re.search(rf"^{variable}=(\d+)\.(\d+)$", env_sh, re.MULTILINE)
    set_by = re.search(rf'^{variable}_SET_BY="([^"]*)"$', env_sh, re.MULTILINE)
    if not floor or not set_by:
        return f'{env_name} sets no {variable}=X.Y and {variable}_SET_BY="NAME VERSION, ..."'
    wrong = []
    if (int(floor.group(1)), int(floor.group(2))) != top or set_by.group(1) != ", ".join(setters):
        wrong.append(
            f"{env_name} has {variable}={floor.group(1)}.{floor.group(2)}, set by {set_by.group(1)}"
        )
    stated = {
        (int(a or c), int(b or d))
        for a, b, c, d in re.findall(r"glibc (?:>= )?(\d+)\.(\d+)|manylinux_(\d+)_(\d+)", doc)
    }
    if stated != {top}:
        wrong.append(f"{doc_name} states glibc {', '.join(sorted(map(show, stated))) or 'nowhere'}")
    words = " ".join(doc.split())  # a name and its version may stand on two lines
    missing = [s for s in setters if s not in words]
    if missing:
        wrong.append(f"{doc_name} does not name {', '.join(missing)}")
    if wrong:
        return f"the lock's glibc floor is {show(top)}, set by {', '.join(setters)}, but {'; '.join(wrong)}"
    return None


def show(g: Glibc | None) -> str:
    return "none" if g is None else f"{g[0]}.{g[1]}"


def main(argv: list[str]) -> int:
    if len(argv) > 1 or (argv and argv[0] not in LOCKS):
        print(f"lock_glibc.py: unknown arguments {' '.join(argv)!r} (usage: python scripts/lock_glibc.py "
              "[--cuda | --cuda12])", file=sys.stderr)  # fmt: skip
        return 2
    lock, variable = LOCKS[argv[0] if argv else "--cuda"]
    if Tag is None:
        print("lock_glibc.py: needs the `packaging` library (pip install packaging)", file=sys.stderr)
        return 2
    start = time.monotonic()
    pins, indexes = read_lock(lock.read_text())
    floors: dict[str, Glibc | None] = {}
    failed: list[str] = []
    with ThreadPoolExecutor(16) as pool:
        results = {pin: pool.submit(floor_of_pin, pin, indexes) for pin in pins}
        for (name, version, _), future in results.items():
            try:
                floors[f"{name} {version}"] = future.result()
            except ValueError as e:
                failed.append(f"{name}=={version} ({e})")
    top, setters = environment_floor(floors)
    elapsed = time.monotonic() - start
    print(f"lock_glibc.py: {lock.relative_to(REPO)}: {len(pins)} pins from {', '.join(indexes)}; glibc floor {show(top)}, set by "
          f"{', '.join(setters) or 'no package'} ({elapsed:.1f} s)")  # fmt: skip
    if failed:
        print(f"lock_glibc.py: cannot compute the floor: {len(failed)} pin(s) not resolved: {'; '.join(failed)}",
              file=sys.stderr)  # fmt: skip
        return 1
    problem = check_stated(top, setters, ENGINE_ENV.read_text(), DOC.read_text(), variable)
    if problem:
        print(f"lock_glibc.py: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
