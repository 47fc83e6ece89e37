"""The sweep's figure (`trainers.app.sweep_plot`): what it shows, the PNG read back with
matplotlib, a real sweep from the CLI, a sweep without matplotlib, a link planted at its path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from matplotlib.image import imread

from tests import REPO
from tests.cli import run_train
from trainers.app.sweep import SWEEP_SUMMARY_FILE
from trainers.app.sweep_plot import (
    DPI,
    SWEEP_FIGURE_FILE,
    figure_inches,
    objective_figure,
    swept_keys,
    write_objective_figure,
)


def _record(num: int, objective: float | str | None, *overrides: str) -> dict:
    return {
        "num": num,
        "status": "completed" if isinstance(objective, float) else "diverged",
        "objective": objective,
        "objective_key": "train/loss",
        "overrides": [*overrides, "task=mlp", "trainer.steps=12"],
    }


#: A grid over a learning rate (spanning 1e4x) and an optimizer; job 3 diverged.
GRID = [
    _record(0, 0.9, "optimizer.learning_rate=1e-3", "optimizer=adam"),
    _record(1, 0.4, "optimizer.learning_rate=0.1", "optimizer=adam"),
    _record(2, 0.6, "optimizer.learning_rate=1e-3", "optimizer=sgd"),
    _record(3, None, "optimizer.learning_rate=10", "optimizer=sgd"),
]


def _shape(png: Path) -> tuple[int, int]:
    """(height, width) in pixels of a PNG, read back by matplotlib (fails if it is not one)."""
    image = imread(png)
    assert image.ndim == 3 and image.shape[2] in (3, 4)
    assert image.std() > 0  # something was drawn
    return image.shape[0], image.shape[1]


def _pixels(panels: int) -> tuple[int, int]:
    width, height = figure_inches(panels)
    return round(height * DPI), round(width * DPI)


def test_the_swept_keys_are_those_that_differ_numbers_on_a_log_axis_when_they_span_10x():
    lr, optimizer = swept_keys(GRID)  # task and trainer.steps are the same in every job
    assert (lr.name, lr.numeric, lr.log) == ("optimizer.learning_rate", True, True)
    assert (optimizer.name, optimizer.numeric) == ("optimizer", False)
    narrow = [_record(0, 1.0, "a=1", "+b=x"), _record(1, 2.0, "a=5", "+b=null")]
    a, b = swept_keys(narrow)
    assert (a.numeric, a.log) == (True, False)  # 5x: a linear axis
    assert (b.name, b.numeric, b.values) == ("b", False, ["x", "null"])


def test_the_figure_marks_the_best_job_each_way_and_counts_the_jobs_left_out():
    shown = objective_figure(GRID)
    assert shown is not None
    assert [p.name if p else None for p in shown.panels] == [
        "optimizer.learning_rate",
        "optimizer",
    ]
    assert shown.best_label == "best: job 1, 0.4"
    assert shown.title == (
        "Sweep objective (train/loss, minimize): 3 of 4 jobs; 1 without a finite objective left out"
    )
    assert objective_figure(GRID, maximize=True).best_label == "best: job 0, 0.9"
    # "inf" as result.json writes it is not a finite objective; no finite one: no figure.
    assert objective_figure([_record(0, "inf"), _record(1, None)]) is None


def test_the_png_is_a_valid_image_of_the_size_of_its_panels(tmp_path):
    assert write_objective_figure(GRID, tmp_path / "grid.png") == tmp_path / "grid.png"
    assert _shape(tmp_path / "grid.png") == _pixels(2)
    one_job = [_record(5, 0.5, "optimizer.learning_rate=0.1")]  # nothing swept yet
    write_objective_figure(one_job, tmp_path / "one.png", maximize=True)
    assert _shape(tmp_path / "one.png") == _pixels(1)
    assert objective_figure(one_job).best_label == "best: job 5, 0.5"


def test_a_link_planted_at_the_figure_is_replaced_not_written_through(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("not yours\n")
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / SWEEP_FIGURE_FILE).symlink_to(outside)
    write_objective_figure(GRID, sweep / SWEEP_FIGURE_FILE)
    assert outside.read_text() == "not yours\n"
    assert not (sweep / SWEEP_FIGURE_FILE).is_symlink()
    assert _shape(sweep / SWEEP_FIGURE_FILE) == _pixels(2)
    assert sorted(p.name for p in sweep.iterdir()) == [SWEEP_FIGURE_FILE]  # no temporary file


# The sweep callback as Hydra drives it, in a fresh process: a multirun starts, two jobs write
# their result.json and end, the multirun ends. BLOCK makes `import matplotlib` fail there.
_SWEEP_CALLBACK = """
import json, logging, sys, time
if {block}:
    sys.modules["matplotlib"] = None  # `import matplotlib` raises ImportError from here on
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
from omegaconf import OmegaConf
from trainers.app.sweep import SweepSummary, write_result
sweep_dir = sys.argv[1]
config = OmegaConf.create({{"hydra": {{"sweep": {{"dir": sweep_dir}}, "sweeper": {{}}}}}})
callback = SweepSummary()
callback.on_multirun_start(config)
for record in json.loads(sys.argv[2]):
    write_result(f"{{sweep_dir}}/{{record['num']}}", {{**record, "written_at": time.time()}})
    callback.on_job_end(config, None)
callback.on_multirun_end(config)
"""


@pytest.mark.parametrize("block", [True, False], ids=["without_matplotlib", "with_matplotlib"])
def test_without_matplotlib_the_sweep_writes_its_table_and_says_once_the_figure_is_skipped(
    tmp_path, block
):
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(_SWEEP_CALLBACK.format(block=block)),
            str(sweep),
            json.dumps(GRID[:2]),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=True,
    )
    table = (sweep / SWEEP_SUMMARY_FILE).read_text()
    assert "2 jobs: 2 completed, 0 did not." in table and table.strip() in proc.stdout
    skipped = [line for line in proc.stderr.splitlines() if "skipped" in line]
    if block:
        assert skipped == [
            f"INFO Sweep figure {SWEEP_FIGURE_FILE} skipped: matplotlib is not installed "
            "(pip install 'xshard[plots]')."
        ]
        assert not (sweep / SWEEP_FIGURE_FILE).exists() and "Sweep figure:" not in proc.stdout
    else:
        assert skipped == []
        assert _shape(sweep / SWEEP_FIGURE_FILE) == _pixels(1)


@pytest.mark.slow
def test_a_sweep_from_the_cli_writes_its_figure_next_to_its_table(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_train(
        "-m",
        "optimizer.learning_rate=0.01,0.05,0.2",
        "task=mlp",
        "optimizer=sgd",
        "trainer.steps=6",
        "checkpoint=none",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert "3 jobs: 3 completed, 0 did not." in (sweep / SWEEP_SUMMARY_FILE).read_text()
    assert _shape(sweep / SWEEP_FIGURE_FILE) == _pixels(1)  # one panel: the learning rate
    assert f"Sweep figure: {sweep / SWEEP_FIGURE_FILE}\n" in proc.stdout
    assert "matplotlib" not in proc.stdout + proc.stderr
    assert not list(sweep.glob("*.tmp"))
