"""The NVIDIA driver against the CUDA build of torch, in one line:

    python -m pdmctl.backends.verl.driver          on a GPU node: exit 0: one line saying it fits; exit 2: one line
                                                   why not, naming the engine lock whose CUDA the driver runs

torch from the package index brings its own CUDA runtime; what the node must give is a driver of a branch that
runs it. The engine has two locks (docs/CLUSTER.md, "The engine environment"): scripts/engine-cuda.lock (torch
2.11.0, CUDA 13.0) and scripts/engine-cuda12.lock (torch 2.10.0, CUDA 12.8). NVIDIA's minor version
compatibility (docs.nvidia.com/deploy/cuda-compatibility, Table 1): CUDA 13.x needs a driver >= 580.65.06,
CUDA 12.x >= 525.60.13. An older driver fails only when the first CUDA call is made, in every Ray worker, after
the queue wait: this says so before. (NVIDIA's forward-compatibility package, `cuda-compat-13-0`, lets some
data-center drivers older than 580 run CUDA 13; where a site uses it, this check is too strict and says how to
pass it: PDMCTL_SKIP_DRIVER_CHECK=1.)

On a login node, before anything is queued (`pdmctl doctor`'s `nodes-driver` check, `check_login`): the driver
the nodes run, as `sinfo` publishes it among their features or GRES (a feature such as driver-550, nvidia550 or
nvidia-driver-570.124.06; the lowest of the partition's nodes), else as this machine's own nvidia-smi reports
it, against the CUDA of the engine environment the profile activates (its python, or a setup line's `source
DIR/bin/activate`: torch/version.py read there, torch not imported), or, where that is not found from here,
against scripts/engine-cuda.lock's (engine-env.sh --cuda's). Too old a driver fails in one line naming the lock
to build instead, or that no lock runs on it; where neither sinfo nor nvidia-smi says a driver, the line says
it was not read and passes (`pdmctl doctor --job` reads it on the nodes).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

MIN_DRIVER_BRANCH = {12: 525, 13: 580}  # CUDA major -> oldest driver branch (minor version compatibility)
MIN_DRIVER = {12: (525, 60, 13), 13: (580, 65, 6)}  # the same, to the release
SKIP_ENV = "PDMCTL_SKIP_DRIVER_CHECK"
# The engine's locks by the CUDA major of their torch: the lock, engine-env.sh's option, torch's CUDA.
LOCKS = {13: ("scripts/engine-cuda.lock", "--cuda", "13.0"), 12: ("scripts/engine-cuda12.lock", "--cuda12", "12.8")}
DEFAULT_CUDA = 13  # engine-env.sh --cuda's lock
SINFO_QUERY = ["sinfo", "-h", "-N", "-o", "%N|%f|%G"]  # one line per node: its name, features, GRES
# A driver as a site publishes it in a node feature or a GRES name: driver-550, nvidia550, nvidia_driver_570.124.06
DRIVER_NAME = re.compile(r"^(?:nvidia[-_]?driver|nvidia|driver)[-_]?r?(\d{3})(?:[._-](\d+))?(?:[._-](\d+))?$", re.I)


class DriverError(RuntimeError):
    """The node's driver cannot run torch's CUDA build, or cannot be read."""


def parse_driver_versions(nvidia_smi_csv: str) -> list[str]:
    """`nvidia-smi --query-gpu=driver_version --format=csv,noheader` -> one version per GPU."""
    versions = [line.strip() for line in nvidia_smi_csv.splitlines() if line.strip()]
    for v in versions:
        if not all(part.isdigit() for part in v.split(".")):
            raise DriverError(
                f"nvidia-smi printed {v!r} where a driver version (e.g. 580.65.06) was expected"
            )
    if not versions:
        raise DriverError("nvidia-smi lists no GPU")
    return versions


def _instead(driver: tuple[int, ...]) -> str:
    """What to do about a driver too old for the lock at hand: the newest lock it runs, or that none does."""
    fits = [major for major in sorted(LOCKS, reverse=True) if runs(driver, MIN_DRIVER[major])]
    if not fits:
        oldest = min(LOCKS)
        return (f"no engine lock runs on it (the oldest, {LOCKS[oldest][0]}, needs >= {show(MIN_DRIVER[oldest])}): "
                "update the driver")  # fmt: skip
    lock, option, cuda = LOCKS[fits[0]]
    return (f"build the engine environment from {lock} instead (bash scripts/engine-env.sh {option} DIR: CUDA "
            f"{cuda}, driver >= {show(MIN_DRIVER[fits[0]])}), or update the driver")  # fmt: skip


def check(driver: str, torch_cuda: str | None) -> str:
    """One line: the driver fits torch's CUDA build; DriverError (one line) if not."""
    if not torch_cuda:
        raise DriverError(
            "torch is a CPU build (torch.version.cuda is None): the engine needs the CUDA build"
        )
    major = int(torch_cuda.split(".")[0])
    branch = int(driver.split(".")[0])
    need = MIN_DRIVER_BRANCH.get(major)
    if need is None:
        raise DriverError(f"torch is built for CUDA {torch_cuda}, which this check does not know")
    if branch < need:
        raise DriverError(
            f"NVIDIA driver {driver} is older than torch's CUDA {torch_cuda} build needs (driver >= {need}, "
            f"the R{need} branch or newer): {_instead(parse_version(driver))} (set {SKIP_ENV}=1 where "
            "NVIDIA's cuda-compat package is installed)"
        )
    return f"NVIDIA driver {driver} runs torch's CUDA {torch_cuda} build (needs >= {need})"


