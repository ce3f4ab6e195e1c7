"""The NVIDIA driver against the CUDA build of torch, in one line (run on a GPU node):

    python -m pdmctl.backends.verl.driver          exit 0: one line saying it fits; exit 2: one line why not

torch from the package index brings its own CUDA runtime (the engine lock's torch 2.11.0: CUDA 13.0,
`cuda-toolkit==13.0.2`); what the node must give is a driver of a branch that runs it. NVIDIA's minor
version compatibility (docs.nvidia.com/deploy/cuda-compatibility, Table 1): CUDA 13.x needs a driver
>= 580, CUDA 12.x >= 525. An older driver fails only when the first CUDA call is made, in every Ray worker,
after the queue wait: this says so before. (NVIDIA's forward-compatibility package, `cuda-compat-13-0`,
lets some data-center drivers older than 580 run CUDA 13; where a site uses it, this check is too strict
and says how to pass it: PDMCTL_SKIP_DRIVER_CHECK=1.)
"""

from __future__ import annotations

import os
import subprocess
import sys

MIN_DRIVER_BRANCH = {12: 525, 13: 580}  # CUDA major -> oldest driver branch (minor version compatibility)
SKIP_ENV = "PDMCTL_SKIP_DRIVER_CHECK"


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
            f"the R{need} branch or newer): update the driver, or install a torch built for the CUDA this "
            f"driver runs (set {SKIP_ENV}=1 where NVIDIA's cuda-compat package is installed)"
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
    versions = sorted(set(parse_driver_versions(out)))
    if len(versions) > 1:
        raise DriverError(f"the GPUs of this node report different drivers: {', '.join(versions)}")
    return versions[0]


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
