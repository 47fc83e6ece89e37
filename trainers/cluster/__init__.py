"""Several processes as one run, and a run's life as a process.

Joining the cluster (`multihost`, `join`, after the launch's `roll_call`) and its start-up
agreements (`same_config`), the peer watchdog (`watchdog`), the run dirs every process shares
(`run_dirs`), stop signals (`preemption` while training, `signal_latch` before and after);
elastic replica groups on torchft (`torchft_group` and `torchft_listen`, where a group's
servers listen: the only modules importing torch; `elastic_launch`: the lighthouse and a
supervisor; `standby`: a group's warm standby).

May import: `trainers.checkpoint`, `trainers.core`, `trainers.rundir`, `trainers.config`,
`trainers.exits`, `xshard`. Never the hooks or the app, nor omegaconf or hydra: the app
hands it records and plain values (an import contract).
"""
