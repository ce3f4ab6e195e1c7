"""`pdmctl doctor`'s `nodes-driver` check on the login node: the driver the nodes run, as `sinfo` publishes it
among their features or GRES, else as the login node's nvidia-smi reports it, against the CUDA of the engine
environment (pdmctl.backends.verl.driver.check_login through pdmctl doctor). No GPU and no site's SLURM here: stand-in `sinfo` and
`nvidia-smi` on a PATH of their own print what a site's would."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pdmctl.backends.verl import driver
from tests.conftest import pdmctl

REPO = Path(__file__).resolve().parents[1]
# `sinfo -h -N -o '%N|%f|%G'` on a partition of four H20 nodes whose site names the driver branch in a feature
SINFO_R550 = "".join(f"gpu{i:02d}|ib,h20,driver-550|gpu:h20:8(S:0-1)\n" for i in range(4))


def stand_ins(tmp_path: Path, sinfo: str | None = None, smi: str | None = None) -> Path:
    """A directory for PATH holding only the stand-ins given: each prints its text (to any arguments)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("sinfo", sinfo), ("nvidia-smi", smi)):
        if text is not None:
            (bin_dir / f"{name}.out").write_text(text)
            (bin_dir / name).write_text(f"#!/bin/sh\nwhile IFS= read -r l; do printf '%s\\n' \"$l\"; done < '{bin_dir / name}.out'\n")
            (bin_dir / name).chmod(0o755)
    return bin_dir


def engine_env(tmp_path: Path, cuda: str) -> Path:
    """An environment as engine-env.sh leaves it, as far as the check reads it: torch/version.py."""
    env = tmp_path / "pdmctl-engine"
    version_py = env / "lib" / "python3.11" / "site-packages" / "torch" / "version.py"
    version_py.parent.mkdir(parents=True)
    version_py.write_text(f"__version__ = '2.10.0+cu128'\ndebug = False\ncuda: Optional[str] = '{cuda}'\n")
    return env


def profile(tmp_path: Path, **changes) -> Path:
    """clusters/h20.yaml filled in with this machine's paths, partition gpu, its jobs' python the one a setup line
    activates (as shipped)."""
    data = yaml.safe_load((REPO / "clusters" / "h20.yaml").read_text())
    for name in ("models", "data"):
        (tmp_path / name).mkdir(exist_ok=True)
    data.update(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", workdir=str(tmp_path / "runs"), partition="gpu",
                account=None, qos=None, setup=["true"], models_dir=str(tmp_path / "models"),
                data_dir=str(tmp_path / "data"), network={"NCCL_SOCKET_IFNAME": "lo"}, network_interface="lo",
                python="python")  # fmt: skip
    data.update(changes)
    path = tmp_path / "h20-filled.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def doctor(tmp_path: Path, bin_dir: Path, **changes):
    """`pdmctl doctor --cluster PROFILE` on the login node with only the stand-ins on the PATH (the profile's
    partition against sinfo is `slurm`'s check, left out: the stand-in answers only the driver's question)."""
    env = {"PATH": str(bin_dir)}
    return pdmctl("doctor", "--cluster", str(profile(tmp_path, **changes)), "--skip=slurm", "--skip=tracking",
                  "--skip=paths", "--skip=disk", env=env)  # fmt: skip


def line(result, check: str = "nodes-driver") -> str:
    [found] = [ln for ln in result.stdout.splitlines() if ln.split(":")[0].split()[-1:] == [check]]
    return found


def test_a_550_driver_with_the_cuda_13_lock_fails_naming_the_cuda_12_lock(tmp_path: Path, monkeypatch) -> None:
    """sinfo's `driver-550` feature against the CUDA 13 lock's torch (engine-env.sh --cuda's, the default where
    the profile's environment is not found from the login node): exit 2, one line naming engine-cuda12.lock and
    how to build from it; nothing after it runs."""
    monkeypatch.delenv(driver.SKIP_ENV, raising=False)
    result = doctor(tmp_path, stand_ins(tmp_path, sinfo=SINFO_R550))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-1] == (
        "FAIL  nodes-driver: NVIDIA driver 550 (sinfo: driver-550 on 4 of the 4 node(s) of partition gpu) cannot "
        "run scripts/engine-cuda.lock's CUDA 13.0 build, which needs >= 580.65.06 (the default lock: the profile's "
        "environment is not found from here): build the engine environment from scripts/engine-cuda12.lock "
        "instead (bash scripts/engine-env.sh --cuda12 DIR: CUDA 12.8, driver >= 525.60.13), or update the driver "
        "(set PDMCTL_SKIP_DRIVER_CHECK=1 where NVIDIA's cuda-compat package is installed)"
    )
    # the environment the profile activates is read where the login node sees it: CUDA 13.0 there too
    env = engine_env(tmp_path, "13.0")
    result = doctor(tmp_path, stand_ins(tmp_path, sinfo=SINFO_R550),
                    setup=[f"source {env}/bin/activate"], python="python")  # fmt: skip
    assert result.returncode == 2 and f"cannot run torch's CUDA 13.0 build in {env}, which needs >= 580.65.06: build " \
        "the engine environment from scripts/engine-cuda12.lock instead" in line(result), result.stdout  # fmt: skip


