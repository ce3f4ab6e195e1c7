"""The CUDA engine environment's locks (scripts/engine-cuda.lock: CUDA 13; scripts/engine-cuda12.lock: CUDA 12)
and the driver check beside them.

That a lock still resolves from the index is CI's step `bash scripts/engine-lock.sh --check [--cuda12]`
(network, about 7 s each, then about 27 s for the glibc floor); these read the committed files: each holds
what the engine needs at versions that fit together.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pdmctl.backends.verl import driver

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "scripts" / "engine-cuda.lock"
LOCK12 = REPO / "scripts" / "engine-cuda12.lock"


def pins(lock: Path = LOCK) -> dict[str, str]:
    out = {}
    for line in lock.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line)
        if m:
            out[m.group(1).lower().replace("_", "-")] = m.group(2)
    return out


def version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def test_the_lock_holds_the_engine_at_versions_that_fit_together() -> None:
    p = pins()
    assert len(p) > 200
    # VeRL 0.9.1 with the vLLM, torch and transformers its `vllm` extra pins
    assert (p["verl"], p["vllm"], p["torch"], p["transformers"]) == ("0.9.1", "0.24.0", "2.11.0", "5.9.0")
    # torch from the index is the CUDA 13.0 build: the driver check's table knows it
    assert version(p["cuda-toolkit"])[:2] == (13, 0) and 13 in driver.MIN_DRIVER_BRANCH
    # the Megatron half the presets select (vanilla_mbridge=true): mbridge on megatron-core, no Megatron-Bridge
    assert "mbridge" in p and "einops" in p and "megatron-bridge" not in p
    assert (0, 13) <= version(p["megatron-core"])[:2] < (0, 17)  # pyproject's verl extra
    # Transformer Engine in megatron-core 0.16's range (>=2.9,<2.12), its CUDA 13 core only
    assert p["transformer-engine"] == p["transformer-engine-torch"] == p["transformer-engine-cu13"]
    assert (2, 9) <= version(p["transformer-engine"])[:2] < (2, 12)
    assert "transformer-engine-cu12" not in p
    assert "pdmctl" not in p  # it installs from the clone


def test_the_cuda_12_lock_holds_the_engine_on_a_torch_built_for_cuda_12() -> None:
    """scripts/engine-cuda12.lock: VeRL 0.9.1 on vLLM 0.19.1, the newest vLLM on the index whose torch (2.10.0)
    is the CUDA 12.8 build; no CUDA 13 package in it; the engine's other pins as the CUDA 13 lock's (transformers,
    the Megatron half, Transformer Engine with its CUDA 12 core), and the driver checks know its CUDA."""
    p, p13 = pins(LOCK12), pins()
    assert len(p) > 200
    assert (p["verl"], p["vllm"], p["torch"], p["transformers"]) == ("0.9.1", "0.19.1", "2.10.0", "5.9.0")
    assert version(p["nvidia-cuda-runtime-cu12"])[:2] == (12, 8) and 12 in driver.MIN_DRIVER
    assert driver.LOCKS[12][0] == "scripts/engine-cuda12.lock" and driver.LOCKS[13][0] == "scripts/engine-cuda.lock"
    assert not [n for n in p if n == "cuda-toolkit" or "cu13" in n or (n.startswith("nvidia-") and
                                                                      version(p[n])[:1] == (13,) and n != "nvidia-ml-py")]  # fmt: skip
    assert p["transformer-engine"] == p["transformer-engine-torch"] == p["transformer-engine-cu12"] == p13["transformer-engine"]
    for same in ("megatron-core", "mbridge", "transferqueue"):  # pinned alike in both .in files
        assert p[same] == p13[same], same
    assert "megatron-bridge" not in p and "pdmctl" not in p
    assert LOCK12.read_text().splitlines()[1].strip() == "#    bash scripts/engine-lock.sh --cuda12"


def test_engine_lock_refuses_an_unknown_option_before_it_resolves(tmp_path: Path) -> None:
    proc = subprocess.run(["bash", str(REPO / "scripts" / "engine-lock.sh"), "--cuda11"], capture_output=True,
                          text=True, cwd=tmp_path, timeout=60)  # fmt: skip
    assert (proc.returncode, proc.stderr.strip().splitlines()) == (
        2, ["engine-lock.sh: unknown option '--cuda11' (usage: bash scripts/engine-lock.sh [--check] [--cuda12])"])


def test_the_driver_check_reads_nvidia_smi_and_names_the_branch_torch_needs() -> None:
    recorded = "580.65.06\n580.65.06\n580.65.06\n580.65.06\n580.65.06\n580.65.06\n580.65.06\n580.65.06\n"
    [v] = set(driver.parse_driver_versions(recorded))
    assert driver.check(v, "13.0") == "NVIDIA driver 580.65.06 runs torch's CUDA 13.0 build (needs >= 580)"
    assert "needs >= 525" in driver.check("535.183.06", "12.8")
    with pytest.raises(
        driver.DriverError,
        match=r"^NVIDIA driver 535.183.06 is older than torch's CUDA 13.0 build needs \(driver >= 580, the R580 "
        r"branch or newer\): build the engine environment from scripts/engine-cuda12.lock instead \(bash "
        r"scripts/engine-env.sh --cuda12 DIR: CUDA 12.8, driver >= 525.60.13\), or update the driver",
    ):
        driver.check("535.183.06", "13.0")
    with pytest.raises(driver.DriverError, match=r"build needs \(driver >= 525.*\): no engine lock runs on it"):
        driver.check("470.256.02", "12.8")
    with pytest.raises(driver.DriverError, match="CPU build"):
        driver.check("580.65.06", None)
    with pytest.raises(driver.DriverError, match="where a driver version"):
        driver.parse_driver_versions(
            "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver\n"
        )


def test_the_driver_check_fails_in_one_line_without_a_gpu(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": str(tmp_path)}  # no nvidia-smi on the PATH: what a CPU node gives
    env.pop(driver.SKIP_ENV, None)
    proc = subprocess.run([sys.executable, "-m", "pdmctl.backends.verl.driver"], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: no nvidia-smi: this is not a GPU node (or the driver is not installed)"
    ]


ENV_USAGE = "usage: bash scripts/engine-env.sh [--cuda | --cuda12] [--pdmctl WHEEL] DIR"


@pytest.mark.parametrize(
    ("args", "line"),
    [
        ([], f"engine-env.sh: no DIR ({ENV_USAGE})"),
        (["--gpu", "x"], f"engine-env.sh: unknown option '--gpu' ({ENV_USAGE})"),
        (["a", "b"], f"engine-env.sh: more than one DIR ('a', 'b') ({ENV_USAGE})"),
        (["--cuda", "--cuda12", "x"], f"engine-env.sh: --cuda and --cuda12 (two locks): give one ({ENV_USAGE})"),
        (["x", "--pdmctl"], f"engine-env.sh: --pdmctl needs a wheel or sdist of pdmctl ({ENV_USAGE})"),
        (["--pdmctl", "no.whl", "x"], f"engine-env.sh: --pdmctl no.whl: no such file ({ENV_USAGE})"),
    ],
)
def test_engine_env_refuses_bad_arguments_before_anything_is_written(tmp_path: Path, args, line) -> None:
    proc = subprocess.run(["bash", str(REPO / "scripts" / "engine-env.sh"), *args], capture_output=True, text=True,
                          cwd=tmp_path, timeout=60)  # fmt: skip
    assert (proc.returncode, proc.stderr.strip().splitlines()) == (2, [line])
    assert list(tmp_path.iterdir()) == []



def test_the_copy_an_installed_pdmctl_carries_takes_pdmctl_from_its_wheel(tmp_path: Path) -> None:
    """A wheel ships scripts/engine-env.sh with its locks as pdmctl/_data/scripts/ (`pdmctl docs
    scripts/engine-env.sh`), with no clone beside it to install pdmctl from: without --pdmctl it says so in one
    line; with it, it goes on to the node's needs and the lock beside it (refused here at the glibc check,
    before anything is written)."""
    import shutil

    data = tmp_path / "site-packages" / "pdmctl" / "_data"
    (data / "scripts").mkdir(parents=True)
    for name in ("engine-env.sh", "engine-cuda.lock"):
        shutil.copy2(REPO / "scripts" / name, data / "scripts" / name)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "cat", "awk", "sort", "head", "dirname", "basename"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    (bin_dir / "getconf").write_text(f"#!{shutil.which('bash')}\necho 'glibc 2.28'\n")
    (bin_dir / "getconf").chmod(0o755)
    wheel = tmp_path / "pdmctl-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"")
    target = tmp_path / "env"

    def env_sh(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(bin_dir / "bash"), str(data / "scripts" / "engine-env.sh"), *args],
                              capture_output=True, text=True, timeout=60, env={"PATH": str(bin_dir)})  # fmt: skip

    alone = env_sh("--cuda", str(target))
    assert (alone.returncode, alone.stderr.strip().splitlines()) == (2, [
        "engine-env.sh: this copy came with an installed pdmctl, with no clone to install pdmctl from: give its "
        f"wheel, --pdmctl FILE ({ENV_USAGE})"]), alone  # fmt: skip
    with_wheel = env_sh("--cuda", "--pdmctl", str(wheel), str(target))
    assert with_wheel.returncode == 2 and with_wheel.stdout.startswith("engine-env.sh --cuda needs"), with_wheel
    assert with_wheel.stderr.strip() == "engine-env.sh: glibc 2.28 here, and --cuda needs glibc >= 2.31 " \
                                        "(llguidance 1.7.6's wheels)"  # fmt: skip
    assert not target.exists()


@pytest.mark.parametrize(
    ("glibc", "line"),
    [("glibc 2.28", "engine-env.sh: glibc 2.28 here, and --cuda needs glibc >= 2.31 (llguidance 1.7.6's wheels)"),
     ("glibc 2.31", "engine-env.sh: no C++ compiler (g++) on the PATH: Transformer Engine's PyTorch binding is "
                    "compiled at install")],
)  # fmt: skip
def test_the_cuda_environment_says_what_a_node_needs_before_it_installs_anything(tmp_path: Path, glibc, line) -> None:
    """`engine-env.sh --cuda` prints the node's needs first (glibc >= 2.31, driver >= 580, a C++ compiler for
    Transformer Engine, no CUDA toolkit), then refuses in one line, before writing DIR, a glibc below
    llguidance's wheels or a machine without g++."""
    import shutil

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "cat", "awk", "sort", "head", "dirname"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    (bin_dir / "getconf").write_text(f"#!{shutil.which('bash')}\necho '{glibc}'\n")
    (bin_dir / "getconf").chmod(0o755)
    target = tmp_path / "env"
    proc = subprocess.run([str(bin_dir / "bash"), str(REPO / "scripts" / "engine-env.sh"), "--cuda", str(target)],
                          capture_output=True, text=True, timeout=60, env={"PATH": str(bin_dir)})  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.strip() == line, proc
    needs = proc.stdout.splitlines()
    assert needs[0].startswith("engine-env.sh --cuda needs")
    assert "glibc >= 2.31" in needs[1] and "NVIDIA driver >= 580" in needs[2] and "C++ compiler" in needs[3]
    assert "no CUDA toolkit or nvcc" in needs[4]
    assert not target.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bin"]


