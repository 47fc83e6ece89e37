"""The cross-shard optimizer and its builder from config.

`xshard.optim.cross_shard` builds `xshard.cross_shard` (its types in
`xshard.optim.cross_shard_types`, its update step by step in `xshard.optim.cross_shard_update`,
its records held as one vector per dtype by `xshard.optim.packed`);
`xshard.optim.factory` builds it from config (`xshard.build_optimizer`), with its axis rules
(`xshard.optim.axis_factory`), masks (`xshard.optim.masks`, `xshard.optim.muon_masks`) and
schedule-free support (`xshard.optim.schedule_free`), the learning rate and its schedule
(`xshard.optim.learning_rate`) and the float hyperparameters as inputs of the compiled programs
(`xshard.optim.hyperparams`); `xshard.optim.slots` reads the inner optimizer's state
(`xshard.get_slot`). May import every other part of xshard.
"""
