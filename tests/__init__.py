"""xshard's tests. Test files sit in folders that mirror the code they test (`xshard/`,
`config/`, `trainers/<wing>/`); the project-wide ones (layering, packaging, examples,
benchmarks) and the support modules every folder shares (cli, mesh, reliability and multi-host
helpers) sit here."""

import os
from pathlib import Path

#: The repository root.
REPO = Path(__file__).resolve().parents[1]

#: XLA flags for a subprocess that checks that a benchmark still runs, not how fast: LLVM
#: without its expensive passes, which halves a small program's compilation on CPU (tiny_gpt's
#: eight step variants: 64 -> 35 s of CPU) and leaves what the checks read (the programs'
#: collectives and kernels, finite numbers) as it is.
SMOKE_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def smoke_env() -> dict[str, str]:
    """This process's environment with `SMOKE_XLA_FLAGS` added to its ``XLA_FLAGS``."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} {SMOKE_XLA_FLAGS}".strip()
    return {**os.environ, "XLA_FLAGS": flags}