def test_the_cuda_12_environment_says_what_a_node_needs_before_it_installs_anything(tmp_path: Path) -> None:
    """`engine-env.sh --cuda12` names its own needs (the CUDA 12 lock's glibc floor and the packages that set
    it, a driver >= 525.60.13 for torch 2.10.0's CUDA 12.8) and refuses an older glibc in one line, before
    writing DIR."""
    import shutil

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "cat", "awk", "sort", "head", "dirname"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    (bin_dir / "getconf").write_text(f"#!{shutil.which('bash')}\necho 'glibc 2.28'\n")
    (bin_dir / "getconf").chmod(0o755)
    target = tmp_path / "env"
    proc = subprocess.run([str(bin_dir / "bash"), str(REPO / "scripts" / "engine-env.sh"), "--cuda12", str(target)],
                          capture_output=True, text=True, timeout=60, env={"PATH": str(bin_dir)})  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "engine-env.sh: glibc 2.28 here, and --cuda12 needs glibc >= 2.31 (vllm 0.19.1's wheels)"), proc
    needs = proc.stdout.splitlines()
    assert needs[0].startswith("engine-env.sh --cuda12 needs") and "glibc >= 2.31: vllm 0.19.1 has no wheel" in needs[1]
    assert needs[2].strip() == "an NVIDIA driver >= 525.60.13: torch 2.10.0's CUDA 12.8 build (checked at the end, on " \
        "a node with a GPU)"  # fmt: skip
    assert "the CUDA 12 headers" in needs[4] and not target.exists()
