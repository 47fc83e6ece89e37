"""The training loop itself, JAX only: it never reads a config (it takes plain values).

The `Trainer` (`trainer`: init, step, fit) holds its parts: the placement of the arrays on the
mesh and the initial state (`placement.DevicePlacement`), the step programs (`step`, a
sub-package: the step's data `step.types`, its levels `step.levels`, its static description
`step.step_spec`, the optimizer as it runs it `step.optimizer`, the loss and gradient `step.grads`,
the step function of one level `step.train_step` with its ZeRO variants `step.zero_update`,
its programs, lowered, compiled and dispatched by `step.programs.StepPrograms`) and a periodic
mesh axis's programs (`periodic`, a sub-package: the axis `periodic.axis`, its sync programs
`periodic.sync`). `fit`'s loop is `loop` (its result `loop.FitResult`). Besides: the `Hook`
protocol (`hook`), the step's metrics (`metrics`), the model state of non-trained variables
(`model_state`), the ZeRO layout (`zero`), the dtypes (`precision`), the agreed stop vote
(`stop_vote`), JAX's persistent compilation cache (`compile_cache`), a population of trials
whose steps run as one vmapped program (`population`).

May import: `xshard`, `trainers.tasks` (sharding rules),
`trainers.exits`. Never `trainers.config` (an import contract checks it), `trainers.app`, the
hooks, checkpoints or the cluster: those build on it.
"""
