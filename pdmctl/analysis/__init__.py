"""The token-level direction analysis (MATH.md, "The token-level direction analysis"; paper §4.2), an
instrument of its own that uses the CPU testbed (`pdmctl.backends.toy`) through a learner
(`trainer.Learner`), a rollout batch (`rollout.Rollout`) and `probe` (a stale batch, its tokens' D, Ḋ
and r); nothing in the testbed imports it. One concern a file:

- `run`: `run_analysis`, seed by seed (worker processes), and the results combined;
- `results`: `AnalysisResult` and its parts (what `--json` writes and the report reads);
- `criteria`: the ratio and predictive criteria on the disagreement tokens, rates and differences;
- `protocols`: how the update that ΔD measures is taken, from the same weights and optimizer state;
- `counterfactual`: the main protocol, per token a carried update with it kept against one with it masked;
- `inference`: the primary metric (named before the run) with its two intervals, the secondary comparisons
  under Holm, the bootstrap's coverage;
- `decomposition`: ΔD's first-order pieces per token (token products); `decomposition_rows`: per
  seed and over seeds;
- `bands`: the tokens by top-K mass (`python -m pdmctl.analysis.bands [preset]`);
- `tables`: the tables and the per-seed CSV; `figures`: the figures
  (`python -m pdmctl.analysis.figures ANALYSIS.json DIR`).
"""
