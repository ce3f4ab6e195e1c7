"""The VeRL backend: pdmctl's masks as VeRL policy losses, rollout top-K plumbing, launch and data.

Modules, each importable on its own:

    plugin   the `verl.plugins` entry point: registers `pdmctl_<method>` losses, the
             `PdmPolicyLossConfig`, the fail-fast check run before the first rollout
    topk     the version-pinned patch (verl==0.9.1): vLLM top-K extraction, the actor-side
             logits processor that calls `pdmctl.masks`
    launch   RunSpec mapping -> VeRL Hydra overrides, the SLURM job body, metric names
    data     DAPO-Math-17k / AIME24 / AIME25 -> VeRL parquet
    cli      `pdmctl data prepare`

Only `plugin` and `topk` import verl at module level; `launch`, `data` and `cli` work
without it (composing overrides against VeRL's config needs it, and says so).
"""
