"""xshard's tests. Test files sit in folders that mirror the code they test (`xshard/`,
`config/`, `trainers/<wing>/`); the project-wide ones (layering, packaging, examples,
benchmarks) and the support modules every folder shares (cli, mesh, reliability and multi-host
helpers) sit here."""

from pathlib import Path

#: The repository root.
REPO = Path(__file__).resolve().parents[1]

#: XLA flags of every test process and of the subprocesses it starts (tests/conftest.py puts
#: them in ``XLA_FLAGS``, which subprocesses inherit): LLVM without its expensive passes and at
#: optimization level 0. The programs are the same HLO (XLA's own passes, collectives, fusion,
#: buffer assignment and remat are untouched: what the tests read); only the machine code of
#: the CPU kernels is less optimised, which the tests' tiny models do not notice, while their
#: compilations take ~30% less CPU (tests/trainers/core/test_zero.py: 432 -> 299 s of CPU).
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
