"""benchmarks/device_check.sh --dry-run on CPU: the probe on 8 simulated devices, one results
file (the accelerator run itself needs a GPU or TPU host)."""

import json
import os
import subprocess
import sys

import pytest

from tests import REPO


@pytest.mark.slow
def test_dry_run_probes_the_devices_and_writes_one_results_file(tmp_path):
    out = tmp_path / "device_results.json"
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(
        ["bash", "benchmarks/device_check.sh", "--dry-run", "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "would run: " in result.stderr and "--find-links" in result.stderr
    record = json.loads(out.read_text())
    probe = record["probe"]
    assert record["dry_run"] and probe["backend"] == "cpu" and probe["devices"] == 8
    assert probe["dots"]["bfloat16"]["lowered"] == ["bf16"]
    assert probe["dots"]["float32"]["lowered"] == ["f32"]
    assert probe["bf16_within_2pct"]
    assert probe["zero2_gspmd"]["checked"]
    assert set(probe["runs"]) == {"float32", "bfloat16"}


def test_an_unknown_argument_exits_2():
    result = subprocess.run(
        ["bash", "benchmarks/device_check.sh", "--bogus"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2 and "unknown argument --bogus" in result.stderr
