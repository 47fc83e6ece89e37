"""The ZeRO benchmark still runs: ``python -m benchmarks.zero --smoke`` writes its results.

Checks sizes and collectives (what the compiled programs hold), never timings.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests import REPO

pytestmark = pytest.mark.long


@pytest.mark.slow
def test_zero_benchmark_smoke_writes_memory_and_collectives(tmp_path):
    out = tmp_path / "zero.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.zero", "--smoke", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    assert out.with_suffix(".md").read_text().startswith("# ZeRO / FSDP against replicated")
    for model, sec in results["models"].items():
        v = sec["variants"]
        n = sec["devices"]
        assert set(v) == {f"{i}/zero{s}" for i in ("manual", "gspmd") for s in range(4)}, model
        for name, variant in v.items():
            assert variant["compiled"]["temp_size_in_bytes"] >= 0, name
            assert math.isfinite(variant["step"]["median_ms"]) and variant["step"]["median_ms"] > 0
        for impl in ("manual", "gspmd"):
            zero0 = v[f"{impl}/zero0"]
            for stage in (1, 2, 3):
                # ~1/N of the optimizer state (count, statistics and small leaves replicated)
                assert v[f"{impl}/zero{stage}"]["opt_state_bytes_per_device"] < (
                    zero0["opt_state_bytes_per_device"] * 2 / n + 16 * 1024
                )
            assert v[f"{impl}/zero3"]["params_bytes_per_device"] < (
                zero0["params_bytes_per_device"] * 2 / n + 4 * 1024
            )
        assert "reduce-scatter" in v["manual/zero2"]["collectives"]
        assert "reduce-scatter" not in v["manual/zero0"]["collectives"]


def test_ring_bytes_counts_an_all_to_all_as_n_minus_1_over_n_of_its_operand():
    # The owners of Muon's matrices at stage 3 exchange them by all-to-all (xshard.optim.muon).
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from benchmarks.zero import ring_bytes

    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    exchange = jax.jit(
        jax.shard_map(
            lambda x: jax.lax.all_to_all(x, "data", 0, 0, tiled=True),
            mesh=mesh,
            in_specs=P("data"),
            out_specs=P("data"),
        )
    )
    hlo = exchange.lower(jnp.zeros((64, 32), jnp.float32)).compile().as_text()
    found = ring_bytes(hlo, 8)
    assert found["counts"] == {"all-to-all": 1}
    assert found["sent_bytes"] == int(7 / 8 * 8 * 32 * 4)  # each device's (8, 32) operand


@pytest.mark.parametrize("impls", ["gspmd,pjit", ""])
def test_an_unknown_gradient_path_is_refused_before_anything_compiles(impls, capsys):
    # benchmarks/device_check.sh measures the gspmd path only (--impls gspmd).
    from benchmarks.zero import main

    with pytest.raises(SystemExit) as e:
        main(["--bytes-only", "--impls", impls, "--models", "gpt_8x256_muon"])
    assert e.value.code == 2
    assert f"--impls={impls}: choose from manual,gspmd" in capsys.readouterr().err
