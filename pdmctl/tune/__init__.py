"""pdmctl tune: Optuna studies whose trials are ordinary runs (keys, ledger, executors).

space.py   the search space: Hydra's override grammar -> Optuna distributions
study.py   the driver: ask, submit through orchestrate, tell; reading a study
trial.py   inside a trial's job: report each evaluation, stop when pruned (imported by pdmctl.job)
cli.py     `pdmctl tune`, `pdmctl tune status`
page.py    `pdmctl report --tune NAME`: the study's HTML page
"""
