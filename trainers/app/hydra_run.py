"""What the app reads from Hydra's runtime for the wings that never see it: the output layout
the run dir's link check needs (`hydra_dirs`), and process 0's config dump written again when
another process shares its output dir (`rewrite_config_dump`, `trainers.cluster.run_dirs`).
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

from omegaconf import DictConfig, OmegaConf

from trainers.rundir.links import write_file


def hydra_dirs() -> tuple[str | None, str | None]:
    """``(hydra.output_subdir, sweep dir)`` of this Hydra job: its config dump's folder (None
    if it writes none) and a multirun's sweep dir (None for a single run); both None outside a
    Hydra job."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None, None
    hc = HydraConfig.get()
    subdir = None if hc.output_subdir is None else str(hc.output_subdir)
    sweep_dir = str(hc.sweep.dir) if hc.mode == RunMode.MULTIRUN else None
    return subdir, sweep_dir


def rewrite_config_dump(cfg: DictConfig) -> None:
    """Writes Hydra's ``.hydra/{config,hydra,overrides}.yaml`` of this process (process 0)
    again, over those of other processes that share its output dir."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    # The whole config, hydra node and all (Hydra types it as its HydraConf node).
    hydra_cfg = cast(DictConfig, HydraConfig.instance().cfg)
    subdir = hydra_cfg.hydra.output_subdir
    if subdir is None:
        return
    out = Path(hydra_cfg.hydra.runtime.output_dir) / str(subdir)
    out.mkdir(parents=True, exist_ok=True)
    for name, node in (
        ("config.yaml", cfg),
        ("hydra.yaml", hydra_cfg),
        ("overrides.yaml", hydra_cfg.hydra.overrides.task),
    ):
        write_file(out / name, OmegaConf.to_yaml(node))  # never through a link
