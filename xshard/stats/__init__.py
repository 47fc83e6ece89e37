"""Statistics of gradients computed on device, inside the compiled step.

`xshard.stats.tree` holds the norms, counts and histograms of a pytree; `xshard.stats.layers`
the per-leaf tables (norms, histograms); `xshard.stats.shards` the per-shard statistics of the
local gradients. May import: `xshard.mesh`, `xshard.config`, `xshard.errors`.
"""
