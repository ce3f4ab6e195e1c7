"""`pdmctl doctor`: one line per check, exit 2 at the first that fails; nvidia-smi's output from fixtures
(tests/data/nvidia-smi: nothing here has an NVIDIA GPU), the checks on the login node and inside a job of
the CI's one-node SLURM."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pdmctl import doctor
from tests.conftest import pdmctl
from tests.test_spool import mlflow_server  # noqa: F401 (a fixture)

SMI = Path(__file__).parent / "data" / "nvidia-smi"
REPO = Path(__file__).resolve().parents[1]


def test_nvidia_smi_output_is_parsed_and_its_failures_are_one_line() -> None:
    gpus = doctor.parse_nvidia_smi((SMI / "h20x8-driver570.csv").read_text())
    assert len(gpus) == 8 and gpus[7] == doctor.Gpu(7, "NVIDIA H20", "570.124.06", 97871)
    assert doctor.parse_nvidia_smi("") == []
    for name, said in (("no-devices.txt", "No devices were found"), ("no-driver.txt", "couldn't communicate")):
        with pytest.raises(doctor.CheckFailed, match=said):
            doctor.parse_nvidia_smi((SMI / name).read_text())


def test_driver_against_the_cuda_build_of_torch() -> None:
    assert "needs >= 580.65.6" in doctor.check_driver("580.65.06", "13.0")
    with pytest.raises(doctor.CheckFailed, match=r"driver 570.124.06 is older than CUDA 13.0 needs \(>= 580.65.6, R580\)"):
        doctor.check_driver("570.124.06", "13.0")
    assert doctor.check_driver("570.124.06", "12.8")  # CUDA 12's minor-version compatibility: R525 on
    with pytest.raises(doctor.CheckFailed, match="CPU build"):
        doctor.check_driver("580.65.06", None)


def test_gpu_count_against_the_profiles_gres() -> None:
    four = doctor.parse_nvidia_smi((SMI / "h20x4-driver580.csv").read_text())
    with pytest.raises(doctor.CheckFailed, match=r"4 GPU\(s\) visible, the profile's gres asks for 8 per node"):
        doctor.check_gpus(four, 8, None)
    assert doctor.check_gpus(four * 2, 8, "h20") == ("8 GPU(s) (NVIDIA H20, 95.6 GiB each), the profile asks for 8 "
                                                     "per node")  # fmt: skip
    with pytest.raises(doctor.CheckFailed, match="gpu_type is a100"):
        doctor.check_gpus(four * 2, 8, "a100")


def test_gpu_model_against_the_profiles_gpu_type_by_whole_words_and_the_memory_reported() -> None:
    """Every GPU must be the profile's gpu_type, word for word: h20 is not an H200 (a substring would take it
    for one), SLURM's autodetected type names (nvidia_h100_80gb_hbm3) are nvidia-smi's names; no profile field
    or model preset states a memory need, so the memory is reported, not compared."""
    h200 = doctor.parse_nvidia_smi((SMI / "h200x8-driver580.csv").read_text())
    with pytest.raises(doctor.CheckFailed) as failed:
        doctor.check_gpus(h200, 8, "h20")
    assert str(failed.value) == "the GPUs are NVIDIA H200, the profile's gpu_type is h20"
    assert doctor.check_gpus(h200, 8, "h200") == "8 GPU(s) (NVIDIA H200, 140.4 GiB each), the profile asks for 8 per node"
    h20 = doctor.parse_nvidia_smi((SMI / "h20x4-driver580.csv").read_text())
    with pytest.raises(doctor.CheckFailed, match=r"^the GPUs are NVIDIA H20, NVIDIA H200, the profile's gpu_type is "
                                                 r"h20 \(NVIDIA H200 is not\)$"):  # fmt: skip
        doctor.check_gpus([*h20, *h200[4:]], 8, "h20")
    assert doctor.check_gpus([*h20, *h200[4:]], 8, None).startswith("8 GPU(s) (NVIDIA H20, NVIDIA H200, 95.6 GiB to "
                                                                    "140.4 GiB)")  # fmt: skip
    for gpu_type, name, same in (("h20", "NVIDIA H20", True), ("H20", "NVIDIA H200", False),
                                 ("a100", "NVIDIA A100-SXM4-80GB", True), ("a10", "NVIDIA A100-SXM4-80GB", False),
                                 ("nvidia_h100_80gb_hbm3", "NVIDIA H100 80GB HBM3", True),
                                 ("rtx4090", "NVIDIA GeForce RTX 4090", True), ("l40s", "NVIDIA L40", False)):  # fmt: skip
        assert doctor.gpu_type_matches(gpu_type, name) is same, (gpu_type, name)


def test_a_gpu_model_other_than_the_profiles_fails_the_node_in_one_line(tmp_path: Path) -> None:
    """nvidia-smi on the node lists H200s, the profile says h20: the gpus line fails, the last, exit 2."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text(f"#!/bin/sh\ncat {SMI / 'h200x8-driver580.csv'}\n")
    (fake / "nvidia-smi").chmod(0o755)
    result = pdmctl("doctor", "--cluster", str(_filled_h20(tmp_path, gpu_type="h20")), "--on-node", "--skip=driver",
                    env={"PATH": f"{fake}:{os.environ['PATH']}"})  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-1] == "FAIL  gpus: the GPUs are NVIDIA H200, the profile's gpu_type is h20"