def test_a_580_65_driver_passes(tmp_path: Path, monkeypatch) -> None:
    """A login node's nvidia-smi at 580.65.06 (no sinfo here) runs the CUDA 13 lock; the doctor goes on."""
    monkeypatch.delenv(driver.SKIP_ENV, raising=False)
    result = doctor(tmp_path, stand_ins(tmp_path, smi="580.65.06\n580.65.06\n"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert line(result) == (
        "ok    nodes-driver: NVIDIA driver 580.65.06 (this machine's nvidia-smi; the nodes' may differ) runs "
        "scripts/engine-cuda.lock's CUDA 13.0 build, which needs >= 580.65.06 (the default lock: the profile's "
        "environment is not found from here)"
    )
    sinfo = "gpu01|nvidia-driver-580.65.06|gpu:8\ngpu02|nvidia-driver-580.95.05|gpu:8\n"
    result = doctor(tmp_path, stand_ins(tmp_path, sinfo=sinfo))
    assert result.returncode == 0 and line(result).startswith(
        "ok    nodes-driver: NVIDIA driver 580.65.06 (sinfo: nvidia-driver-580.65.06 on 1 of the 2 node(s) of "
        "partition gpu) runs"), result.stdout  # fmt: skip


def test_no_driver_information_says_not_read_without_failing(tmp_path: Path, monkeypatch) -> None:
    """sinfo publishing no driver and no nvidia-smi here: the line says what was not read and what the nodes
    need, and passes; so does a machine without either."""
    monkeypatch.delenv(driver.SKIP_ENV, raising=False)
    result = doctor(tmp_path, stand_ins(tmp_path, sinfo="gpu01|ib,h20|gpu:h20:8\n"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert line(result) == (
        "ok    nodes-driver: not read (sinfo names no driver among the features or GRES of partition gpu; this "
        "machine has no nvidia-smi); scripts/engine-cuda.lock's CUDA 13.0 build (the default lock: the profile's "
        "environment is not found from here) needs an NVIDIA driver >= 580.65.06 on every node: pdmctl doctor "
        "--job reads it there"
    )
    bare = tmp_path / "bare"
    bare.mkdir()
    result = doctor(bare, stand_ins(bare))
    assert result.returncode == 0 and line(result).startswith(
        "ok    nodes-driver: not read (no sinfo here; this machine has no nvidia-smi)"), result.stdout  # fmt: skip


def test_the_cuda_12_environment_runs_on_a_550_driver_and_none_runs_on_a_470(tmp_path: Path, monkeypatch) -> None:
    """Where the profile's python is an environment built from the CUDA 12 lock (torch's CUDA 12.8), R550 passes;
    an R470 driver runs no lock of this project and fails saying so."""
    monkeypatch.delenv(driver.SKIP_ENV, raising=False)
    env = engine_env(tmp_path, "12.8")
    result = doctor(tmp_path, stand_ins(tmp_path, sinfo=SINFO_R550), python=str(env / "bin" / "python"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert line(result) == (f"ok    nodes-driver: NVIDIA driver 550 (sinfo: driver-550 on 4 of the 4 node(s) of "
                            f"partition gpu) runs torch's CUDA 12.8 build in {env}, which needs >= 525.60.13")  # fmt: skip
    with pytest.raises(driver.DriverError, match=r"^NVIDIA driver 470.256.02 \(this machine's nvidia-smi; .*\) cannot "
                       r"run torch's CUDA 12.8 build in .*, which needs >= 525.60.13: no engine lock runs on it \(the "
                       r"oldest, scripts/engine-cuda12.lock, needs >= 525.60.13\): update the driver"):  # fmt: skip
        driver.check_nodes(driver.NodesDriver((470, 256, 2), "470.256.02", "this machine's nvidia-smi; the nodes' may "
                                              "differ"), "12.8", env)  # fmt: skip


def test_sinfo_names_a_driver_in_a_feature_or_a_gres_and_the_oldest_node_counts() -> None:
    """driver-550, nvidia550, nvidia_driver_570.124.06 or a GRES part name a driver; GPU models (nvidia-h100) and
    other features do not; of nodes on several drivers the oldest is the one a job may land on."""
    assert driver.sinfo_driver("n1|nvidia550,ib|gpu:8\n", "the cluster") == driver.NodesDriver(
        (550,), "550", "sinfo: nvidia550 on 1 of the 1 node(s) of the cluster")
    mixed = "n1|nvidia_driver_580.65.06|gpu:8\nn2|x|gpu:nvidia-driver-570.124.06:8(S:0)\nn3|nvidia-h100|gpu:8\n"
    found = driver.sinfo_driver(mixed, "partition gpu")
    assert found is not None and (found.version, found.text) == ((570, 124, 6), "570.124.06")
    assert found.source == "sinfo: nvidia-driver-570.124.06 on 1 of the 3 node(s) of partition gpu"
    assert driver.sinfo_driver("n1|nvidia-h100,a100,cuda12|gpu:a100:8\n|x|y\ngarbage\n", "the cluster") is None
    # a branch alone is compared as a branch: R580 runs CUDA 13, R570 does not
    assert driver.runs((580,), driver.MIN_DRIVER[13]) and not driver.runs((570,), driver.MIN_DRIVER[13])
    assert not driver.runs((580, 42, 1), driver.MIN_DRIVER[13]) and driver.runs((525, 60, 13), driver.MIN_DRIVER[12])


def test_the_check_is_skipped_where_the_site_runs_cuda_compat(monkeypatch) -> None:
    monkeypatch.setenv(driver.SKIP_ENV, "1")
    assert driver.check_login("gpu", None, ()) == "skipped (PDMCTL_SKIP_DRIVER_CHECK=1)"


def test_a_profile_without_slurm_has_no_nodes_to_ask() -> None:
    """The local executor's machine is not the cluster's nodes: the check says so and passes."""
    from pdmctl import doctor as doc
    from pdmctl.executors.base import load_profile

    assert doc.Doctor(load_profile("local"), "sqlite:///x.db").nodes_driver() == (
        "executor local: no nodes to ask (on a GPU machine: python -m pdmctl.backends.verl.driver)")
