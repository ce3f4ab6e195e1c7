"""The `disk` check's quota: `lfs quota` (Lustre) and `mmlsquota -Y` (GPFS) output parsed, in the forms they
print (long file system names wrapped, values over quota starred, unanswered ones bracketed, -h units), and a
quota that leaves less than the checkpoint plan failing in one line, through a stand-in `lfs` on PATH."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdmctl import doctor
from pdmctl.doctor import quota
from tests.conftest import pdmctl
from tests.test_doctor import _filled_h20

# `lfs quota -u alice /lustre`: a 1 TB hard limit, 10 MB of it left
ALMOST_FULL = """\
Disk quotas for usr alice (uid 1000):
     Filesystem  kbytes   quota   limit   grace   files   quota   limit   grace
        /lustre 999990000       0 1000000000       -  443208       0       0       -
uid 1000 is using default file quota setting
"""
# a long file system name alone on its line, over the soft limit (`*`, grace running)
WRAPPED = """\
Disk quotas for usr alice (uid 1000):
     Filesystem  kbytes   quota   limit   grace   files   quota   limit   grace
/lustre/scratch/project-rl
                5242880* 4194304 6291456  6d23h   120000       0 1000000       -
"""
# an OST that did not answer: Lustre brackets what it could not read
BRACKETED = """\
Disk quotas for usr alice (uid 1000):
     Filesystem    kbytes    quota   limit   grace   files   quota   limit   grace
          /fred [1041408]  5242880 6291456       -     [0]       0       0       -
"""
# `lfs quota -h`: units, its header says `used`
HUMAN = """\
Disk quotas for usr alice (uid 1000):
     Filesystem    used   quota   limit   grace   files   quota   limit   grace
        /lustre  792.3M      8T     10T       -       9       0 2000000       -
"""
NO_LIMIT = """\
Disk quotas for usr alice (uid 1000):
     Filesystem  kbytes   quota   limit   grace   files   quota   limit   grace
        /lustre    1840       0       0       -      23       0       0       -
