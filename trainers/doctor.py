"""`python -m trainers.doctor [overrides]`: what a run would see, checked before it trains.

Takes the same config and overrides as `trainers.train` and, on every process of the run,
checks the config as the run's start-up does (the same code: `trainers.app.builders.read_options`
and `trainers.app.builders.build_run`), forms the cluster, sets up the devices and builds the mesh,
the task, the optimizer and the trainer, then prints (process 0) one report: the cluster JAX
detected and the process count, the local and global devices, the mesh and whether the batch
divides over its data axes, what was built, the run, checkpoint and TensorBoard directories
and whether every process can write them (the checkpoint dir must be one directory all
processes share). Exit status 0 when all is well, 2 with the problems listed (one line each),
as `trainers.train` would exit on them::

    python -m trainers.doctor mesh=cpu8 distributed.enabled=true   # on every host, like train

It trains nothing and writes no checkpoint, lock or config dump: Hydra's config dump and log
file are turned off (``hydra.output_subdir=null``, ``hydra/job_logging=stdout``), its probe
files are removed, and a run dir it created stays only if it was asked for by name.
"""

from __future__ import annotations

if __name__ == "__main__":  # first of all, before JAX is imported (trainers.cluster.signal_latch)
    from trainers.cluster import signal_latch

    signal_latch.install()

import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from trainers.app.cli_overrides import check_group_overrides
from trainers.app.main import main as xshard_main
from trainers.cluster.multihost import Cluster, exit_process, join_cluster
from trainers.exits import EXIT_CONFIG_ERROR, PeerError
from xshard.errors import ConfigError

if TYPE_CHECKING:
    from trainers.config import PathsOptions

log = logging.getLogger("trainers.doctor")

#: Hydra overrides that keep the doctor from writing into a run dir.
QUIET_HYDRA = ["hydra.output_subdir=null", "hydra/job_logging=stdout"]


def diagnose(cfg: DictConfig) -> tuple[list[tuple[str, str]], list[str], Cluster]:
    """Runs the checks of the module docstring on this process.

    Args:
      cfg: the composed config (as `trainers.train` gets it).

    Returns:
      (report lines as (label, text), problems of every process (one line each), cluster);
      only process 0's report lines are complete.
    """
    from trainers.app.builders import read_options
    from trainers.cluster.join import detected_cluster
    from trainers.cluster.multihost import current

    lines: list[tuple[str, str]] = []
    problems: list[str] = []
    try:
        options = read_options(cfg)  # the run's own keys, as trainers.train reads them
    except ConfigError as e:
        return lines, [str(e)], current()
    dist = options.distributed
    how = "one process (distributed.enabled=false)"
    if dist.enabled:
        explicit = None not in (dist.coordinator_address, dist.num_processes, dist.process_id)
        how = "explicit (distributed.*)" if explicit else f"auto-detected: {detected_cluster()}"
    try:
        cluster = join_cluster(dist)
    except ConfigError as e:
        return [("cluster", how)], [str(e)], current()
    if dist.enabled:
        from jax._src import distributed

        address = distributed.global_state.coordinator_address
        how = f"{how}: {cluster.count} processes, coordinator {address}"
    lines.append(("cluster", how))
    problems += _devices_and_mesh(cfg, cluster, options, lines)
    problems += _directories(options.paths, cluster, lines)
    everyone = cluster.all_gather("doctor/problems", problems)
    seen: dict[str, list[int]] = {}
    for i, theirs in enumerate(everyone):
        for p in theirs:
            seen.setdefault(p, []).append(i)
    merged = [  # a problem every process has is listed once, others with who has them
        p if len(who) == cluster.count else f"{', '.join(map(cluster.name, who))}: {p}"
        for p, who in seen.items()
    ]
    return lines, merged, cluster


def _devices_and_mesh(
    cfg: DictConfig, cluster: Cluster, options: Any, lines: list[tuple[str, str]]
) -> list[str]:
    """Devices, mesh and batch; then the task, optimizer and trainer as the run builds them."""
    from trainers.app.builders import build_run
    from xshard.mesh.build import build_mesh, check_batch_divisible, configure_devices
    from xshard.mesh.spec import data_axes

    try:
        configure_devices(cfg.mesh, num_processes=cluster.count)
    except ConfigError as e:
        return [str(e)]
    import jax

    local = jax.local_devices()
    per_process = cluster.all_gather("doctor/devices", [len(local), local[0].platform])
    for i, (n, platform) in enumerate(per_process):
        lines.append((f"process {i}", f"{cluster.hosts[i]}: {n} local {platform} device(s)"))
    devices = jax.devices()
    lines.append(("devices", f"{len(devices)} {devices[0].device_kind} device(s) in all"))
    try:
        mesh = build_mesh(cfg.mesh)
        axes = data_axes(cfg.mesh)
    except ConfigError as e:
        return [str(e)]
    name = cfg.mesh.get("name") or "<custom>"
    lines.append(("mesh", f"mesh={name}: {dict(mesh.shape)}, data axes {list(axes)}"))
    opts = options.trainer
    try:
        per_shard = check_batch_divisible(opts.batch_size, mesh, axes)
    except ConfigError as e:
        return [str(e)]
    shards = opts.batch_size // per_shard
    lines.append(
        ("batch", f"trainer.batch_size={opts.batch_size}: {per_shard} per shard, {shards} shards")
    )
    try:
        parts = build_run(cfg, options, mesh, axes)  # the run's own start-up checks
    except ConfigError as e:
        return [str(e)]
    task = type(parts.task)
    target = cfg.optimizer.get("_target_")
    lines.append(("build", f"task {task.__module__}.{task.__qualname__}, optimizer {target}: OK"))
    return []


