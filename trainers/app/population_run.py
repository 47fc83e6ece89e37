"""Runs the jobs of one population (`trainers.app.population_groups`) in this process, each
in its own thread, every job as Hydra's basic launcher runs it (its run dir, ``result.json``,
TensorBoard run, checkpoints, its `JobReturn`), its steps through one vmapped program
(`trainers.core.population`).

Two things travel per thread:

- the job's seat in the population: `trial_seat`, read by `trainers.app.builders.build_run`
  when it builds the job's `Trainer`. A Hydra launcher calls the task function with the job's
  config only, so the seat travels in a `contextvars.ContextVar`, which every thread sees
  apart (unset: a plain job);
- the job's Hydra config: Hydra keeps the running job's in one process-wide singleton
  (`HydraConfig`), which every job reads (its output dir, its number, its overrides). While a
  population trains, `thread_hydra_configs` makes it hold one config per thread.

Stop signals reach the main thread only: a population is not stopped cleanly by SIGTERM (each
job logs so); kill it and rerun to resume its trials from their checkpoints.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from omegaconf import DictConfig

if TYPE_CHECKING:
    from trainers.core.population import PopulationSeat

log = logging.getLogger(__name__)

_TRIAL_SEAT: ContextVar[PopulationSeat | None] = ContextVar("xshard_trial_seat", default=None)


def trial_seat() -> PopulationSeat | None:
    """This thread's seat in the population it trains in, or None (a plain job)."""
    return _TRIAL_SEAT.get()


class _ThreadHydraConfig(HydraConfig):
    """A `HydraConfig` whose ``cfg`` is per thread (the shared one until a thread sets its
    own, as ``hydra.core.utils.run_job`` does first)."""

    def __init__(self, shared: Any) -> None:  # no super().__init__: it would set cfg
        self._shared = shared
        self._local = threading.local()

    @property
    def cfg(self) -> Any:
        return getattr(self._local, "cfg", self._shared)

    @cfg.setter
    def cfg(self, value: Any) -> None:
        self._local.cfg = value


@contextlib.contextmanager
def thread_hydra_configs() -> Iterator[None]:
    """Within: Hydra's `HydraConfig` singleton holds one config per thread (module doc)."""
    instances: dict[type, Any] = Singleton._instances
    shared = HydraConfig.instance()
    instances[HydraConfig] = _ThreadHydraConfig(shared.cfg)
    try:
        yield
    finally:
        instances[HydraConfig] = shared


def run_population(
    configs: Sequence[DictConfig], run_job: Callable[[DictConfig, bool], Any]
) -> list[Any]:
    """Runs ``run_job(config, configure_logging)`` for each of `configs` in its own thread, the
    jobs' steps as one population; returns what each returned, in order. The first job
    configures the logging (the jobs' lines go to its log file and the console).

    Raises:
      BaseException: what a job's `run_job` raised (Hydra's `run_job` itself returns a job's
        failure in its `JobReturn`), after every thread ended.
    """
    from trainers.core.population import Population

    population = Population(len(configs))
    results: list[Any] = [None] * len(configs)

    def trial(i: int) -> None:
        _TRIAL_SEAT.set(population.seat(i))
        try:
            results[i] = run_job(configs[i], i == 0)
        except BaseException as error:  # raised in the launcher's thread below
            results[i] = error
        finally:
            population.leave(i)

    with thread_hydra_configs():
        threads = [
            threading.Thread(target=trial, args=(i,), name=f"xshard-trial-{i}")
            for i in range(len(configs))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    log.info(
        "Population of %d trials: %.1f s compiling its programs.",
        len(configs),
        population.compile_seconds or 0.0,
    )
    return results
