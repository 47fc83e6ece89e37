"""``precision=bf16``, ``trainer.remat`` and the compilation cache through the real CLI.

One bf16 run of a small tiny_gpt to step 20 with a fresh compilation cache, and a run stopped at
step 10 with that cache (every program read back) then resumed to 20, which must end bitwise
where the uninterrupted one did.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from tests import REPO
from tests.cli import refused, run_train
from tests.reliability_helpers import assert_bitwise_equal, load_state

SMALL = [
    "task=tiny_gpt",
    "task.d_model=32",
    "task.n_heads=2",
    "task.n_layers=2",
    "task.d_ff=64",
    "task.seq_len=16",
    "trainer.batch_size=16",
    "trainer.layer_stats_every=0",
    "trainer.histogram_every=0",
    "trainer.eval_batches=0",
    "checkpoint.every_steps=10",
]
BF16 = [*SMALL, "precision=bf16", "trainer.remat=dots_saveable", "trainer.steps=20"]
CACHE_LINE = r"compilation cache .*: (\d+) programs read, (\d+) compiled"

pytestmark = [pytest.mark.slow, pytest.mark.long]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The uninterrupted run with a fresh cache; a run stopped at step 10 with that cache, now
    warm (`warm`), then resumed to step 20 (`resumed`)."""
    root = tmp_path_factory.mktemp("bf16")
    cache = root / "cache"
    out = {"cache": cache, "first": root / "first", "warm": root / "resumed"}
    for name, steps in (("first", 20), ("warm", 10)):
        result = run_train(
            *BF16,
            f"trainer.steps={steps}",
            f"trainer.compilation_cache_dir={cache}",
            f"hydra.run.dir={out[name]}",
            cwd=REPO,
        )
        (out[name] / "stdout.txt").write_text(result.stdout + result.stderr)
    result = run_train(
        *BF16, f"trainer.compilation_cache_dir={cache}", f"hydra.run.dir={out['warm']}", cwd=REPO
    )
    assert "Restored step 10 from" in result.stdout + result.stderr
    out["resumed"] = out["warm"]
    return out


def test_bf16_keeps_float32_checkpoints_and_resumes_bitwise(runs):
    first = load_state(runs["first"] / "checkpoints" / "20")
    floats = {x.dtype for x in first.values() if np.issubdtype(x.dtype, np.floating)}
    assert floats == {np.dtype("float32")}  # master params and optimizer state
    assert_bitwise_equal(load_state(runs["resumed"] / "checkpoints" / "20"), first)


def test_remat_on_cpu_warns_that_it_saves_no_memory(runs):
    """The tests run on XLA:CPU without the flag that keeps remat (`trainers.tasks.remat`)."""
    out = (runs["first"] / "stdout.txt").read_text()
    assert "trainer.remat=dots_saveable saves no memory on CPU" in out
    assert "XLA_FLAGS=--xla_disable_hlo_passes=cse_barrier_expander" in out


def test_a_second_run_reads_its_programs_from_the_compilation_cache(runs):
    assert any(runs["cache"].glob("*-cache")), "no cache entry was written"
    first = re.search(CACHE_LINE, (runs["first"] / "stdout.txt").read_text())
    warm = re.search(CACHE_LINE, (runs["warm"] / "stdout.txt").read_text())
    assert first and warm
    assert int(first[1]) == 0 and int(first[2]) > 0  # a fresh cache: everything compiled
    assert int(warm[1]) >= int(first[2]) and int(warm[2]) == 0  # everything read back
    assert re.search(r"compile: \d+\.\d+ s", (runs["warm"] / "stdout.txt").read_text())


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (["precision.compute_dtype=float16"], ["precision.compute_dtype='float16'", "float32"]),
        (["trainer.remat=most"], ["trainer.remat='most'", "dots_saveable"]),
        (["trainer.remat=full", "~task.remat"], ["trainer.remat='full': task=mlp does not"]),
        (["trainer.compilation_cache_dir=''"], ["trainer.compilation_cache_dir=''"]),
    ],
)
def test_bad_values_exit_2_with_one_line(tmp_path, overrides, fragments):
    result = run_train(
        "task=mlp", *overrides, f"hydra.run.dir={tmp_path}", cwd=REPO, check=False, timeout=300
    )
    refused(result, *fragments)
