"""Overrides too long for a file name: refused in one line, or shortened into a folder name.

An adversarial audit typed a 10,000-character override key and swept a 300-character value:
both ended in "File name too long" tracebacks (Hydra looks a key up as a config file; a sweep
job's folder is named by its overrides). A key that long cannot exist, so it is refused (exit
2, one line naming it); a long value is a real value, so its job's folder (and TensorBoard
run) gets a name cut to fit, ending with a hash of the whole, and every output stays inside
the sweep dir. Real CLI runs in subprocesses.
"""

from __future__ import annotations

import re

import pytest

from tests.cli import refused, run_train
from trainers.config.resolvers import NAME_MAX

#: A value of 300 characters, as long as the audit's (a key of the user's own, ``+note``).
LONG = "n" * 300


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, fragments",
    [
        ([f"+a{'b' * 10000}=1"], ["(10001 characters)=1: a key of 10001 bytes"]),
        (["-m", f"+a{'b' * 10000}=1,2"], ["a key of 10001 bytes; no config key or group"]),
        ([f"trainer.{'x' * 300}=1"], ["(308 characters)=1: a key of 308 bytes"]),
        (["-m", f"schedule=cosine,{'c' * 300}"], ["schedule=", "(300 characters): expected"]),
    ],
)
def test_a_key_too_long_to_exist_is_refused_in_one_line(tmp_path, args, fragments):
    proc = run_train("task=mlp", "trainer.steps=2", *args, cwd=tmp_path, check=False)
    assert "Traceback" not in proc.stderr and "too long" not in proc.stderr, proc.stderr[-2000:]
    refused(proc, "xshard: error: ", *fragments)
    assert list(tmp_path.iterdir()) == [], "nothing is written before the refusal"


def _inside(root, path) -> bool:
    return path.resolve().is_relative_to(root.resolve())


@pytest.mark.slow
def test_a_sweep_over_a_long_value_names_its_job_folders_to_fit(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_train(
        "-m",
        "task=mlp",
        "checkpoint=none",
        "trainer.steps=2",
        f"+note={LONG},short",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"], "outputs outside the sweep"
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and p.name != "tb")
    runs = sorted((sweep / "tb").iterdir())
    assert len(jobs) == len(runs) == 2
    for job in jobs:
        assert len(job.name.encode()) <= NAME_MAX and (job / "result.json").is_file()
        assert (job / "train.log").is_file() and _inside(sweep, job)
    long_job = next(j for j in jobs if LONG[:50] in j.name)
    assert re.fullmatch(r".*-[0-9a-f]{10}", long_job.name), long_job.name
    # The TensorBoard run reads as its job folder, and holds the job's events.
    assert [r.name for r in runs] == [j.name for j in jobs]
    assert all(any(r.glob("events.out.tfevents.*")) for r in runs)


@pytest.mark.slow
def test_a_single_run_with_a_long_value_keeps_its_outputs_in_its_run_dir(tmp_path):
    run = tmp_path / "run"
    proc = run_train(
        "task=mlp",
        "checkpoint=none",
        "trainer.steps=2",
        f"+note={LONG}",
        f"hydra.run.dir={run}",
        cwd=tmp_path,
    )
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    (tb_run,) = (run / "tb").iterdir()
    assert len(tb_run.name.encode()) <= NAME_MAX and re.fullmatch(r".*-[0-9a-f]{10}", tb_run.name)
    assert any(tb_run.glob("events.out.tfevents.*")) and (run / "result.json").is_file()
