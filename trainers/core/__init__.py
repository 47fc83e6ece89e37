"""The training loop itself, JAX only: it never reads a config.

The train state and step (`step`: gradients, the cross-shard update, statistics; its types
`step_types`, its loss and gradient `grads`; the ZeRO variants in `zero` and `zero_step`), the
step levels (`step_levels`), the `Trainer` (`trainer`: init, step, fit; its set-up `step_tx`,
its placement on the mesh `placement`, its compiling and dispatching `dispatch`, its compiled
programs `programs`, its loop `loop`), a periodic mesh axis (`periodic`, its programs
`periodic_programs`), the `Hook` protocol (`hook`), the step's metrics (`metrics`), the model
state of non-trained variables (`model_state`), the agreed stop vote (`stop_vote`).

May import: `xshard`, `trainers.tasks` (sharding rules), `trainers.errors`. Never
`trainers.config`, `trainers.app`, the hooks, checkpoints or the cluster: those build on it.
"""
