"""`python -m trainers.train [overrides]`: the Hydra entry point of the generic trainer.

    python -m trainers.train task=mlp optimizer=adam optimizer.learning_rate=3e-4 reduction=sum
    python -m trainers.train -m reduction=sum,mean optimizer=sgd,adam      # a sweep

Returns the final training loss, so optimizing sweepers can use it.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("trainers.train")

# Exit codes (documented in the README).
EXIT_CONFIG_ERROR = 2


def _hparams(cfg: DictConfig) -> dict[str, Any]:
    """The HParams entry: Hydra's group choices plus the values people sweep most."""
    from hydra.core.hydra_config import HydraConfig

    choices = {}
    if HydraConfig.initialized():
        runtime = HydraConfig.get().runtime.choices
        choices = {k: v for k, v in runtime.items() if not k.startswith("hydra/") and v is not None}
    return {
        **choices,
        "seed": cfg.seed,
        "optimizer.learning_rate": cfg.optimizer.learning_rate,
        "reduction.mode": cfg.reduction.mode,
        "trainer.batch_size": cfg.trainer.batch_size,
        "trainer.microbatches": cfg.trainer.microbatches,
        "trainer.grad_impl": cfg.trainer.grad_impl,
        "clip": cfg.clip,
    }


def train(cfg: DictConfig) -> float:
    """Builds everything from `cfg`, trains, and returns the final loss."""
    # ------------------------------------------------------------------ devices and mesh
    # Before any JAX computation: the simulated CPU device count is fixed at first use.
    from xshard.mesh import build_mesh, check_batch_divisible, configure_devices
    from xshard.mesh_config import data_axes as mesh_data_axes

    configure_devices(cfg.mesh)

    import jax

    from trainers.monitor import NonFiniteMonitor, ProgressHook
    from trainers.tb_logger import TensorBoardHook
    from trainers.trainer import Trainer
    from xshard.factory import build_optimizer

    mesh = build_mesh(cfg.mesh)
    data_axes = mesh_data_axes(cfg.mesh)
    check_batch_divisible(cfg.trainer.batch_size, mesh, data_axes)
    if cfg.trainer.steps <= 0:
        raise ValueError(f"trainer.steps={cfg.trainer.steps}: must be a positive number of steps.")

    # ------------------------------------------------------------------ task and optimizer
    task = hydra.utils.instantiate(cfg.task, _convert_="all")
    tx = build_optimizer(cfg, mesh=mesh)
    trainer = Trainer(
        task,
        tx,
        mesh,
        data_axes=data_axes,
        global_batch_size=cfg.trainer.batch_size,
        microbatches=cfg.trainer.microbatches,
        grad_impl=cfg.trainer.grad_impl,
        reduction=cfg.reduction.mode,
        seed=cfg.seed,
    )

    # ------------------------------------------------------------------ state and data
    def batches(start_step: int):
        return task.batches(
            cfg.trainer.batch_size,
            seed=cfg.seed,
            start_step=start_step,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )

    first = next(iter(batches(0)))
    state = trainer.init(trainer.init_params(first))
    start_step = int(jax.device_get(state.step))

    # ------------------------------------------------------------------ hooks
    tb = TensorBoardHook(
        cfg.paths.tb_dir,
        log_every=cfg.trainer.log_every,
        global_batch_size=cfg.trainer.batch_size,
        num_steps=cfg.trainer.steps,
        hparams=_hparams(cfg),
        config_yaml=OmegaConf.to_yaml(cfg, resolve=True),
        flush_secs=cfg.logger.flush_secs,
    )
    hooks = [
        NonFiniteMonitor(
            skip_nonfinite=bool(cfg.reduction.get("skip_nonfinite", False)),
            max_consecutive=cfg.trainer.max_consecutive_nonfinite,
        ),
        tb,
        ProgressHook(start_step=start_step, num_steps=cfg.trainer.steps, enabled=cfg.trainer.progress),
    ]

    # ------------------------------------------------------------------ train
    log.info("Training %s for %d steps on mesh %s (data axes %s).",
             cfg.task.get("name", "task"), cfg.trainer.steps, dict(mesh.shape), data_axes)
    state, reason = trainer.fit(
        state,
        batches(start_step),
        num_steps=cfg.trainer.steps,
        hooks=hooks,
        layer_stats_every=cfg.trainer.layer_stats_every,
        histogram_every=cfg.trainer.histogram_every,
    )
    final = tb.last_loss if tb.last_loss is not None else float("nan")
    log.info("Finished (%s) at step %d, final loss %.5f.", reason, int(jax.device_get(state.step)), final)
    log.info("TensorBoard logs: %s  (view: tensorboard --logdir %s)", cfg.paths.tb_dir, cfg.paths.tb_dir)
    return final


@hydra.main(config_path="pkg://xshard.conf", config_name="xshard_train", version_base="1.3")
def main(cfg: DictConfig) -> float:
    """Hydra main: trains and returns the final loss; config errors exit with code 2."""
    try:
        return train(cfg)
    except ValueError as e:  # config errors name the key, the value and what is allowed
        log.error("%s", e)
        print(f"xshard: error: {e}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)


if __name__ == "__main__":
    main()
