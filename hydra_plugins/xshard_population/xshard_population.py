"""Hydra launcher ``hydra/launcher=population``: the jobs of a sweep that differ only in float
hyperparameters train as one population, in this process (docs/sweeps.md).

    python -m trainers.train -m hydra/launcher=population task=mlp \\
        optimizer.learning_rate=1e-3,1e-2,1e-1 optimizer.weight_decay=0,1e-2

Each job's config is composed as Hydra's basic launcher composes it; the jobs are grouped
(`trainers.app.population_groups`: a group's jobs differ only in inputs of the compiled
programs), and each group runs, one after another, as one population
(`trainers.app.population_run`), a group of one as a plain job. Every job keeps its run dir,
``result.json``, TensorBoard run and checkpoints, and returns its `JobReturn` as with the basic
launcher, so the sweep table and the sweepers see every job. Importing this module (Hydra's
plugin scan does) imports no JAX. No ``from __future__ import annotations``: Hydra's scan
executes the module before it is in ``sys.modules``, where a dataclass looks its string
annotations up.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, configure_log, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict

log = logging.getLogger(__name__)


@dataclass
class PopulationLauncherConf:
    """``hydra/launcher=population``: no options."""

    _target_: str = "hydra_plugins.xshard_population.xshard_population.PopulationLauncher"


ConfigStore.instance().store(
    group="hydra/launcher", name="population", node=PopulationLauncherConf, provider="xshard"
)


class PopulationLauncher(Launcher):
    """Runs a sweep's jobs in this process, those that differ only in float hyperparameters
    as one population each (module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.config: DictConfig | None = None
        self.task_function: TaskFunction | None = None
        self.hydra_context: HydraContext | None = None

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        """Keeps what `launch` needs (Hydra calls it once, before the first `launch`)."""
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Any, initial_job_idx: int) -> list[JobReturn]:
        """Runs the jobs of `job_overrides` (numbered from `initial_job_idx`) group by group;
        returns their `JobReturn`s in the order of `job_overrides`."""
        from trainers.app.population_groups import group_jobs
        from trainers.app.population_run import run_population

        setup_globals()
        assert self.config is not None and self.hydra_context is not None
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        log.info(f"Launching {len(job_overrides)} jobs locally, in populations")
        configs = []
        for idx, overrides in enumerate(job_overrides, initial_job_idx):
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            config = self.hydra_context.config_loader.load_sweep_config(
                self.config, list(overrides)
            )
            with open_dict(config):
                config.hydra.job.id = idx
                config.hydra.job.num = idx
            configs.append(config)
        returns: list[Any] = [None] * len(configs)
        for group in group_jobs(configs):
            for note in group.notes:
                log.info("Population: %s", note)
            numbers = [initial_job_idx + j for j in group.jobs]
            if len(group.jobs) == 1:
                returns[group.jobs[0]] = self._run(configs[group.jobs[0]], True)
                continue
            log.info("Population: jobs %s train as one population", numbers)
            done = run_population([configs[j] for j in group.jobs], self._run)
            for j, ret in zip(group.jobs, done, strict=True):
                returns[j] = ret
        return returns

    def _run(
        self,
        config: DictConfig,
        configure_logging: bool,
        before_task: Callable[[], Any] | None = None,
    ) -> JobReturn:
        """One job, as Hydra's basic launcher runs it; `before_task` is called first in its
        task (once Hydra configured the job)."""
        assert self.hydra_context is not None and self.task_function is not None
        task, run_before = self.task_function, before_task

        def task_function(cfg: DictConfig) -> Any:
            if run_before is not None:
                run_before()
            return task(cfg)

        return run_job(
            hydra_context=self.hydra_context,
            task_function=task_function,
            config=config,
            job_dir_key="hydra.sweep.dir",
            job_subdir_key="hydra.sweep.subdir",
            configure_logging=configure_logging,
        )
