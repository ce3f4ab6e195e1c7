"""Rebuild a preset's base model with the warm-up and write it as the shipped file:

    python -m pdmctl.backends.toy.rebuild_base [--preset toy-small]

then record the digest it prints in `shipped.SHIPPED_SHA256` (a test holds the two equal).
"""

from __future__ import annotations

import argparse

import torch

from pdmctl.backends.toy.basemodel import write_shipped
from pdmctl.backends.toy.model import MODEL_PRESETS


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pdmctl.backends.toy.rebuild_base", description=__doc__.split(":")[0])
    parser.add_argument("--preset", default="toy-small", choices=sorted(MODEL_PRESETS))
    args = parser.parse_args(argv)
    path, digest, report = write_shipped(args.preset)
    print(f"{path}: sha256 {digest}")
    print(f"  {report}; kernels {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}")
    print(f'  record it in shipped.SHIPPED_SHA256["{args.preset}"]')


if __name__ == "__main__":
    main()
