"""`pdmctl report`: held-out avg@16 tables with seed confidence intervals, comparisons and learning curves.

Laid out as rliable is: `stats` (small pure functions), `resample` (the bootstraps) and `plots`
(figures) stay apart; `collect` reads the ledger, `build` assembles the report as data, `tables` and
`write` render it, `cli` mounts the command.
"""
