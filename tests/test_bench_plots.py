"""`benchmarks.plots`: the figures drawn from the committed results (trimmed copies in a temporary
dir), read back with matplotlib; the command, with and without matplotlib."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from matplotlib.image import imread

from benchmarks.plots import (
    DPI,
    FIGURES,
    figure_inches,
    plot_overhead,
    plot_reductions,
    plot_zero,
)
from tests import REPO

BENCH = REPO / "benchmarks"


def _shape(png: Path) -> tuple[int, int]:
    """(height, width) in pixels of a PNG read back by matplotlib (fails if it is not one)."""
    image = imread(png)
    assert image.ndim == 3 and image.shape[2] in (3, 4) and image.std() > 0
    return image.shape[0], image.shape[1]


def _pixels(panels: int) -> tuple[int, int]:
    width, height = figure_inches(panels)
    return round(height * DPI), round(width * DPI)


def _committed(name: str) -> dict:
    return json.loads((BENCH / name).read_text())


def test_each_figure_of_the_committed_results_has_a_panel_per_model(tmp_path):
    zero = _committed("zero_results.json")
    assert _shape(plot_zero(zero, tmp_path / "zero.png")) == _pixels(len(zero["models"]))
    overhead = _committed("results.json")
    models = len(overhead["sections"]["overhead"])
    assert _shape(plot_overhead(overhead, tmp_path / "overhead.png")) == _pixels(models)
    reductions = _committed("reductions_results.json")
    assert _shape(plot_reductions(reductions, tmp_path / "reductions.png")) == _pixels(2)


def test_trimmed_results_one_model_and_a_quality_run_without_bytes(tmp_path):
    zero = _committed("zero_results.json")
    zero["models"] = {"tiny_gpt": zero["models"]["tiny_gpt"]}
    assert _shape(plot_zero(zero, tmp_path / "zero.png")) == _pixels(1)
    results = _committed("results.json")
    results["sections"] = {"overhead": {"mlp": results["sections"]["overhead"]["mlp"]}}
    assert _shape(plot_overhead(results, tmp_path / "overhead.png")) == _pixels(1)
    reductions = _committed("reductions_results.json")
    reductions["bytes"] = {"mean": reductions["bytes"]["mean"]}  # the others: not measured
    assert _shape(plot_reductions(reductions, tmp_path / "reductions.png")) == _pixels(2)


def _command(directory: Path, block: bool) -> subprocess.CompletedProcess:
    block_it = "import sys; sys.modules['matplotlib'] = None; " if block else ""
    return subprocess.run(
        [
            sys.executable,
            "-c",
            f"{block_it}import sys; from benchmarks.plots import main; sys.exit(main())",
            "--dir",
            str(directory),
        ],
        cwd=directory,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_the_command_redraws_beside_the_results_and_skips_without_matplotlib(tmp_path):
    for name in FIGURES:
        shutil.copy(BENCH / name, tmp_path / name)
    skipped = _command(tmp_path, block=True)
    assert skipped.returncode == 0, skipped.stderr
    assert skipped.stderr.strip() == (
        "benchmarks.plots: figures skipped: matplotlib is not installed "
        "(pip install 'xshard[plots]')"
    )
    assert not list(tmp_path.glob("*.png"))
    drawn = _command(tmp_path, block=False)
    assert drawn.returncode == 0, drawn.stderr
    assert sorted(p.name for p in tmp_path.glob("*.png")) == sorted(f for f, _ in FIGURES.values())
    assert all(_shape(tmp_path / f)[0] == _pixels(1)[0] for f, _ in FIGURES.values())
