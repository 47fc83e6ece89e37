"""Short run names (``logger.run_names``): a sweep job's folder and TensorBoard run read as its
number and what was swept, the full overrides stay in HParams and ``result.json``.

The rules in-process; a real DiLoCo sweep through the CLI, whose two jobs round to the same
name but for their number, and the old names on request.
"""

from __future__ import annotations

import json

import pytest

from tests.cli import hparams_dashboard, refused, run_train
from trainers.config.cli_args import override_key
from trainers.config.resolvers import NAME_MAX, safe_name
from trainers.config.run_names import short_name, shown_value

OUTER_LR = "reduction.axes.slice.outer_optimizer.learning_rate"
EVERY = "reduction.axes.slice.every_steps"


@pytest.mark.parametrize(
    "line, key",
    [
        ("trainer.steps=7", "trainer.steps"),
        ("+extra.key=1", "extra.key"),
        ("++trainer.steps=7", "trainer.steps"),
        ("~clip", "clip"),
        ("~clip=null", "clip"),
        ("optimizer@opt=adam", "optimizer@opt"),
        ("hydra/launcher=basic", "hydra/launcher"),
        ("task.hidden=[32,32]", "task.hidden"),
        ("a b=c", "a b"),  # Hydra cannot parse it: the text before "=", as typed
    ],
)
def test_an_override_key_is_read_as_hydra_reads_it(line, key):
    assert override_key(line) == key


@pytest.mark.parametrize(
    "value, shown",
    [
        ("0.6166052607590903", "0.617"),
        ("3e-4", "0.0003"),
        ("1e-05", "1e-05"),
        ("1e4", "1e+04"),
        ("16", "16"),
        ("adam", "adam"),
        ("[32,32]", "[32,32]"),
        ("null", "null"),
        ("nan", "nan"),
        ("1.0.2", "1.0.2"),
    ],
)
def test_floats_are_rounded_for_display_and_the_rest_kept(value, shown):
    assert shown_value(value) == shown


def test_a_job_is_its_number_and_the_last_component_of_each_key():
    overrides = [f"{EVERY}=16", f"{OUTER_LR}=0.6166052607590903"]
    assert short_name(overrides, 3) == "3_every_steps=16,learning_rate=0.617"
    assert short_name(overrides) == "every_steps=16,learning_rate=0.617"  # a single run
    assert short_name([], 0) == "0" and short_name([]) == "run"


def test_keys_with_the_same_last_component_keep_what_tells_them_apart():
    overrides = ["optimizer.learning_rate=3e-4", f"{OUTER_LR}=0.7", "+note=x", "~schedule"]
    assert short_name(overrides) == (
        "optimizer.learning_rate=0.0003,outer_optimizer.learning_rate=0.7,note=x,~schedule"
    )


def test_names_stay_apart_and_fit_a_folder_where_values_round_alike_or_run_long():
    same = [short_name([f"{OUTER_LR}={v}"], n) for n, v in enumerate(("0.61660", "0.61661"))]
    assert same == ["0_learning_rate=0.617", "1_learning_rate=0.617"]
    long = [safe_name(short_name([f"+note={c * 400}"], n)) for n, c in enumerate("ab")]
    assert all(len(n.encode()) <= NAME_MAX for n in long) and long[0] != long[1]


def test_a_bad_style_is_one_line_naming_the_key(tmp_path):
    proc = run_train("task=mlp", "logger.run_names=long", cwd=tmp_path, check=False)
    refused(proc, "logger.run_names='long': expected one of ['short', 'overrides']")


@pytest.mark.slow
def test_a_diloco_sweep_names_its_jobs_short_and_keeps_the_full_overrides(tmp_path):
    sweep = tmp_path / "sweep"
    values = ("0.6166052607590903", "0.61660526")  # both show as 0.617
    run_train(
        "-m",
        "task=mlp",
        "reduction=diloco",
        "mesh=cpu2x4_slices",
        "checkpoint=none",
        "trainer.steps=2",
        f"{EVERY}=1",
        f"{OUTER_LR}={','.join(values)}",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    # the swept key only: the overrides every job shares stay out of its name
    names = [f"{n}_learning_rate=0.617" for n in (0, 1)]
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir() and p.name != "tb")
    assert jobs == names
    assert sorted(p.name for p in (sweep / "tb").iterdir()) == names
    # The full values: in each job's result.json and in TensorBoard's HParams.
    for name, value in zip(names, values, strict=True):
        record = json.loads((sweep / name / "result.json").read_text())
        assert f"{OUTER_LR}={value}" in record["overrides"]
    runs = hparams_dashboard(sweep / "tb")["runs"]
    assert sorted(r["hparams"][OUTER_LR] for r in runs.values()) == sorted(map(float, values))


@pytest.mark.slow
def test_the_overrides_as_typed_on_request(tmp_path):
    run = tmp_path / "run"
    # The path named, as tests.cli would otherwise add it to what was typed.
    overrides = ("task=mlp", "checkpoint=none", "trainer.steps=2", "optimizer.learning_rate=3e-4")
    overrides = (*overrides, "trainer.grad_impl=manual")
    run_train(*overrides, "logger.run_names=overrides", f"hydra.run.dir={run}", cwd=tmp_path)
    (folder,) = (run / "tb").iterdir()
    assert folder.name == ",".join(sorted([*overrides, "logger.run_names=overrides"]))