"""
MMLSQUOTA = """\
mmlsquota::HEADER:version:reserved:reserved:filesystemName:quotaType:id:name:blockUsage:blockQuota:blockLimit:blockInDoubt:blockGrace:filesUsage:filesQuota:filesLimit:filesInDoubt:filesGrace:remarks:quota:defQuota:fid:filesetname:
mmlsquota::0:1:::gpfs0:USR:1000:alice:2097152:10485760:12582912:0:none:4000:0:500000:0:none:e:on:off:::
mmlsquota::0:1:::gpfs1:USR:1000:alice:10:0:0:0:none:1:0:0:0:none:e:on:off:::
"""


def test_lfs_and_mmlsquota_output_is_parsed() -> None:
    """Bytes used and the lower limit set (soft or hard; none where both are 0), in each form the tools print."""
    assert quota.parse_lfs_quota(ALMOST_FULL) == quota.Quota("lfs quota", 999990000 << 10, 1000000000 << 10)
    assert quota.parse_lfs_quota(ALMOST_FULL).left == 10000 << 10
    assert quota.parse_lfs_quota(WRAPPED) == quota.Quota("lfs quota", 5242880 << 10, 4194304 << 10)
    assert quota.parse_lfs_quota(WRAPPED).left == 0
    assert quota.parse_lfs_quota(BRACKETED) == quota.Quota("lfs quota", 1041408 << 10, 5242880 << 10)
    assert quota.parse_lfs_quota(HUMAN) == quota.Quota("lfs quota", int(792.3 * (1 << 20)), 8 << 40)
    assert quota.parse_lfs_quota(NO_LIMIT).limit is None
    with pytest.raises(quota.QuotaUnread, match=r"^lfs quota: no quota table in its output \(lfs quota: "):
        quota.parse_lfs_quota("lfs quota: '/home/alice' not on a mounted Lustre filesystem\n")
    assert quota.parse_mmlsquota(MMLSQUOTA, "gpfs0") == quota.Quota("mmlsquota", 2097152 << 10, 10485760 << 10)
    assert quota.parse_mmlsquota(MMLSQUOTA, "gpfs1").limit is None
    with pytest.raises(quota.QuotaUnread, match="no user quota row for gpfs9"):
        quota.parse_mmlsquota(MMLSQUOTA, "gpfs9")


def test_the_mount_the_run_root_lies_on_is_the_longest_that_holds_it() -> None:
    """/proc/mounts' longest mount point holding the path names the file system asked (and its type the tool):
    /lustre2 is not under /lustre."""
    mounts = ("/dev/vda / ext4 rw 0 0\n10.0.0.1@o2ib:/lustre /lustre lustre rw,flock 0 0\n"
              "gpfs0 /gpfs/gpfs0 gpfs rw 0 0\n")  # fmt: skip
    assert quota.mount_of(Path("/lustre/alice/runs"), mounts) == ("/lustre", "lustre", "10.0.0.1@o2ib:/lustre")
    assert quota.mount_of(Path("/gpfs/gpfs0/runs"), mounts) == ("/gpfs/gpfs0", "gpfs", "gpfs0")
    assert quota.mount_of(Path("/lustre2/runs"), mounts) == ("/", "ext4", "/dev/vda")


def test_disk_fails_where_the_quota_leaves_less_than_the_checkpoint_plan(tmp_path: Path) -> None:
    """Free space on the file system is not what the user may write: the quota's room is compared too, and an
    unread quota is said to be unread."""
    full = quota.parse_lfs_quota(ALMOST_FULL, "lfs quota -u alice /lustre")
    with pytest.raises(doctor.CheckFailed) as failed:
        doctor.check_disk(tmp_path / "runs", int(12.7e6), 1, free=int(50e12), quota=full)
    assert str(failed.value) == (f"workdir {tmp_path / 'runs'}: the quota leaves 10.2 MB (1.0 TB used of 1.0 TB, lfs "
                                 "quota -u alice /lustre), the checkpoint plan of 1 run(s) keeps up to 12.7 MB")  # fmt: skip
    assert doctor.check_disk(tmp_path / "runs", int(5e6), 1, free=int(50e12), quota=full) == (
        f"workdir {tmp_path / 'runs'}: 50.0 TB free; quota: 10.2 MB left of 1.0 TB (lfs quota -u alice /lustre); "
        "the checkpoint plan of 1 run(s) keeps up to 5.0 MB")
    assert "; no quota set (lfs quota); " in doctor.check_disk(tmp_path, 10, 1, free=100,
                                                              quota=quota.parse_lfs_quota(NO_LIMIT))  # fmt: skip
    assert "; quota not read (no lfs here); " in doctor.check_disk(tmp_path, 10, 1, free=100, quota="no lfs here")


def _stand_in_lfs(tmp_path: Path, output: str) -> dict[str, str]:
    """`lfs` on PATH that records its arguments and prints `output`."""
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    (tmp_path / "lfs.out").write_text(output)
    (folder / "lfs").write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "lfs.args"}\ncat {tmp_path / "lfs.out"}\n')
    (folder / "lfs").chmod(0o755)
    return {"PATH": f"{folder}:{os.environ['PATH']}"}


def test_the_disk_check_reads_lfs_quota_and_fails_in_one_line_when_it_leaves_too_little(tmp_path: Path) -> None:
    """`pdmctl doctor` with a sweep (the tiny model: a 12.7 MB checkpoint plan) where `lfs quota -u USER MOUNT`
    leaves 10.2 MB: the disk line fails, the last, exit 2; with room left it passes, saying how much."""
    profile = _filled_h20(tmp_path)
    args = ["doctor", "--cluster", str(profile), "--skip=slurm", "--skip=nodes-driver", "--skip=paths", "backend=verl",
            "model=qwen3-tiny"]  # fmt: skip
    result = pdmctl(*args, env=_stand_in_lfs(tmp_path, ALMOST_FULL))
    assert result.returncode == 2, result.stdout + result.stderr
    point = quota.mount_of(tmp_path)[0]
    shown = f"lfs quota -u {quota.user_name()} {point}"
    assert (tmp_path / "lfs.args").read_text().split() == shown.split()[1:]
    assert result.stdout.strip().splitlines()[-1] == (
        f"FAIL  disk: workdir {tmp_path / 'runs'}: the quota leaves 10.2 MB (1.0 TB used of 1.0 TB, {shown}), the "
        "checkpoint plan of 1 run(s) keeps up to 12.7 MB")
    result = pdmctl(*args, env=_stand_in_lfs(tmp_path, HUMAN))
    assert result.returncode == 0, result.stdout + result.stderr
    assert any(ln.startswith("ok    disk: ") and f"; quota: 8.8 TB left of 8.8 TB ({shown}); the checkpoint plan of 1"
               in ln for ln in result.stdout.splitlines()), result.stdout  # fmt: skip


def test_without_a_quota_tool_the_line_says_the_quota_was_not_read(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """No lfs on PATH and no GPFS (this machine's case): the disk check passes on free space, saying the quota
    was not read and why."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    point, fstype, _ = quota.mount_of(tmp_path)
    line = doctor.check_disk(tmp_path / "runs", 10, 1)
    assert (f"; quota not read (no lfs (Lustre) or mmlsquota (GPFS) for the {fstype} file system at {point}); "
            in line), line  # fmt: skip
