"""The CUDA engine environment's lock (scripts/engine-cuda.lock) and the driver check beside it.

That the lock still resolves from the index is CI's step `bash scripts/engine-lock.sh --check` (network,
about 7 s); these read the committed file: it holds what the engine needs at versions that fit together.
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


def pins() -> dict[str, str]:
    out = {}
    for line in LOCK.read_text().splitlines():
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


def test_the_driver_check_reads_nvidia_smi_and_names_the_branch_torch_needs() -> None:
    recorded = "580.65.06\n580.65.06\n580.65.06\n580.65.06\n580.65.06\n580.65.06\n580.65.06\n580.65.06\n"
    [v] = set(driver.parse_driver_versions(recorded))
    assert driver.check(v, "13.0") == "NVIDIA driver 580.65.06 runs torch's CUDA 13.0 build (needs >= 580)"
    assert "needs >= 525" in driver.check("535.183.06", "12.8")
    with pytest.raises(
        driver.DriverError,
        match=r"^NVIDIA driver 535.183.06 is older than torch's CUDA 13.0 build needs \(driver >= 580",
    ):
        driver.check("535.183.06", "13.0")
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


@pytest.mark.parametrize(
    ("args", "line"),
    [
        ([], "engine-env.sh: no DIR (usage: bash scripts/engine-env.sh [--cuda] DIR)"),
        (
            ["--gpu", "x"],
            "engine-env.sh: unknown option '--gpu' (usage: bash scripts/engine-env.sh [--cuda] DIR)",
        ),
        (
            ["a", "b"],
            "engine-env.sh: more than one DIR ('a', 'b') (usage: bash scripts/engine-env.sh [--cuda] DIR)",
        ),
    ],
)
def test_engine_env_refuses_bad_arguments_before_anything_is_written(tmp_path: Path, args, line) -> None:
    proc = subprocess.run(["bash", str(REPO / "scripts" / "engine-env.sh"), *args], capture_output=True, text=True,
                          cwd=tmp_path, timeout=60)  # fmt: skip
    assert (proc.returncode, proc.stderr.strip().splitlines()) == (2, [line])
    assert list(tmp_path.iterdir()) == []


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
