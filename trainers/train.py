"""`python -m trainers.train [overrides]`: the Hydra entry point of the generic trainer.

    python -m trainers.train task=mlp optimizer=adam optimizer.learning_rate=3e-4 reduction=sum
    python -m trainers.train -m reduction=sum,mean optimizer=sgd,adam      # a sweep
    python -m trainers.train task=mlp hydra.run.dir=runs/a    # rerun it to resume from runs/a

Returns ``trainer.objective`` (the final training loss, or e.g. ``eval/loss`` of the final
evaluation), so optimizing sweepers can use it. Every run ends with a summary (steps, skipped
steps, final and best loss, evaluation, the checkpoint) and writes it to
``<output dir>/result.json``. Your own ``@hydra.main`` keeps all of this by calling
`trainers.run` (`trainers.app.entry`); `train(cfg)` is `trainers.app.training.train`.

Exit status of a single run: `trainers.exits.EXIT_STATUSES` (``--help`` prints them; docs/
reliability.md explains each): 0 done, 1 unexpected, 2 bad config or input, 3 non-finite,
4 a lost process, 75 stopped by a signal after saving (rerun to resume).

In a multirun (``-m``) a job that fails or diverges does not exit: it is recorded and the sweep
goes on (`trainers.app.sweep`, docs/sweeps.md); a signal still stops the sweep (75).
"""

from __future__ import annotations

if __name__ == "__main__":  # first of all, before JAX is imported (trainers.cluster.signal_latch)
    from trainers.cluster import signal_latch

    signal_latch.install()

from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from trainers.app.cli_overrides import check_group_overrides
from trainers.app.main import main as xshard_main
from trainers.exits import EXIT_CONFIG_ERROR, EXIT_NONFINITE, EXIT_PREEMPTED

__all__ = ["EXIT_CONFIG_ERROR", "EXIT_NONFINITE", "EXIT_PREEMPTED", "main", "run", "train"]

if TYPE_CHECKING:
    from trainers.app.entry import run as run
    from trainers.app.training import train as train


def __getattr__(name: str) -> Any:
    """`run` and `train`, imported on first use: ``--help`` and ``--cfg`` never import JAX."""
    if name == "run":
        from trainers.app.entry import run

        return run
    if name == "train":
        from trainers.app.training import train

        return train
    raise AttributeError(f"module 'trainers.train' has no attribute {name!r}")


@xshard_main(config_path="pkg://xshard.conf", config_name="xshard_train")
def main(cfg: DictConfig) -> float | None:
    """Hydra main of ``python -m trainers.train``: `trainers.app.entry.run` on the config."""
    from trainers.app.entry import run

    return run(cfg)


if __name__ == "__main__":
    check_group_overrides()  # schedule=null: one line and exit 2, not Hydra's traceback
    main()
