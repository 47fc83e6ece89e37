"""This run as an elastic replica group (``reduction.axes.<axis>.elastic``, docs/reductions.md).

`open_group` reads the axis's ``elastic`` node (checked with the reduction,
`xshard.config.elastic_groups`), refuses a run without the optional extra (torch and torchft: one
line, exit 2), starts the group's torchft manager (`trainers.cluster.torchft_group`) and makes the
trainer's periodic axis elastic. `ElasticGroup.join` is the group's first round with its peers
(a restarted group takes a live peer's state and step there); the group leaves the quorum when
the run ends. `standby_of` and `Standby`: this process as its group's warm standby
(``elastic.standby=true``), which `trainers.app.training` prepares before its go. Without an
elastic axis nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
from omegaconf import DictConfig

if TYPE_CHECKING:
    from trainers.app.builders import RunOptions, RunParts
    from trainers.config.run import TrainerOptions

log = logging.getLogger(__name__)

#: What the optional extra adds (``--help`` and the missing-extra message say it).
EXTRA = "pip install 'xshard[elastic]' (CPU torch and torchft: elastic replica groups)"


def group_config(cfg: DictConfig, key: str) -> dict[str, Any]:
    """The run's flattened config that every group must share: less
    `trainers.config.plain.PER_GROUP` and the elastic node `key`
    (`trainers.config.plain.flat_config` leaves out ``PER_PROCESS``)."""
    from trainers.config.plain import PER_GROUP, flat_config, under

    return {k: v for k, v in flat_config(cfg).items() if not under(k, (key, *PER_GROUP))}


def elastic_key(axis: str) -> str:
    """The key of `axis`'s elastic node, for messages."""
    return f"reduction.axes.{axis}.elastic"


def elastic_axis(cfg: DictConfig) -> tuple[str, Any] | None:
    """The axis whose ``elastic`` node is set and that node (as composed), or None."""
    for axis, node in (cfg.get("reduction") or {}).get("axes", {}).items():
        if node.get("elastic") is not None:
            return str(axis), node.elastic
    return None


def require_extra(key: str) -> None:
    """Refuses an elastic axis (its node's `key`) where torch or torchft cannot be imported.

    Raises:
      ConfigError: one line naming `key` and the extra to install.
    """
    from xshard.errors import ConfigError

    for module in ("torch", "torchft"):
        try:
            importlib.import_module(module)
        except ImportError:
            raise ConfigError(f"{key}: needs {module}, not installed: {EXTRA}.") from None


@dataclasses.dataclass(frozen=True)
class ElasticGroup:
    """A run that is one replica group: its key, id, and the trainer's periodic programs."""

    key: str
    group: int
    programs: Any  # trainers.core.periodic.PeriodicPrograms
    shardings: Any  # the trainer's state_shardings

    def join(self, state: Any, trainer: Any, batch: Any, opts: TrainerOptions) -> Any:
        """The first round with the peers: `state`, or a live peer's when this group is
        behind them (its step, outer and inner optimizer states). It waits there for the
        others' next sync (a live group asks for a quorum only at its syncs).

        What the run will compile is compiled first (`compile_ahead`): once this group
        joined, the others wait for it at their next sync, which must not wait for its
        compilation too.
        """
        compile_ahead(trainer, state, batch, opts)
        return self.programs.join(state, self.shardings)


def compile_ahead(trainer: Any, state: Any, batch: Any, opts: TrainerOptions) -> None:
    """Compiles, for the `trainer`'s states like `state` and batches like `batch`, the step
    programs of the steps ``state.step + 1 .. opts.steps`` (a peer's later step meets fewer)
    and the elastic sync's (delta, apply, heal:
    `trainers.core.periodic.sync.PeriodicPrograms.compile_elastic`), those not compiled yet."""
    first = int(np.asarray(state.step)) + 1
    trainer.compile_run(state, batch, first, opts.steps, opts.stat_periods)
    if trainer.periodic_programs is not None:  # open_group refuses an axis that is not periodic
        trainer.periodic_programs.compile_elastic(state, trainer.state_shardings)


