"""Device setup, the record of the machine the numbers were measured on, and the results files."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: Simulated CPU devices when the benchmark runs on the CPU platform.
CPU_DEVICES = 8


def configure_devices(num_cpu_devices: int = CPU_DEVICES) -> None:
    """Asks for `num_cpu_devices` CPU devices; call before the first JAX computation.

    The option only sizes the CPU client, so it is harmless on a GPU or TPU host: there the
    default backend is the accelerator and the benchmark uses its devices unchanged.
    """
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", num_cpu_devices)
    except RuntimeError:  # backends already initialised (e.g. imported by a test runner)
        pass


def _git(*args: str) -> str | None:
    root = Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def load_average() -> list[float] | None:
    """The 1/5/15-minute load averages (None where the OS has none): a noise indicator."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def environment() -> dict[str, Any]:
    """Returns the platform, device kind and count, versions and CPU count of this run."""
    import jax
    import jaxlib
    import numpy as np
    import optax

    devices = jax.devices()
    try:
        cpus_usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus_usable = os.cpu_count()
    status = _git("status", "--porcelain")
    return {
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "process_count": jax.process_count(),
        "jax_version": jax.__version__,
        "jaxlib_version": jaxlib.__version__,
        "optax_version": optax.__version__,
        "numpy_version": np.__version__,
        "python_version": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": cpus_usable,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "git_commit": _git("rev-parse", "--short", "HEAD"),
        "git_dirty": None if status is None else bool(status),
        "argv": sys.argv[1:],
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def write_results(out: Path, results: dict[str, Any], render: Callable[[Any], str]) -> None:
    """Writes `results` as JSON to `out` (NaN refused) and ``render(results)`` beside it as
    ``.md``, and prints the Markdown."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, allow_nan=False) + "\n")
    markdown = render(results)
    out.with_suffix(".md").write_text(markdown)
    print(markdown)