def node_driver() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=True, timeout=60,
        ).stdout  # fmt: skip
    except FileNotFoundError:
        raise DriverError("no nvidia-smi: this is not a GPU node (or the driver is not installed)") from None
    except subprocess.CalledProcessError as exc:
        raise DriverError(f"nvidia-smi failed (exit {exc.returncode}): {exc.stderr.strip()[:200]}") from None
    except subprocess.TimeoutExpired:
        raise DriverError("nvidia-smi gave no answer in 60 s (a hung GPU or driver)") from None
    versions = sorted(set(parse_driver_versions(out)))
    if len(versions) > 1:
        raise DriverError(f"the GPUs of this node report different drivers: {', '.join(versions)}")
    return versions[0]


# ---------------------------------------------------------------------------
# on a login node
# ---------------------------------------------------------------------------


def parse_version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def show(version: tuple[int, ...]) -> str:
    """(580, 65, 6) -> 580.65.06, as NVIDIA writes its releases."""
    return ".".join([str(version[0]), *(f"{p:02d}" for p in version[1:])])


def runs(driver: tuple[int, ...], need: tuple[int, ...]) -> bool:
    """A driver (a release, or only its branch: (550,)) is at least `need`; a branch alone is compared as one."""
    return driver[0] >= need[0] if len(driver) == 1 else driver >= need


@dataclass(frozen=True)
class NodesDriver:
    """The oldest driver the nodes run, as read on the login node: its version, as written there, from where."""

    version: tuple[int, ...]
    text: str
    source: str


def sinfo_driver(text: str, where: str) -> NodesDriver | None:
    """`sinfo -h -N -o '%N|%f|%G'` lines -> the lowest driver a node feature or GRES names, or None. `where` names
    the nodes asked about (partition gpu)."""
    found: dict[str, tuple[tuple[int, ...], str, str]] = {}  # node -> its driver, as written, the name saying it
    nodes: set[str] = set()
    for line in text.splitlines():
        cols = line.strip().split("|")
        if len(cols) != 3 or not cols[0]:
            continue
        node, features, gres = cols
        nodes.add(node)
        names = [f for f in features.split(",") if f] + [part for g in gres.split(",") for part in g.split(":")]
        for name in names:
            m = DRIVER_NAME.match(re.sub(r"\(.*?\)", "", name).strip())
            if m:
                parts = [g for g in m.groups() if g is not None]
                version = tuple(int(g) for g in parts)
                if node not in found or version < found[node][0]:
                    found[node] = (version, ".".join(parts), name.strip())
    if not found:
        return None
    oldest = min(found.values())
    at = [n for n, v in found.items() if v == oldest]
    return NodesDriver(oldest[0], oldest[1], f"sinfo: {oldest[2]} on {len(at)} of the {len(nodes)} node(s) of {where}")