def test_disk_against_the_checkpoint_plan(tmp_path: Path) -> None:
    with pytest.raises(doctor.CheckFailed, match=r"1.0 TB free, the checkpoint plan of 48 run\(s\) keeps up to 31.7 TB"):
        doctor.check_disk(tmp_path / "runs", int(31.7e12), 48, free=int(1e12))
    assert " free; quota not read (no lfs here); the checkpoint plan" in doctor.check_disk(tmp_path / "runs", 10, 1,
                                                                                          quota="no lfs here")  # fmt: skip


def test_the_h20_profile_as_shipped_fails_its_first_check_in_one_line() -> None:
    result = pdmctl("doctor", "--cluster", "h20")
    assert result.returncode == 2
    lines = result.stdout.strip().splitlines()
    assert lines[-1].startswith("FAIL  placeholders: cluster h20: tracking_uri still holds the placeholder 'CHANGE-ME'")
    assert len(lines) == 2  # the header, then the first check: it stops there


def _filled_h20(tmp_path: Path, **changes) -> Path:
    """clusters/h20.yaml with every placeholder filled in with this machine's paths."""
    data = yaml.safe_load((REPO / "clusters" / "h20.yaml").read_text())
    (tmp_path / "models").mkdir(exist_ok=True)
    (tmp_path / "data").mkdir(exist_ok=True)
    data.update(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", workdir=str(tmp_path / "runs"), partition="debug",
                account=None, qos=None, setup=["true"], models_dir=str(tmp_path / "models"),
                data_dir=str(tmp_path / "data"), network={"NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"},
                network_interface="lo", python=sys.executable)  # fmt: skip
    data.update(changes)
    path = tmp_path / "h20-filled.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_on_node_reads_nvidia_smi_and_stops_at_the_first_failing_check(tmp_path: Path) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text(f"#!/bin/sh\ncat {SMI / 'h20x4-driver580.csv'}\n")
    (fake / "nvidia-smi").chmod(0o755)
    profile = _filled_h20(tmp_path)
    env = {"PATH": f"{fake}:{os.environ['PATH']}"}
    result = pdmctl("doctor", "--cluster", str(profile), "--on-node", "--skip=driver", env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[1] == "ok    placeholders: no placeholder left in the profile"
    assert lines[2] == "ok    nvidia-smi: 4 GPU(s), driver 580.65.06"
    assert lines[3] == "skip  driver"
    assert lines[4].startswith("FAIL  gpus: 4 GPU(s) visible, the profile's gres asks for 8 per node")
    assert len(lines) == 5
    # the driver against this torch, a CPU build: failing, in its own line
    result = pdmctl("doctor", "--cluster", str(profile), "--on-node", env=env)
    assert result.returncode == 2 and result.stdout.strip().splitlines()[-1].startswith(
        "FAIL  driver: torch is a CPU build")


def test_paths_of_the_runs_given_are_checked(tmp_path: Path) -> None:
    from pdmctl import grid, orchestrate

    ctx = orchestrate.make_context(str(_filled_h20(tmp_path)))
    specs = grid.expand(["backend=verl", "model=qwen3-4b-base"], None, "doc")
    assert "nothing to look for" not in doctor.Doctor(ctx.profile, ctx.tracking_uri).paths()
    with pytest.raises(doctor.CheckFailed, match=rf"run {specs[0].key} .*{tmp_path / 'models'}/Qwen3-4B-Base is not a directory"):
        doctor.Doctor(ctx.profile, ctx.tracking_uri, specs).paths()
    need, counted = doctor.checkpoint_plan(specs)
    assert counted == 1 and need > 3 * 40e9  # Qwen3-4B: 48.3 GB a checkpoint, 3 kept


def test_unknown_check_is_refused_in_one_line() -> None:
    result = pdmctl("doctor", "--skip=gpu")
    assert result.returncode == 2 and "--skip gpu: no such check" in result.stderr


def _slurm_answers() -> bool:
    return shutil.which("sinfo") is not None and subprocess.run(
        ["sinfo", "-h"], capture_output=True, timeout=30).returncode == 0  # fmt: skip


@pytest.mark.slurm
@pytest.mark.cluster
def test_doctor_runs_its_node_checks_in_a_job_of_the_ci_slurm(tmp_path: Path) -> None:
    if not _slurm_answers():
        pytest.skip("no SLURM here (.ci/slurm_up.sh)")
    tmp_path.chmod(0o755)
    profile = _filled_h20(tmp_path, nodes=1, cpus_per_task=1, time=10, signal_delay_s=120, save_grace_s=0, sbatch=[],
                          max_concurrent=1)
    # the login node's checks pass (the partition as profiled, against sinfo), then the job's: the CI's node has
    # 8 fake GPUs and no NVIDIA driver, so nvidia-smi fails there, shown failing, exit 2
    result = pdmctl("doctor", "--cluster", str(profile), "--job", timeout=300)
    out = result.stdout.strip().splitlines()
    assert result.returncode == 2, result.stdout + result.stderr
    assert any(ln.startswith("ok    slurm: partition debug takes 1 node(s) x 8 GPU(s)") for ln in out), out
    assert any(ln.startswith("pdmctl doctor: cluster h20, on the node ") for ln in out), out  # inside the job
    assert any(ln.startswith("FAIL  nvidia-smi: not found on ") for ln in out), out
    assert out[-1] == "FAIL  job: the nodes' checks ended with exit code 2"
    # past the GPUs (skipped): the imports of this environment, the paths and the tracking store from the node
    result = pdmctl("doctor", "--cluster", str(profile), "--job", "--skip=nvidia-smi", "--skip=vllm",
                    "--skip=megatron-bridge", "--skip=transformer-engine", timeout=300)  # fmt: skip
    out = result.stdout.strip().splitlines()
    assert result.returncode == 0, result.stdout + result.stderr
    on_node = out[next(i for i, ln in enumerate(out) if ln.startswith("pdmctl doctor: cluster h20, on the node ")):]
    for check in ("shm", "memlock", "verl", "megatron", "paths", "tracking", "disk", "all-reduce"):
        assert any(ln.startswith(f"ok    {check}: ") for ln in on_node), (check, out)
    # a one-node job's all-reduce runs across the node's own processes (torch sees none of its 8 gres GPUs)
    assert any(re.fullmatch(r"ok    all-reduce: gloo on \S+, 2 process\(es\): the sum came back 2; 4 MiB in \d+\.\d "
                            r"ms: bus bandwidth \d+(\.\d)? [KMGT]?B/s, algorithm bandwidth \d+(\.\d)? [KMGT]?B/s \(2 "
                            r"rank\(s\), gloo over TCP on the loopback, torch sees no GPU\)", ln) for ln in on_node), out  # fmt: skip


def test_shm_is_checked_against_the_nodes_gpus_and_a_containers_default_fails() -> None:
    """/dev/shm needs a GB free per GPU of the node (one on a CPU node); Docker's 64 MiB fails, saying how to
    mount a larger one; the node's real /dev/shm is read by the check itself."""
    assert doctor.check_shm(64 * 10**9, 9 * 10**9, 8) == "9.0 GB free of 64.0 GB (at least 8.0 GB for 8 GPU(s))"
    assert doctor.check_shm(2 * 10**9, 10**9, 0).endswith("(at least 1.0 GB for 1 GPU(s))")
    with pytest.raises(doctor.CheckFailed, match=r"^/dev/shm has 67.1 MB free of 67.1 MB, under 8.0 GB for 8 GPU\(s\)"
                                                 r".*--shm-size, or --ipc=host"):  # fmt: skip
        doctor.check_shm(64 << 20, 64 << 20, 8)
    with pytest.raises(doctor.CheckFailed, match=r"under 1\.0 GB for 1 GPU"):
        doctor.check_shm(10**9, 10**9 - 1, 1)
    from pdmctl.executors.base import load_profile

    st = os.statvfs("/dev/shm")
    line = doctor.Doctor(load_profile("slurm-local"), "sqlite:///x.db").shm()  # this node's, as statvfs reads it
    assert line.endswith(f" free of {doctor._bytes(st.f_blocks * st.f_frsize)} (at least 1.0 GB for 1 GPU(s))"), line


def test_memlock_matters_only_where_the_node_has_infiniband() -> None:
    """Without an InfiniBand device any limit passes (NCCL goes over sockets); with one, only unlimited does,
    and the failure says where the limit comes from under SLURM."""
    import resource

    assert doctor.check_memlock(8 << 20, []).startswith("8.4 MB (no InfiniBand device on this node")
    assert doctor.check_memlock(resource.RLIM_INFINITY, ["mlx5_0"]) == "unlimited, for NCCL over InfiniBand (mlx5_0)"
    with pytest.raises(doctor.CheckFailed, match=r"^65.5 KB on a node with InfiniBand \(mlx5_0, mlx5_1\): NCCL "
                                                 r"cannot register .*PropagateResourceLimitsExcept=MEMLOCK"):  # fmt: skip
        doctor.check_memlock(64 << 10, ["mlx5_0", "mlx5_1"])


def test_a_server_without_a_login_is_refused_unless_it_is_on_loopback() -> None:
    """Where a tracking server answers without a login, the address decides: one that resolves to loopback
    only is this machine's alone and passes; any other (a cluster's login node) fails in one line."""
    for uri in ("http://127.0.0.1:5000", "http://localhost:5000/", "http://[::1]:5000"):
        doctor._login_needed_beyond_this_machine(uri)
    for uri, host in (("http://10.1.2.3:5000", "10.1.2.3"), ("https://192.168.7.9/mlflow", "192.168.7.9")):
        with pytest.raises(doctor.CheckFailed) as failed:
            doctor._login_needed_beyond_this_machine(uri)
        assert str(failed.value) == (
            f"tracking server {uri}: answers without a login, so whoever reaches {host} can change or delete every "
            "run: serve it with `pdmctl server start` (a login per user) and set MLFLOW_TRACKING_USERNAME and "
            "MLFLOW_TRACKING_PASSWORD where you submit")


def test_a_login_over_plain_http_to_another_machine_is_refused() -> None:
    """A login (user and password, or a token) sent over http:// to a host beyond loopback crosses the network in
    clear: refused in one line. Over https://, to loopback, or without a login, it passes."""
    login = {"MLFLOW_TRACKING_USERNAME": "alice", "MLFLOW_TRACKING_PASSWORD": "a-long-password"}
    for uri, environ in (("https://10.1.2.3:5000", login), ("http://127.0.0.1:5000", login),
                         ("http://localhost:5000", login), ("http://10.1.2.3:5000", {}), ("sqlite:///x.db", login)):  # fmt: skip
        doctor.login_in_clear(uri, environ)
    with pytest.raises(doctor.CheckFailed) as failed:
        doctor.login_in_clear("http://10.1.2.3:5000", login)
    assert str(failed.value) == (
        "tracking server http://10.1.2.3:5000: plain http:// to 10.1.2.3, and a login is set "
        "(MLFLOW_TRACKING_USERNAME): it would cross the network in clear with every call; serve HTTPS (`pdmctl "
        "server start --tls`) and give https://, or reach the server through loopback (an SSH tunnel)")
    with pytest.raises(doctor.CheckFailed, match=r"a login is set \(MLFLOW_TRACKING_TOKEN\)"):
        doctor.login_in_clear("http://mlflow.cluster.example:5000", {"MLFLOW_TRACKING_TOKEN": "t0k3n"})


def test_the_tracking_check_fails_a_login_over_plain_http_before_sending_anything() -> None:
    """`pdmctl doctor` with a login and an http:// tracking server on another host (a documentation address no
    one answers): the tracking line fails at once, the last, exit 2."""
    login = {"MLFLOW_TRACKING_USERNAME": "alice", "MLFLOW_TRACKING_PASSWORD": "a-long-password"}
    result = pdmctl("doctor", "--tracking-uri", "http://192.0.2.10:5000", "--skip=paths", "--skip=disk", env=login)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-1].startswith(
        "FAIL  tracking: tracking server http://192.0.2.10:5000: plain http:// to 192.0.2.10, and a login is set "
        "(MLFLOW_TRACKING_USERNAME): it would cross the network in clear"), result.stdout


