"""The VeRL backend: pdmctl's masks as VeRL policy losses, rollout top-K plumbing, launch and data.

Modules, each importable on its own:

    plugin   the `verl.plugins` entry point: registers `pdmctl_<method>` losses, the
             `PdmPolicyLossConfig`, the fail-fast check run before the first rollout
    topk     the version-pinned patch (verl==0.9.1): vLLM top-K extraction, the actor-side
             logits processor that calls `pdmctl.masks`
    launch   RunSpec mapping -> VeRL Hydra overrides (presets, defaults, the run's own `verl.*` keys),
             where the weights are read; `python -m ...launch {wait-ray,probe,train}` runs jobbody's steps
    schema   `verl.<key>` checked against VeRL's own config schema
    jobbody  the job on its nodes: the SLURM job body (Ray on every node, the trainer, the stall
             watchdog, cleanup), the trainer outside SLURM
    checkpoints  a run's checkpoints pruned to max_ckpt_to_keep across its attempts
    progress the trainer's progress reports (tokens, micro-batches) and the stall watchdog that reads them
    metrics  VeRL's metric names and printed validation lines -> pdmctl's
    describe what --dry-run prints: every distinct command, its runs, GPU-hours, wall time, storage
    data     DAPO-Math-17k / AIME24 / AIME25 -> VeRL parquet
    cli      `pdmctl data prepare`

Only `plugin` and `topk` import verl at module level; `launch`, `jobbody`, `metrics`, `data` and `cli` work
without it (composing overrides against VeRL's config needs it, and says so).
"""
