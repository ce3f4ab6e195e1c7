"""The direction analysis on the real engine: a VeRL run's snapshot of one step's updates, replayed offline.

    replay   the snapshot (pdmctl.backends.verl.snapshot writes it) read back, the run's Hugging Face model,
             the loss, clip and AdamW of VeRL's update, the checks against VeRL's own update
    effects  the counterfactual on the out-of-region tokens (kept against masked, from the same snapshot),
             the primary metric, channels and regime lines of `pdmctl analyze --engine verl RUN_DIR --step N`
"""
