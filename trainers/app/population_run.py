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
  population trains, `thread_hydra_configs` makes it hold one config per thread;
- the job's log file: the first job configures the logging (the console and its log file),
  the others add a log file of their own in their run dir (`own_log_file`), each file taking
  its own thread's records only.

Stop signals reach the main thread only: there `run_population` watches them (a
`StopOnSignal` of the first job's ``trainer.stop_signals``), its population reads the watch
once a round, and every trial's run stops on it (`trial_stop`) after the same step, each with
its checkpoint, then ends as a plain run stopped by a signal does (exit 75). A rerun resumes
every trial from the latest step all of them saved (`agreed_source`).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from omegaconf import DictConfig

if TYPE_CHECKING:
    from trainers.checkpoint.resume import RestoreSource
    from trainers.cluster.preemption import FollowedStop
    from trainers.core.population import PopulationSeat

log = logging.getLogger(__name__)

_TRIAL_SEAT: ContextVar[PopulationSeat | None] = ContextVar("xshard_trial_seat", default=None)


def trial_seat() -> PopulationSeat | None:
    """This thread's seat in the population it trains in, or None (a plain job)."""
    return _TRIAL_SEAT.get()


def trial_stop() -> FollowedStop | None:
    """A trial's stop (the population's, read once a round), or None outside a population."""
    from trainers.cluster.preemption import FollowedStop

    seat = trial_seat()
    return None if seat is None else FollowedStop(lambda: seat.stop_signal)


def agreed_source(source: RestoreSource | None) -> RestoreSource | None:
    """What a job resumes from (`source`, `trainers.checkpoint.resume.find_resume_source`),
    in a population the step every trial saved (`PopulationSeat.agree_resume`): a killed
    population may have saved a step in some trials only. This trial's later steps are moved
    to ``<checkpoints>.ahead/`` (its checkpoint hook saves them again; nothing is deleted).
    Outside a population: `source`."""
    from trainers.checkpoint.io import complete_steps
    from trainers.checkpoint.resume import RestoreSource, move_aside

    seat = trial_seat()
    if seat is None:
        return source
    own = source is not None and source.own
    saved = complete_steps(source.directory) if own and source is not None else []
    agreed = seat.agree_resume(saved)
    if not own or source is None or agreed == max(saved):
        return source
    for step in (s for s in saved if agreed is None or s > agreed):
        move_aside(source.directory / str(step), "ahead", "not saved by every trial")
    log.warning("Resuming from step %s, the latest every trial of the population saved.", agreed)
    return None if agreed is None else RestoreSource(source.directory, agreed, own=True)


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


class _OwnThread(logging.Filter):
    """Passes the records of one thread only."""

    def __init__(self, ident: int) -> None:
        super().__init__()
        self.ident = ident

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread == self.ident


def own_log_file(first: bool, configured: threading.Event) -> logging.Handler | None:
    """Gives the calling thread's job its own log file (module doc): the first job's file
    handlers keep its records only; another job's thread waits for the first to have
    configured the logging, then adds a `RunLogFile` named as the first's, in its own output
    dir. Returns the handler added (to remove at the job's end), or None.
    """
    from trainers.rundir.log_file import RunLogFile

    root, mine = logging.getLogger(), _OwnThread(threading.get_ident())
    files = [h for h in root.handlers if isinstance(h, logging.FileHandler)]
    if first:
        for handler in files:
            handler.addFilter(mine)
        configured.set()
        return None
    configured.wait()
    files = [h for h in root.handlers if isinstance(h, logging.FileHandler)]
    if not files:  # the job logging writes no file
        return None
    name = Path(files[0].baseFilename).name
    handler = RunLogFile(Path(HydraConfig.get().runtime.output_dir) / name)
    handler.setFormatter(files[0].formatter)
    handler.addFilter(mine)
    root.addHandler(handler)
    return handler


#: How often the main thread, waiting for the trials, lets a stop signal's handler run (s).
JOIN_POLL_S = 0.1


def run_population(
    configs: Sequence[DictConfig],
    run_job: Callable[[DictConfig, bool, Callable[[], Any]], Any],
) -> list[Any]:
    """Runs ``run_job(config, configure_logging, before_task)`` for each of `configs` in its
    own thread, the jobs' steps as one population; returns what each returned, in order. The
    jobs start together and agree on the step they resume from (`agreed_source`); then the
    first trains alone to its first step, the others wait for it (`Population.stepping`: their
    start-up programs, the same as its, are then read from the compilation cache, not compiled
    N times at once). The first job configures the logging; `before_task` (called by the job's
    task, first) gives each job its own log file (`own_log_file`). Stop signals are watched
    here, in the main thread (module doc).

    Raises:
      BaseException: what a job's `run_job` raised (Hydra's `run_job` itself returns a job's
        failure in its `JobReturn`; a job stopped by a signal raises `SystemExit`), after
        every thread ended.
    """
    from trainers.cluster.preemption import StopOnSignal
    from trainers.core.population import Population

    with StopOnSignal(_watched_signals(configs[0])) as stop:
        population = Population(len(configs), should_stop=lambda: stop.signal_name)
        results: list[Any] = [None] * len(configs)
        configured = threading.Event()

        def trial(i: int) -> None:
            _TRIAL_SEAT.set(population.seat(i))
            handlers: list[logging.Handler | None] = []
            before_task = lambda: handlers.append(own_log_file(i == 0, configured))
            try:
                results[i] = run_job(configs[i], i == 0, before_task)
            except BaseException as error:  # raised in the launcher's thread below
                results[i] = error
            finally:
                population.leave(i)
                if i == 0:  # also when the first job failed before its task
                    configured.set()
                for handler in filter(None, handlers):
                    logging.getLogger().removeHandler(handler)
                    handler.close()

        with thread_hydra_configs():
            threads = [
                threading.Thread(target=trial, args=(i,), name=f"xshard-trial-{i}")
                for i in range(len(configs))
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                # In short waits: a signal's handler runs in this (the main) thread between
                # them. A process's signal may interrupt another thread (a trial's, XLA's);
                # Python then runs the handler at the main thread's next bytecode, which a
                # join without a timeout would hold back until the trials ended (never).
                while thread.is_alive():
                    thread.join(JOIN_POLL_S)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    if stop.received is not None:  # after the trials' last round: the sweep's next job's
        _hand_on(stop.received)
    log.info(
        "Population of %d trials: %.1f s compiling its programs.",
        len(configs),
        population.compile_seconds or 0.0,
    )
    return results


def _watched_signals(config: DictConfig) -> tuple[Any, ...]:
    """The stop signals of `config`'s ``trainer.stop_signals`` (the default ones if it names
    one that does not exist: the job says so itself, in one line)."""
    from trainers.cluster.preemption import DEFAULT_SIGNALS, stop_signals

    try:
        return stop_signals(list(config.trainer.stop_signals))
    except (KeyError, TypeError, AttributeError):
        return DEFAULT_SIGNALS


def _hand_on(sig: signal.Signals) -> None:
    """Delivers `sig` again to the handler now installed (`trainers.cluster.signal_latch`'s
    latch, installed by the entry point): a signal that came after the trials' last round
    stops the sweep's next job before its first step, as with the basic launcher. Where no
    handler of Python's is installed (the default action would end the process), nothing."""
    if callable(signal.getsignal(sig)) and signal.getsignal(sig) is not signal.default_int_handler:
        signal.raise_signal(sig)
