"""Rebuild a preset's base model with the warm-up and write it as the shipped file:

    python -m pdmctl.backends.toy.rebuild_base [--preset toy-small] [--out FILE]

then record the digest it prints in `shipped.SHIPPED_SHA256` (a test holds the two equal). An installed model
plugin's preset is a choice too: with `--out`, its weights go there, and the plugin records the file and its
digest (`ModelPlugin(weights=..., sha256=...)`, docs/EXTENDING.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from pdmctl import plugins
from pdmctl.backends.toy.basemodel import write_shipped
from pdmctl.backends.toy.model import MODEL_PRESETS


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pdmctl.backends.toy.rebuild_base", description=__doc__.split(":")[0])
    for problem in plugins.load_all("model"):  # the installed model plugins' presets are choices too
        print(f"skipped {problem}")
    parser.add_argument("--preset", default="toy-small", choices=sorted(MODEL_PRESETS))
    parser.add_argument("--out", type=Path, default=None, help="write the weights here, not to the shipped file")
    args = parser.parse_args(argv)
    path, digest, report = write_shipped(args.preset, args.out)
    print(f"{path}: sha256 {digest}")
    print(f"  {report}; kernels {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}")
    where = "the plugin's sha256" if args.out else f'shipped.SHIPPED_SHA256["{args.preset}"]'
    print(f"  record it in {where}")


if __name__ == "__main__":
    main()