@pytest.mark.postgres
def test_the_tracking_check_on_the_ci_server_without_a_login(mlflow_server: str) -> None:  # noqa: F811
    """The CI's MLflow server asks for no login and listens on loopback: the check passes, saying so.
    Reached by this machine's host name, which MLflow's DNS-rebinding guard refuses (403), the check says
    that, not that the server wants a login."""
    import socket

    nologin = {"MLFLOW_TRACKING_USERNAME": "", "MLFLOW_TRACKING_PASSWORD": ""}
    local = pdmctl("doctor", "--tracking-uri", mlflow_server, "--skip=paths", "--skip=disk", env=nologin)
    assert local.returncode == 0, local.stdout + local.stderr
    assert any(ln.startswith(f"ok    tracking: tracking server {mlflow_server}: answers from ") and
               ln.endswith("(no login asked, none given)") for ln in local.stdout.splitlines()), local.stdout  # fmt: skip
    assert socket.gethostname() != "localhost"
    named = mlflow_server.replace("127.0.0.1", socket.gethostname())
    refused = pdmctl("doctor", "--tracking-uri", named, "--skip=paths", "--skip=disk", env=nologin)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stdout.strip().splitlines()[-1].startswith(
        f"FAIL  tracking: tracking server {named}: refuses the host name {named.split('//')[1]} (MLflow's guard"), refused.stdout


def test_a_left_out_check_leaves_out_those_that_need_it_and_the_first_failure_ends_the_lines() -> None:
    """`--skip shared-files` leaves out all-reduce (its rendezvous address) and so Ray (its process group);
    a check that fails is the last line."""
    ran: list[str] = []

    def check(name: str, fails: bool = False):
        def run() -> str:
            ran.append(name)
            if fails:
                raise doctor.CheckFailed("broken")
            return "fine"

        return name, run

    needs = {"all-reduce": "shared-files", "ray": "all-reduce"}
    lines: list[str] = []
    checks = [check("tracking"), check("shared-files"), check("all-reduce"), check("ray")]
    assert doctor.run_lines(checks, ["shared-files"], lines.append, needs)
    assert lines == ["ok    tracking: fine", "skip  shared-files", "skip  all-reduce (needs shared-files)",
                     "skip  ray (needs all-reduce)"] and ran == ["tracking"]  # fmt: skip
    lines.clear()
    assert not doctor.run_lines([check("shared-files", fails=True), check("ray")], [], lines.append, needs)
    assert lines == ["FAIL  shared-files: broken"]
