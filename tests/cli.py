"""Helpers for tests that run the real CLI in a subprocess and read what it wrote."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainers.exits import EXIT_CONFIG_ERROR

#: The gradient path the CLI tests run unless they name one: the CLI's default,
#: ``trainer.grad_impl=auto``, races both paths at start-up (a second compilation and up to
#: 2 s a run), and two runs of one command may keep different paths (they agree to rounding,
#: not bitwise), which the tests comparing runs cannot have. tests/trainers/app/
#: test_grad_path_cli.py runs auto.
ONE_PATH = "trainer.grad_impl=manual"


def one_path(overrides: list[str]) -> list[str]:
    """`overrides` with `ONE_PATH` first, unless they set ``trainer.grad_impl``."""
    named = any(o.startswith("trainer.grad_impl=") for o in overrides)
    return overrides if named else [ONE_PATH, *overrides]


def run_train(
    *overrides: str,
    cwd: Path,
    check: bool = True,
    timeout: float = 600,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Runs `python -m trainers.train OVERRIDES` in `cwd`; fails the test on a non-zero exit."""
    full_env = {**os.environ, "HYDRA_FULL_ERROR": "0", **(env or {})}
    flags = [o for o in overrides if o.startswith("-")]  # Hydra flags go before overrides
    rest = one_path([o for o in overrides if not o.startswith("-")])
    proc = subprocess.run(
        [sys.executable, "-m", "trainers.train", *flags, "trainer.progress=false", *rest],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"trainers.train {' '.join(overrides)} exited {proc.returncode}\n"
            f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}"
        )
    return proc


def refused(result, *fragments: str) -> str:
    """Asserts exit 2 with one line on stderr that contains `fragments`; returns the line."""
    assert result.returncode == EXIT_CONFIG_ERROR, result.stdout[-2000:] + result.stderr[-4000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def events_dir(tb_dir: Path) -> Path:
    """The folder holding a run's event files: `tb_dir` itself, or its one subfolder that does
    (a run writes to ``<output dir>/tb/<run name>``)."""
    tb_dir = Path(tb_dir)
    if any(tb_dir.glob("events.out.tfevents.*")):
        return tb_dir
    found = sorted({p.parent for p in tb_dir.glob("*/events.out.tfevents.*")})
    assert len(found) == 1, f"expected one run's events under {tb_dir}, found {found}"
    return found[0]


def load_events(tb_dir: Path) -> EventAccumulator:
    """Reads a run's event files with TensorBoard's own reader (`events_dir` of `tb_dir`)."""
    acc = EventAccumulator(
        str(events_dir(tb_dir)), size_guidance={"scalars": 0, "tensors": 0, "histograms": 0}
    )
    acc.Reload()
    return acc


def scalars(tb_dir: Path, tag: str) -> dict[int, float]:
    """{step: value} of one scalar tag."""
    return {e.step: e.value for e in load_events(tb_dir).Scalars(tag)}


def hparams_dashboard(logdir: Path, limit: int | None = None) -> dict[str, Any]:
    """What TensorBoard's HParams plugin serves for `logdir` (its own backend, no server).

    Returns:
      ``{"hparams": [names, in the plugin's order, at most `limit`], "metrics": [tags],
      "runs": {run: {"hparams": {name: value}, "status": "STATUS_..."}}}``.
    """
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import api_pb2, backend_context, metadata

    mux = plugin_event_multiplexer.EventMultiplexer()
    mux.AddRunsFromDirectory(str(logdir))
    mux.Reload()
    provider = data_provider.MultiplexerDataProvider(mux, str(logdir))
    backend = backend_context.Context(
        base_plugin.TBContext(logdir=str(logdir), data_provider=provider, multiplexer=mux)
    )
    rc = context.RequestContext()
    content = backend.hparams_metadata(rc, "")
    experiment = backend.experiment_from_metadata(
        rc, "", True, content, backend.hparams_from_data_provider(rc, "", 1000), limit
    )
    runs = {}
    for run, tags in content.items():
        start = metadata.parse_session_start_info_plugin_data(tags[metadata.SESSION_START_INFO_TAG])
        values = {
            k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind"))
            for k, v in start.hparams.items()
        }
        end = tags.get(metadata.SESSION_END_INFO_TAG)
        status = (
            api_pb2.Status.Name(metadata.parse_session_end_info_plugin_data(end).status)
            if end is not None
            else None
        )
        runs[run] = {"hparams": values, "status": status}
    return {
        "hparams": [h.name for h in experiment.hparam_infos],
        "metrics": [m.name.tag for m in experiment.metric_infos],
        "runs": runs,
    }
