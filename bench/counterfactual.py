"""CPU time of one seed's direction analysis under the given protocols, at one torch thread:

    python bench/counterfactual.py toy-small 1001 carried
    python bench/counterfactual.py toy-small 1001 counterfactual   # counterfactual (and the carried update)
"""

from __future__ import annotations

import sys
import time

import torch

from pdmctl.analysis.run import run_analysis
from pdmctl.backends.toy import ToyConfig

if __name__ == "__main__":
    model, seed, protocols = sys.argv[1], int(sys.argv[2]), tuple(sys.argv[3].split(","))
    torch.set_num_threads(1)
    cpu, wall = time.process_time(), time.perf_counter()
    result = run_analysis(ToyConfig(model=model), [seed], protocols)
    print(f"{model} seed {seed} {','.join(protocols)}: {time.process_time() - cpu:.1f} s CPU, "
          f"{time.perf_counter() - wall:.1f} s wall, {result.out_of_region_per_seed[0]} out-of-region tokens")
