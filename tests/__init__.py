"""xshard's tests. Test files sit in folders that mirror the code they test (`xshard/`,
`config/`, `trainers/<wing>/`); the project-wide ones (layering, packaging, examples,
benchmarks) and the support modules every folder shares (cli, mesh, reliability and multi-host
helpers) sit here."""

from pathlib import Path

#: The repository root.
REPO = Path(__file__).resolve().parents[1]
