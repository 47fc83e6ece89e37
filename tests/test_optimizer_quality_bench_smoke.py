"""The optimizers' quality benchmark still runs: ``python -m benchmarks.optimizer_quality --smoke``.

In this process (task=mlp, 4 updates, one seed: about 15 s of CPU). Checks that every optimizer
was composed as a user must type it and trained to finite losses; never which one is better.
"""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.optimizer_quality import main
from benchmarks.workloads import CLI_OPTIMIZERS

pytestmark = pytest.mark.long


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("optimizers") / "optimizers.json"
    assert main(["--smoke", "--out", str(out)]) == 0
    assert out.with_suffix(".md").read_text().startswith("# Optimizers at the CLI's defaults")
    return json.loads(out.read_text())


def test_every_optimizer_trained_to_finite_losses_with_gaps_to_adamw(results):
    assert results["meta"]["mode"] == "smoke" and results["meta"]["device_count"] == 8
    variants = results["quality"]["variants"]
    assert list(variants) == list(CLI_OPTIMIZERS)
    for name, v in variants.items():
        assert [r["seed"] for r in v["runs"]] == list(results["settings"]["seeds"]), name
        for run in v["runs"]:
            assert math.isfinite(run["train_loss"]) and math.isfinite(run["eval_loss"]), name
            assert run["step_ms"] > 0, name
        assert v["eval_loss"]["min"] <= v["eval_loss"]["mean"] <= v["eval_loss"]["max"]
        assert v["step_ms"]["vs_adamw"] > 0, name
    assert variants["adamw"]["eval_loss"]["vs_adamw"] == 0.0
    # The runs differ: each optimizer's updates, not one optimizer four times.
    assert len({v["eval_loss"]["mean"] for v in variants.values()}) == len(variants)


def test_each_optimizer_is_composed_as_a_user_must_type_it(results):
    variants = results["quality"]["variants"]
    for name, v in variants.items():
        s = v["settings"]
        assert s["overrides"] == list(CLI_OPTIMIZERS[name]) and s["task"] == "mlp"
        assert s["learning_rate"] > 0 and s["global_batch_size"] > 0
    schedules = {name: v["settings"]["schedule"] for name, v in variants.items()}
    # schedule-free AdamW refuses the CLI's decaying default; the others keep it.
    assert schedules.pop("schedule_free_adamw") == "xshard.schedules.constant"
    assert set(schedules.values()) == {"xshard.schedules.warmup_cosine"}
    assert variants["muon"]["settings"]["optimizer"] == "xshard.optim.muon.muon"
