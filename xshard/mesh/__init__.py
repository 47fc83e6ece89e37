"""The device mesh and what a trace says about its axes.

`xshard.mesh.spec` reads a ``mesh`` config node and resolves its axis sizes without devices;
`xshard.mesh.build` builds the `jax.sharding.Mesh` (and checks it against the batch);
`xshard.mesh.simulated` bounds the simulated CPU devices; `xshard.mesh.context` and
`xshard.mesh.vma` say whether a reduction's axes are manual in the trace in context and which
axes a value varies over; `xshard.mesh.collectives` issues one collective per dtype over a
whole pytree. May import: `xshard.config`, `xshard.errors`.
"""
