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
    assert record["dry_run"]
    stages = record["stages"]
    assert [stages[n]["exit"] for n in ("probe", "throughput", "population")] == ["0"] * 3
    assert stages["zero_bytes"]["exit"] == "dry-run"  # compiles 8 GPT steps: listed only
    assert "benchmarks.zero --bytes-only --impls gspmd" in result.stderr
    assert {stages[n]["exit"] for n in ("install", "cli", "memory", "tests")} == {"dry-run"}
    probe = record["probe"]
    assert probe["backend"] == "cpu" and probe["devices"] == 8
    assert probe["dots"]["bfloat16"]["lowered"] == ["bf16"]
    assert probe["dots"]["float32"]["lowered"] == ["f32"]
    assert probe["bf16"]["bf16_within_2pct"]
    assert set(probe["bf16"]["runs"]) == {"float32", "bfloat16"}
    assert probe["zero2_gspmd"]["checked"]
    assert probe["checkpoint"] == {
        "bitwise_equal": True,
        "restored_on": ["cpu"],
        "same_shardings": True,
    }
    quick = record["throughput"]["models"]["quick"]
    for key in ("float32/xshard", "float32/jit", "bfloat16/xshard", "bfloat16/jit"):
        assert quick[key]["tokens_per_s"] > 0, key
    population = record["population"]  # 2 trials of 3 steps in one population
    assert population["overrides"] == ["mesh=auto"] and population["steps"] == 3
    assert [job["status"] for job in population["population"]["jobs"].values()] == ["completed"] * 2


def test_a_failing_stage_is_recorded_and_the_results_still_written(tmp_path):
    """A Python that fails every stage (the probe, the throughput): the script still exits 0
    with one results file naming each stage's exit status."""
    out = tmp_path / "device_results.json"
    fake = tmp_path / "python"
    script = f'#!/bin/sh\ncase "$2" in benchmarks.*) exit 3;; esac\nexec {sys.executable} "$@"\n'
    fake.write_text(script)
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake)}
    result = subprocess.run(
        ["bash", "benchmarks/device_check.sh", "--dry-run", "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    record = json.loads(out.read_text())
    assert record["stages"]["probe"]["exit"] == "3"
    assert record["stages"]["throughput"]["exit"] == "3"
    assert record["stages"]["population"]["exit"] == "3"
    assert record["probe"] is None and record["throughput"] is None
    assert record["population"] is None
    assert "probe exited 3" in result.stderr


def test_an_unknown_argument_exits_2():
    result = subprocess.run(
        ["bash", "benchmarks/device_check.sh", "--bogus"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2 and "unknown argument --bogus" in result.stderr


def test_the_probe_reads_gemm_dtypes_in_gpu_hlo():
    """XLA:GPU compiles a dot to a cuBLAS custom call (a tuple: result and workspace) or a
    Triton GEMM fusion; the probe reads their result dtypes like a plain ``dot``'s."""
    from benchmarks.device_probe import dot_dtypes

    cublas = (
        "%custom-call.3 = (bf16[64,256]{1,0}, s8[4194304]{0}) custom-call(bf16[64,256]{1,0} %a, "
        'bf16[256,256]{1,0} %b), custom_call_target="__cublas$gemm"'
    )
    triton = (
        "%fusion.2 = f32[8,8]{1,0} fusion(f32[8,8]{1,0} %x, f32[8,8]{1,0} %y), kind=kCustom, "
        "calls=%gemm_fusion_dot.1, "
        'backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}'
    )
    add = "%add.1 = f16[4,4]{1,0} add(f16[4,4]{1,0} %p, f16[4,4]{1,0} %q)"
    assert dot_dtypes(cublas) == ["bf16"]
    assert dot_dtypes(triton) == ["f32"]
    assert dot_dtypes("\n".join([cublas, triton, add])) == ["bf16", "f32"]
