"""The Hydra app: the only wing that reads the composed config (``cfg``).

`main` is ``@hydra.main`` with xshard's guards (`config_guard`, `allowlist`, the signal
latch); `entry.run` is the body of a Hydra main that trains (exit statuses, multirun
semantics); `builders` turn the config into the task, optimizer, hooks and `Trainer`; `help`
renders ``--help``; `preflight` checks before training; `sweep` records multirun jobs;
`cli_overrides` refuses command lines Hydra would answer with a traceback;
`population_groups` and `population_run` group a multirun's jobs into populations and run one
(``hydra/launcher=population``); `scaffold` writes
the experiment repo of ``python -m trainers.new`` (its files: ``scaffold_files/``).

May import every other wing. Nothing imports it but the entry points (`trainers.train`,
`trainers.doctor`, `trainers.new`) and `trainers.run` / `trainers.main`.
"""
