"""Reductions across shards: what crosses each mesh axis, when, in how many bits, by what rule.

`xshard.reduce.gradients` is the semantics of `xshard.cross_shard`'s reduction
(`xshard.reduce_gradients`), with the per-shard clip (`xshard.reduce.shard_clip`, on
`xshard.reduce.clipping`); `xshard.reduce.per_axis` reduces per mesh axis by its
`xshard.config.axes.AxisRule`: through a codec (`xshard.reduce.codecs`,
`xshard.reduce.compressed`), by Adasum (`xshard.reduce.adasum`), hierarchically
(`xshard.reduce.hierarchical`) or periodically (`xshard.reduce.periodic`: local SGD, DiLoCo).
May import: `xshard.stats`, `xshard.mesh`, `xshard.config`, `xshard.errors`.
"""