def _directories(paths: PathsOptions, cluster: Cluster, lines: list[tuple[str, str]]) -> list[str]:
    """The run dirs as every process sees them (`paths`: the ``paths`` node's record)."""
    from trainers.checkpoint.io import complete_steps
    from trainers.checkpoint.owner import check_ownership
    from trainers.cluster.run_dirs import absolute_path, check_shared_dir
    from trainers.rundir.disk import check_writable_dir

    problems: list[str] = []
    own = absolute_path(paths.output_dir)
    lead = cluster.broadcast(
        "doctor/paths",
        {
            "checkpoint_dir": absolute_path(paths.checkpoint_dir),
            "tb_dir": absolute_path(paths.tb_dir),
        },
    )
    outputs = cluster.all_gather("doctor/output_dirs", own)
    for i, out in enumerate(outputs):
        label = "run dir" if cluster.count == 1 else f"run dir {i}"
        lines.append((label, out + ("" if i == 0 or out != outputs[0] else " (process 0's)")))
    checkpoints = lead["checkpoint_dir"]
    made = [_first_missing(d) for d in (lead["tb_dir"], checkpoints) if cluster.lead]
    try:
        check_writable_dir(own, "paths.output_dir")
        if cluster.lead:
            check_writable_dir(lead["tb_dir"], "paths.tb_dir")
            check_ownership(checkpoints, outputs[0])
            check_writable_dir(checkpoints, "paths.checkpoint_dir")
    except ConfigError as e:
        problems.append(str(e))
    if not any(cluster.all_gather("doctor/dirs_failed", bool(problems))):
        try:  # the probe is a collective: every process takes part, or none
            check_shared_dir(cluster, checkpoints, "paths.checkpoint_dir", own)
        except PeerError:
            pass  # that process reports its own problem
        except ConfigError as e:
            problems.append(str(e))
    steps = complete_steps(checkpoints) if Path(checkpoints).is_dir() else []
    shared = (
        f"shared, writable by all {cluster.count} processes" if cluster.count > 1 else "writable"
    )
    state = "OK" if not problems else "see the problems below"
    resume = f"resumes from step {steps[-1]}" if steps else "no checkpoint yet: a fresh start"
    lines.append(("checkpoints", f"{checkpoints}: {shared} ({state}); {resume}"))
    lines.append(("tensorboard", f"{lead['tb_dir']} (written by process 0 only)"))
    cluster.all_gather("doctor/probed", True)  # every process is done with the dirs
    for top, d in made:  # the checks created them: leave them to the run
        if top is not None:
            _remove_empty_up_to(Path(d), top)
    return problems


def print_report(lines: list[tuple[str, str]], problems: list[str], cluster: Cluster) -> None:
    """Process 0 prints the report; the others one line pointing to it."""
    if not cluster.lead:
        print(f"xshard doctor: process {cluster.index} of {cluster.count}: see process 0's report.")
        return
    width = max((len(label) for label, _ in lines), default=0) + 1
    print("xshard doctor")
    for label, text in lines:
        print(f"  {label + ':':<{width}} {text}")
    if problems:
        print(f"{len(problems)} problem(s):")
        for p in problems:
            print(f"  - {' '.join(p.split())}")
    else:
        print("All checks passed.")


def _first_missing(path: str) -> tuple[Path | None, str]:
    """(the outermost missing ancestor of `path` or `path` itself, None if it exists; path)."""
    top = None
    for d in (Path(path), *Path(path).parents):
        if d.exists():
            break
        top = d
    return top, path


def _remove_empty_up_to(path: Path, top: Path) -> None:
    """Removes `path` and its parents up to `top` while they are empty (what a check made)."""
    for d in (path, *path.parents):
        try:
            d.rmdir()  # only an empty dir
        except OSError:
            return
        if d == top:
            return


@xshard_main(config_path="pkg://xshard.conf", config_name="xshard_train")
def _main(cfg: DictConfig) -> None:
    logging.getLogger().setLevel(logging.WARNING)  # the report, not every module's INFO lines
    lines, problems, cluster = diagnose(cfg)
    print_report(lines, problems, cluster)
    if not _named_run_dir():  # Hydra made a timestamped dir for the doctor: remove it
        here, path = Path.cwd().resolve(), Path(cfg.paths.output_dir).resolve()
        if here in path.parents:  # outputs/<date>/<time>: up to outputs/, if left empty
            _remove_empty_up_to(path, here / path.relative_to(here).parts[0])
    exit_process(EXIT_CONFIG_ERROR if problems else 0)


def _named_run_dir() -> bool:
    return any(a.startswith(("hydra.run.dir=", "paths.output_dir=")) for a in sys.argv[1:])


def main() -> None:
    """The command: Hydra's main with `QUIET_HYDRA` put before the user's overrides."""
    from hydra._internal.utils import get_args_parser

    args = sys.argv[1:]
    overrides = get_args_parser().parse_known_args(args)[0].overrides
    first = args.index(overrides[0]) if overrides else len(args)  # after the flags
    sys.argv[1 + first : 1 + first] = QUIET_HYDRA
    _main()


if __name__ == "__main__":
    check_group_overrides()  # schedule=null: one line and exit 2, not Hydra's traceback
    main()
