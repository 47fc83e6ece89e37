"""OmegaConf resolvers of xshard's configs (registered by the ``xshard_searchpath`` plugin).

- ``${xshard.run_or_sweep:A,B}``: A in a single run, B in a job of a multirun (``-m``).
- ``${xshard.run_name:}``: the run's overrides as Hydra writes them in directory names
  (``hydra.job.override_dirname``), or the job name when there are none.

``paths.tb_dir`` uses both, so TensorBoard names every run by its overrides (see
``xshard_train.yaml``).
"""

from __future__ import annotations

import os

from omegaconf import OmegaConf


def run_or_sweep(run_value: str, sweep_value: str) -> str:
    """`sweep_value` in a multirun job, `run_value` otherwise."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    multirun = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    return sweep_value if multirun else run_value


def run_name() -> str:
    """``hydra.job.override_dirname`` (path separators replaced), or the job's name."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return "run"
    job = HydraConfig.get().job
    name = job.override_dirname or job.name or "run"
    return name.replace(os.sep, "_")


def register_resolvers() -> None:
    """Registers the resolvers above (idempotent)."""
    for name, fn in (("xshard.run_or_sweep", run_or_sweep), ("xshard.run_name", run_name)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
