"""Benchmarks of xshard against hand-written JAX training steps.

Run ``python -m benchmarks.run`` (or ``make bench``); ``docs/benchmarks.md`` explains the
method and the findings. One concern per module:

* `benchmarks.run` — the command line: runs the sections, writes JSON and Markdown.
* `benchmarks.env` — device setup and the record of the machine the numbers come from.
* `benchmarks.workloads` — tasks, configs, meshes and batches shared by every section.
* `benchmarks.baselines` — the hand-written steps (``jit`` + shardings, ``pmap`` + ``pmean``)
  and xshard's ``cross_shard`` in ``shard_map`` without the trainer's statistics.
* `benchmarks.variants` — every compared step as a `StepLoop` the timer can drive.
* `benchmarks.context` — the run's settings and the cache of everything built (and compiled).
* `benchmarks.timing` — interleaved block timing, medians, spreads and paired ratios.
* `benchmarks.compile_events` — counting compilations through ``jax.monitoring``.
* `benchmarks.hlo` — kernels, collectives and memory read from compiled executables.
* `benchmarks.sections` — the seven sections; `benchmarks.report` — their Markdown tables.
"""
