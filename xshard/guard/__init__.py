"""The non-finite guard: everything after the reduction, in as few branches as XLA needs.

`xshard.guard.update` is the guarded update (`GuardedUpdate`: the inner optimizer applied or
skipped, and the step's statistics); `xshard.guard.branches` the computations its branches
run; `xshard.guard.state` what it keeps and records. May import: `xshard.stats`,
`xshard.mesh`, `xshard.config`, `xshard.errors`.
"""