def group_run(cfg: DictConfig, options: RunOptions, parts: RunParts) -> tuple[RunOptions, RunParts]:
    """`options` and `parts` as an elastic group runs them (unchanged without an elastic axis):
    the group's data seed (a function of (seed, group)) and the trainer's first gradient path
    only (the group's sync is wired to its programs: no race between paths)."""
    found = elastic_axis(cfg)
    if found is None:
        return options, parts
    require_extra(elastic_key(found[0]))  # before torch is imported
    from trainers.cluster.torchft_group import group_seed

    options = dataclasses.replace(options, data_seed=group_seed(options.seed, found[1].group))
    return options, dataclasses.replace(parts, paths=dict([next(iter(parts.paths.items()))]))


@dataclasses.dataclass(frozen=True)
class Standby:
    """This process as its group's warm standby (``elastic.standby=true``,
    `trainers.cluster.standby`): its group."""

    group: int

    def compile(self, trainer: Any, state: Any, batch: Any, opts: TrainerOptions) -> None:
        """Compiles the step programs of every step a peer may be at (from `state`'s, a new
        state's, on) and the elastic sync's (`compile_ahead`)."""
        compile_ahead(trainer, state, batch, opts)

    @contextlib.contextmanager
    def before_go(self) -> Iterator[None]:
        """Any error in it ends the process (`trainers.cluster.standby.exit_before_go`)
        without writing to the group's run dir, the group's live process being its owner."""
        from trainers.cluster.standby import exit_before_go
        from trainers.exits import EXIT_CONFIG_ERROR
        from xshard.errors import ConfigError

        try:
            yield
        except BaseException as e:  # the run's own handlers would write result.json
            exit_before_go(self.group, e, EXIT_CONFIG_ERROR if isinstance(e, ConfigError) else 1)

    def take_over(self, output_dir: str) -> None:
        """Waits for the supervisor's go (exits if it is gone); then the run is the group's."""
        from trainers.cluster.standby import take_over

        take_over(self.group, output_dir)


def standby_of(cfg: DictConfig) -> Standby | None:
    """This run as its group's warm standby, or None (not a standby).

    A standby of several processes, without the extra, or whose stdin is not its
    supervisor's pipe is refused: one line, exit 2, nothing written (`Standby.before_go`).
    """
    from trainers.cluster.standby import check_standby_stdin
    from xshard.errors import ConfigError

    found = elastic_axis(cfg)
    if found is None or not found[1].get("standby"):
        return None
    key = elastic_key(found[0])
    standby = Standby(int(found[1].group))
    with standby.before_go():  # a refusal writes nothing to the group's run dir either
        if (cfg.get("distributed") or {}).get("enabled"):
            raise ConfigError(
                f"{key}.standby=true: a standby is one process; a group of several "
                "(distributed.enabled=true) restarts whole, without a standby (drop --standby)."
            )
        require_extra(key)
        check_standby_stdin(key)
    return standby


@contextlib.contextmanager
def open_group(
    cfg: DictConfig, parts: RunParts, stop: Callable[[], object]
) -> Iterator[ElasticGroup | None]:
    """This run's replica group (None: no elastic axis), its manager stopped on exit. `stop`
    is the run's stop request: a round that waits for its peers when it comes is left
    (`trainers.cluster.torchft_group.TorchftExchange`).

    Raises:
      ConfigError: without the optional extra, or for a mesh where the axis has more than
        one replica.
    """
    from xshard.errors import ConfigError

    found = elastic_axis(cfg)
    if found is None:
        yield None
        return
    axis, node = found
    key = elastic_key(axis)
    require_extra(key)
    from trainers.cluster.multihost import current
    from trainers.cluster.torchft_group import GroupOptions, TorchftExchange

    programs = parts.trainer.periodic_programs
    if programs is None:  # check_elastic refuses an elastic axis that is not periodic
        raise ConfigError(f"{key}: the axis is not periodic.")
    options = GroupOptions(**{f: node[f] for f in GroupOptions._fields})
    exchange = TorchftExchange(options, key, group_config(cfg, key), current(), stop)
    try:
        programs.use_exchange(exchange)
        log.info("Replica group %d of %s, lighthouse %s.", options.group, key, options.lighthouse)
        yield ElasticGroup(key, options.group, programs, parts.trainer.state_shardings)
    finally:
        exchange.close()
