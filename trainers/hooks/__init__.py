"""The built-in hooks a run attaches to `trainers.core.Trainer.fit`.

Logging, one pipeline (`run_logger`: the hook; `log_sink`: what every logger implements;
`logged_scalars`, `noise_ema`: what is logged; `tensorboard`, `hparams`, `csv_logger`,
`wandb_logger`, `mlflow_logger`: the loggers), the progress bar
and non-finite monitor (`monitor`), profiling and throughput (`perf`), evaluation
(`evaluation`: the hook; `evaluator`, `eval_agreement`, `eval_scoring`: the eval step) and the
run's summary (`summary`).

May import: `trainers.core`, `trainers.checkpoint` (what was saved), `trainers.tasks`,
`trainers.data` (eval batches and their padding), `trainers.rundir`, `trainers.config`,
`trainers.exits`, `xshard`. Never `trainers.app` or the cluster.
"""
