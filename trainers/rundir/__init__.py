"""The run dir on disk as untrusted ground: writes that never follow a link out of it, the
run's log file, and the checks before anything is written.

`links` refuses paths a link leads out of the run dir and writes files without following
links; `log_file` is the run's log file handler and one-line logging to it; `disk` checks that
a dir is writable and has room.

May import: `trainers.config`, `trainers.exits`, `xshard.config`, `xshard.errors`. No JAX,
no omegaconf or hydra (an import contract).
"""
