"""The HParams entry: overrides first, then group choices, no schemas, null as "null"; read back
with TensorBoard's own HParams backend (what its dashboard is served)."""

import re

import pytest
from hydra import compose, initialize_config_module
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from tests.cli import hparams_dashboard
from trainers.config.cli_args import run_overrides
from trainers.config.plain import run_config
from trainers.hooks.hparams import NULL, hparams, shown
from trainers.hooks.logged_scalars import LoggedScalars, ScalarOptions
from trainers.hooks.run_logger import LoggerHook, RunInfo
from trainers.hooks.summary import RunSummary
from trainers.hooks.tensorboard import TensorBoardSink

OVERRIDES = [
    "trainer.steps=7",
    "optimizer.learning_rate=0.5",
    "reduction=sum",
    "clip=null",
    "task=mlp",
    "task.hidden=[32,32]",
    "trainer.progress=false",  # excluded from run names: not a hyperparameter
    "hydra.job.name=xs",  # Hydra's own keys are not hyperparameters either
]


def tensorboard(logdir, run: RunInfo, summary: RunSummary) -> LoggerHook:
    """The logging hook of a run that logs every step to TensorBoard only."""
    scalars = LoggedScalars(ScalarOptions(log_every=1, num_steps=2, global_batch_size=8))
    sinks = [TensorBoardSink(str(logdir), flush_secs=10)]
    return LoggerHook(sinks, run, scalars, summary)


@pytest.fixture()
def composed(tmp_path):
    """The composed config with Hydra's runtime config set up, as in a CLI run."""
    with initialize_config_module("xshard.conf", version_base="1.3"):
        cfg = compose(
            "xshard_train",
            overrides=[*OVERRIDES, f"hydra.runtime.output_dir={tmp_path}"],
            return_hydra_config=True,
        )
    HydraConfig.instance().set_config(cfg)
    try:
        yield cfg
    finally:
        HydraConfig.instance().cfg = None


def run_hparams(composed):
    """The hparams as the app hands them over: the run's plain config and Hydra's overrides."""
    config = run_config(OmegaConf.masked_copy(composed, [k for k in composed if k != "hydra"]))
    return hparams(config, run_overrides())


def test_overrides_first_in_order_then_choices_then_key_values(composed):
    values, overridden = run_hparams(composed)
    names = list(values)
    assert names[:5] == [
        "trainer.steps",
        "optimizer.learning_rate",
        "reduction",
        "clip",
        "task",
    ]
    assert names[5] == "task.hidden"
    assert set(overridden) == set(names[:6])
    # Then the other groups, in the order of the config, then the compared values.
    groups = ["optimizer", "schedule", "precision", "mesh", "checkpoint", "logger", "experiment"]
    assert names[6:13] == groups
    assert names[13:] == ["seed", "reduction.mode", "trainer.batch_size"]
    assert not any(n.startswith(("xshard_schemas", "hydra")) or "progress" in n for n in names)
    assert values["trainer.steps"] == 7.0 and values["optimizer.learning_rate"] == 0.5
    assert values["reduction"] == "sum" and values["reduction.mode"] == "sum"
    assert values["clip"] == NULL and values["experiment"] == NULL
    assert values["task.hidden"] == "[32,32]"


def test_shown_values():
    assert shown(None) == "null" and shown(True) is True and shown(3) == 3.0
    assert shown({"a": [1, None]}) == '{"a":[1,null]}'


def test_tensorboard_serves_the_overrides_first_and_the_session_status(composed, tmp_path):
    values, overridden = run_hparams(composed)
    for run, ok in (("good", True), ("bad", False)):
        info = RunInfo(
            hparams={**values, "optimizer.learning_rate": 0.5 if ok else 1e4},
            overridden=overridden,
        )
        summary = RunSummary()
        hook = tensorboard(tmp_path / "tb" / run, info, summary)
        for step, loss in ((1, 0.25), (2, 0.5 if ok else float("inf"))):
            summary.on_step(step, {"train/loss": loss})
            hook.on_step(step, {"train/loss": loss})
        hook.on_end(2, None, "done" if ok else "error")

    shown_first = hparams_dashboard(tmp_path / "tb", limit=6)
    # TensorBoard lists the `differs` hparams first (by name): exactly the overrides.
    assert set(shown_first["hparams"]) == set(overridden)
    assert shown_first["metrics"] == [
        "hparams/final_loss",
        "hparams/best_loss",
        "hparams/last_step",
    ]
    runs = shown_first["runs"]
    assert runs["good"]["status"] == "STATUS_SUCCESS"
    assert runs["bad"]["status"] == "STATUS_FAILURE"
    assert runs["bad"]["hparams"]["optimizer.learning_rate"] == 1e4
    assert runs["good"]["hparams"]["clip"] == "null"
    assert "xshard_schemas/optimizer@optimizer" not in runs["good"]["hparams"]


def test_custom_scalars_layout_is_read_by_tensorboard(tmp_path):
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata

    from tests.cli import load_events

    tensorboard(tmp_path, RunInfo(), RunSummary()).on_end(1, None, "done")
    events = load_events(tmp_path)
    (tensor,) = events.Tensors(metadata.CONFIG_SUMMARY_TAG)
    layout = layout_pb2.Layout.FromString(tensor.tensor_proto.string_val[0])
    (category,) = layout.category
    titles = [chart.title for chart in category.chart]
    assert category.title == "xshard" and titles[:2] == ["loss", "learning rate"]
    assert "throughput" in titles
    loss = category.chart[0].multiline.tag
    assert list(loss) == ["^train/loss$"]
    charts = {chart.title: list(chart.multiline.tag) for chart in category.chart}
    tags = ["eval/loss", "eval/accuracy", "eval/perplexity", "comm/slice/bytes_per_step"]
    tags += ["sync/slice/pseudo_grad_norm", "sync/slice/fragment_1/replica_drift"]
    tags += ["comm/slice/compression_error_norm", "sync/slice/skipped"]
    shown = {t: [c for c, res in charts.items() if any(re.search(r, t) for r in res)] for t in tags}
    # each of these in exactly one chart: eval loss and accuracy never share an axis
    assert all(len(c) == 1 for c in shown.values()), shown
    assert len({shown[t][0] for t in tags[:3]}) == 3


def test_run_names_read_as_the_overrides_and_fit_in_a_folder_name(composed, tmp_path):
    from trainers.config.resolvers import run_name, safe_name, tb_dir

    hc = HydraConfig.get()
    assert run_name(hc, "overrides") == (
        "clip=null,optimizer.learning_rate=0.5,reduction=sum,task.hidden=[32,32],task=mlp,"
        "trainer.steps=7"
    )
    name = run_name(hc)  # logger.run_names=short, the default
    assert name == "clip=null,learning_rate=0.5,reduction=sum,hidden=[32,32],task=mlp,steps=7"
    assert tb_dir(str(tmp_path)) == str(tmp_path / "tb" / name)
    assert tb_dir(str(tmp_path), "overrides") == str(tmp_path / "tb" / run_name(hc, "overrides"))
    (tmp_path / "tb" / "first").mkdir(parents=True)  # a rerun continues the run's folder
    assert tb_dir(str(tmp_path)) == str(tmp_path / "tb" / "first")
    long = safe_name("x=" + "a/" * 300)
    assert len(long.encode()) <= 200 and "/" not in long and long != safe_name("x=" + "b/" * 300)