def read_nodes_driver(partition: str | None) -> tuple[NodesDriver | None, list[str]]:
    """The nodes' driver from sinfo, else from this machine's nvidia-smi; with it or without it, why each
    source said none."""
    why: list[str] = []
    where = f"partition {partition}" if partition else "the cluster"
    if shutil.which("sinfo") is None:
        why.append("no sinfo here")
    else:
        query = [*SINFO_QUERY, *(["-p", partition] if partition else [])]
        try:
            proc = subprocess.run(query, capture_output=True, text=True, timeout=60, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            why.append(f"sinfo did not answer ({exc.__class__.__name__})")
        else:
            if proc.returncode != 0:
                why.append(f"sinfo failed (exit {proc.returncode})")
            else:
                found = sinfo_driver(proc.stdout, where)
                if found:
                    return found, why
                why.append(f"sinfo names no driver among the features or GRES of {where}")
    if shutil.which("nvidia-smi") is None:
        why.append("this machine has no nvidia-smi")
        return None, why
    try:
        version = node_driver()
    except DriverError as exc:
        why.append(str(exc))
        return None, why
    return NodesDriver(parse_version(version), version, "this machine's nvidia-smi; the nodes' may differ"), why


def environment_cuda(python: str | None, setup: Sequence[str]) -> tuple[str, Path] | None:
    """The CUDA of torch in the environment the profile's jobs run (its `python` where that is a path, or the
    environment a setup line activates), read from torch/version.py without importing torch; None where no such
    environment is found from here or its torch is a CPU build."""
    envs: list[Path] = []
    if python and "/" in python:
        envs.append(Path(os.path.expanduser(os.path.expandvars(python))).parent.parent)
    for line in setup:
        for m in re.finditer(r"(?:^|[\s;&|])(?:source|\.)\s+[\"']?([^\s\"';&|]+)/bin/activate\b", line):
            envs.append(Path(os.path.expanduser(os.path.expandvars(m.group(1)))))
    for env in envs:
        for version_py in sorted(env.glob("lib/python3*/site-packages/torch/version.py")):
            try:
                text = version_py.read_text()
            except OSError:
                continue
            m = re.search(r"^cuda\s*(?::[^=\n]*)?=\s*['\"]([\d.]+)['\"]", text, re.MULTILINE)
            if m:
                return m.group(1), env
    return None


def check_nodes(driver: NodesDriver | None, cuda: str, env: Path | None, not_read: Sequence[str] = ()) -> str:
    """One line: the nodes' driver runs the environment's CUDA, or it was not read; DriverError (one line)
    naming the lock to build instead where it does not."""
    major = parse_version(cuda)[0]
    need = MIN_DRIVER.get(major)
    if need is None:
        raise DriverError(f"torch in {env} is built for CUDA {cuda}, which this check does not know")
    target = f"torch's CUDA {cuda} build in {env}" if env is not None else f"{LOCKS[major][0]}'s CUDA {cuda} build"
    note = "" if env is not None else " (the default lock: the profile's environment is not found from here)"
    if driver is None:
        return (f"not read ({'; '.join(not_read) or 'no source'}); {target}{note} needs an NVIDIA driver >= "
                f"{show(need)} on every node: pdmctl doctor --job reads it there")  # fmt: skip
    if runs(driver.version, need):
        return f"NVIDIA driver {driver.text} ({driver.source}) runs {target}, which needs >= {show(need)}{note}"
    raise DriverError(f"NVIDIA driver {driver.text} ({driver.source}) cannot run {target}, which needs >= "
                      f"{show(need)}{note}: {_instead(driver.version)} (set {SKIP_ENV}=1 where NVIDIA's "
                      "cuda-compat package is installed)")  # fmt: skip


def check_login(partition: str | None, python: str | None, setup: Sequence[str]) -> str:
    """The login node's line: the nodes' driver (sinfo, else nvidia-smi here) against the environment's CUDA."""
    if os.environ.get(SKIP_ENV) == "1":
        return f"skipped ({SKIP_ENV}=1)"
    found = environment_cuda(python, setup)
    cuda, env = found if found else (LOCKS[DEFAULT_CUDA][2], None)
    driver, why = read_nodes_driver(partition)
    return check_nodes(driver, cuda, env, why)


def main() -> None:
    if os.environ.get(SKIP_ENV) == "1":
        print(f"driver check skipped ({SKIP_ENV}=1)")
        return
    try:
        found = node_driver()  # before torch's import: a node without a driver is told at once
        import torch

        print(check(found, torch.version.cuda))
    except DriverError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
