"""OmegaConf resolvers of xshard's configs (registered by the ``xshard_searchpath`` plugin).

``${xshard.tb_dir:<output dir>,<style>}``, the default of ``paths.tb_dir``: a folder named by
the run, so that TensorBoard's run names read as the overrides. ``<style>`` is
``logger.run_names`` (`trainers.config.run_names`: ``short``, the default, or ``overrides``).

- a single run: ``<output dir>/tb/<name>`` (`run_name`: the overrides, less ``hydra.*`` and
  ``paths.*`` keys and those Hydra leaves out of dir names, shortened or as typed; the job's
  name when there are none); ``tensorboard --logdir <output dir>/tb`` shows it by that name.
  A rerun in the same output dir continues the same run (it resumes from its checkpoints),
  so it writes to the folder already there (the latest, if several; never a symbolic link),
  whatever its own overrides (``trainer.steps=200`` to train on): one TensorBoard run, one curve;
- a job of a multirun (``-m``): ``<sweep dir>/tb/<job subdir>`` (``hydra.sweep.subdir``:
  ``${xshard.job_name:<style>}`` by default, the job's number and its overrides shortened,
  or its overrides as typed), so ``tensorboard --logdir <sweep dir>/tb`` shows every job by
  its folder's name;
- outside a Hydra app (the compose API): ``<output dir>/tb/run``;
- before the run has an output dir (``--cfg job --resolve`` prints the config without running
  it, and ``hydra.runtime.output_dir`` is null then): the folder under ``hydra.run.dir`` that a
  run would write to.

Run names keep only letters, digits and ``=,._+-@:[]`` (`clean_name`): ``optimizer.b={1: 2}``
becomes ``optimizer.b=1:2``, so a folder name never holds spaces, braces, quotes or a ``/``
(no ``..`` either: the name is one component). A name longer than `MAX_NAME` bytes is cut and
ends with a hash of the whole name (`safe_name`), so a 300-character override still makes a
folder (a file system takes `NAME_MAX` bytes per name) and two long names stay apart.
``${xshard.job_subdir:<name>}`` is `safe_name` of a name of your own.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from trainers.config.cli_args import override_key, swept_keys
from trainers.config.run_names import OVERRIDES, SHORT, check_style, short_name
from xshard.config.elastic_groups import STANDBY_FLAG


def tb_dir(output_dir: str, style: str = SHORT) -> str:
    """The run's TensorBoard folder (module docstring); `style`: ``logger.run_names``."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return str(Path(output_dir) / "tb" / "run")
    hc = HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN:
        return str(Path(hc.sweep.dir) / "tb" / safe_name(hc.sweep.subdir))
    root = Path(output_dir if output_dir is not None else hc.run.dir) / "tb"
    # Folders only, not links: a link in a copied run dir is no run's folder (and the run
    # refuses one that leads out of its dir: trainers/rundir/links.py).
    existing = (
        [p for p in root.iterdir() if p.is_dir() and not p.is_symlink()] if root.is_dir() else []
    )
    if existing:  # a rerun in the same dir: the run's own folder
        return str(max(existing, key=lambda p: p.lstat().st_mtime))
    return str(root / safe_name(run_name(hc, check_style(style))))


def named_overrides(hc: Any) -> list[str]:
    """The overrides a run's name shows, sorted: without Hydra's own keys, ``paths.*``
    (locations, not hyperparameters), an elastic group's standby flag (its standby writes to
    the group's TensorBoard run) and the keys Hydra leaves out of directory names."""
    excluded = set(hc.job.config.override_dirname.exclude_keys)
    items = []
    for override in hc.overrides.task:
        key = override_key(override)
        if (
            key in excluded
            or key.startswith(("hydra.", "hydra/", "paths."))
            or key.endswith(f".{STANDBY_FLAG}")
        ):
            continue
        items.append(override)
    return sorted(items)


def run_name(hc: Any, style: str = SHORT) -> str:
    """A single run's name: its `named_overrides`, joined as Hydra joins them in
    ``override_dirname`` (`style` ``overrides``) or shortened (``short``,
    `trainers.config.run_names`); the job's name when none is left."""
    items = named_overrides(hc)
    if not items:
        return hc.job.name or "run"
    return ",".join(items) if style == OVERRIDES else short_name(items)


def job_name(style: str = SHORT) -> str:
    """A multirun job's folder (the default ``hydra.sweep.subdir``): its number and its
    `named_overrides` shortened (`style` ``short``), or ``hydra.job.override_dirname``
    (``overrides``); one clean path component (`safe_name`)."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    if check_style(style) == OVERRIDES:
        return safe_name(hc.job.override_dirname)
    named = named_overrides(hc)
    swept = sweep_keys(hc)
    shown = [o for o in named if override_key(o) in swept] if swept else named
    return safe_name(short_name(shown, int(hc.job.num)))


def sweep_keys(hc: Any) -> frozenset[str]:
    """The keys a multirun varies: its sweep overrides on the command line and the keys of
    ``hydra.sweeper.params``; none where neither is known (a launcher's worker process sees
    another command line), and then a job's name shows all its overrides."""
    params = hc.sweeper.get("params") or {}
    return swept_keys() | {override_key(f"{k}=") for k in params}


#: The longest name of one file or folder most file systems take (bytes; Linux's NAME_MAX).
NAME_MAX = 255
#: The longest run folder name `safe_name` makes (bytes): room left under `NAME_MAX` for what
#: is added to it (a ``.log`` or ``.yaml`` suffix).
MAX_NAME = 200


#: Characters a run folder's name keeps; spaces, quotes and braces are dropped, any other
#: character becomes an underscore.
_KEPT = re.compile(r"[^A-Za-z0-9=,._+\-@:\[\]]")
_DROPPED = re.compile(r"[\s'\"{}]")


def clean_name(name: str) -> str:
    """`name` as one clean path component (module docstring): ``k=v,k2=v2`` as typed, less
    spaces, quotes and braces; separators and other characters become underscores; ``run``
    for a name of dots only."""
    name = _KEPT.sub("_", _DROPPED.sub("", str(name)))
    return name if name.strip(".") else "run"  # never empty, "." or ".."


def safe_name(name: str) -> str:
    """One clean path component (`clean_name`); a name longer than `MAX_NAME` bytes is cut and
    ends with ``-`` and a hash of the whole name (stable: the same name, the same folder)."""
    name = clean_name(name)
    if len(name.encode()) <= MAX_NAME:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:10]
    return name.encode()[: MAX_NAME - 11].decode(errors="ignore") + "-" + digest


def register_resolvers() -> None:
    """Registers the resolvers above (idempotent)."""
    if not OmegaConf.has_resolver("xshard.tb_dir"):
        OmegaConf.register_new_resolver("xshard.tb_dir", tb_dir)
    if not OmegaConf.has_resolver("xshard.job_name"):
        OmegaConf.register_new_resolver("xshard.job_name", job_name)
    if not OmegaConf.has_resolver("xshard.job_subdir"):
        OmegaConf.register_new_resolver("xshard.job_subdir", safe_name)
