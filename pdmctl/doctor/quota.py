"""The file system quota under the run root, for the `disk` check: `lfs quota -u USER MOUNT` on Lustre,
`mmlsquota -u USER -Y` on GPFS (Spectrum Scale), read where the tool is there; a quota that leaves less than
the checkpoint plan fails the check as surely as a full disk (statvfs sees the file system's free space, not
what the user may still write)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

GPFS_BIN = Path("/usr/lpp/mmfs/bin")  # where GPFS installs mmlsquota (often not on PATH)
UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50, "e": 1 << 60}


@dataclass(frozen=True)
class Quota:
    """A user's block quota on a file system: bytes used, and the lower of the soft and hard limits set."""

    command: str  # what was run, for the line
    used: int
    limit: int | None  # None: no limit set (0 in the tool's output)

    @property
    def left(self) -> int | None:
        return None if self.limit is None else max(0, self.limit - self.used)


class QuotaUnread(Exception):
    """The quota could not be read; the message says why (one line)."""


def _kib(token: str) -> int:
    """A block field of `lfs quota` (KiB; with -h a unit: 128k, 9.537T) as bytes. Lustre marks a value over its
    quota with `*` and one some server did not answer for with brackets: `[1041408]`, `1048580*`."""
    value = token.strip("[]*")
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtpe]?)", value, re.I)
    if not match:
        raise ValueError(token)
    number, unit = match.groups()
    return int(float(number) * (UNITS[unit.lower()] if unit else 1024))


def _limit(*values: int) -> int | None:
    set_ = [v for v in values if v > 0]
    return min(set_) if set_ else None


def parse_lfs_quota(text: str, command: str = "lfs quota") -> Quota:
    """`lfs quota -u USER MOUNT`'s output -> Quota. The row after the `Filesystem kbytes quota limit grace files
    ...` header; a long file system name sits alone on its line and its values on the next."""
    lines = text.splitlines()
    header = next((i for i, ln in enumerate(lines) if ln.split()[:2] in (["Filesystem", "kbytes"],
                                                                             ["Filesystem", "used"])), None)  # fmt: skip
    if header is None:
        raise QuotaUnread(f"{command}: no quota table in its output ({_first(text)})")
    fields: list[str] = []
    for line in lines[header + 1:]:
        fields += line.split()
        if len(fields) >= 4:
            break
    try:
        used, soft, hard = (_kib(v) for v in fields[1:4])
    except (ValueError, IndexError):
        raise QuotaUnread(f"{command}: a row it did not print as numbers ({' '.join(fields)[:120]})") from None
    return Quota(command, used, _limit(soft, hard))


def parse_mmlsquota(text: str, filesystem: str | None, command: str = "mmlsquota") -> Quota:
    """`mmlsquota -u USER -Y`'s output -> Quota: its HEADER line names the fields (KiB); the USR row of
    `filesystem` (the mount's GPFS device), or the only USR row."""
    rows, names = [], None
    for line in text.splitlines():
        parts = line.split(":")
        if len(parts) > 2 and parts[0] == "mmlsquota" and parts[2] == "HEADER":
            names = parts
        elif names and len(parts) > 2 and parts[0] == "mmlsquota":
            row = dict(zip(names, parts, strict=False))
            if row.get("quotaType") == "USR":
                rows.append(row)
    mine = [r for r in rows if r.get("filesystemName") == filesystem] or (rows if len(rows) == 1 else [])
    if not mine:
        raise QuotaUnread(f"{command}: no user quota row for {filesystem or 'this file system'} in its output "
                          f"({_first(text)})")  # fmt: skip
    row = mine[0]
    try:
        used, soft, hard = (int(row[k]) * 1024 for k in ("blockUsage", "blockQuota", "blockLimit"))
    except (KeyError, ValueError):
        raise QuotaUnread(f"{command}: a row it did not print as numbers") from None
    return Quota(command, used, _limit(soft, hard))


def _first(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0][:160] if lines else "no output"


def mount_of(path: Path, mounts: str | None = None) -> tuple[str, str, str]:
    """(mount point, file system type, device) of the file system `path` lies on, from /proc/mounts."""
    if mounts is None:
        try:
            mounts = Path("/proc/mounts").read_text()
        except OSError:
            mounts = ""
    real, best = os.path.realpath(path), ("/", "", "")
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best[0]):
            best = (point, parts[2], parts[0])
    return best


def user_name() -> str:
    import pwd

    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return os.environ.get("USER") or str(os.getuid())


def read_quota(path: Path, timeout: float = 60) -> Quota:
    """The user's quota on the file system `path` lies on (its limit None where none is set). QuotaUnread where
    it cannot be read: no tool for its file system here, the tool failed or hung, its output unparsed."""
    point, fstype, device = mount_of(path)
    user = user_name()
    if fstype == "gpfs":
        tool = shutil.which("mmlsquota") or shutil.which("mmlsquota", path=str(GPFS_BIN))
        if tool is None:
            raise QuotaUnread(f"no mmlsquota here for the GPFS file system at {point}")
        argv = [tool, "-u", user, "-Y"]
    else:
        tool = shutil.which("lfs")
        if tool is None:
            raise QuotaUnread(f"no lfs (Lustre) or mmlsquota (GPFS) for the {fstype or 'unknown'} file system "
                              f"at {point}")  # fmt: skip
        argv = [tool, "quota", "-u", user, point]
    shown = " ".join([Path(argv[0]).name, *argv[1:]])
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise QuotaUnread(f"{shown}: no answer in {timeout:.0f} s (a quota server down?)") from None
    except OSError as exc:
        raise QuotaUnread(f"{shown}: {exc.strerror or exc}") from None
    if proc.returncode != 0:
        raise QuotaUnread(f"{shown}: exit {proc.returncode}: {_first(proc.stderr + proc.stdout)}")
    if fstype == "gpfs":
        return parse_mmlsquota(proc.stdout, device.removeprefix("/dev/"), shown)
    return parse_lfs_quota(proc.stdout, shown)
