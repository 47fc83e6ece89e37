"""Loggers as a config group (``logger=[tensorboard,csv,wandb,mlflow]``) through the real CLI,
with the real packages offline (W&B offline mode, MLflow's local file store): every logger gets
the same scalars, the resolved config, the hyperparameters and the run's summary, read back
from what each wrote. A logger whose package is missing is one line naming the pip extra."""

from __future__ import annotations

import csv
import json
import os
import struct
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import yaml

from tests.cli import refused, run_train, scalars

pytestmark = pytest.mark.slow

STEPS = 4
RUN = (
    "task=mlp",
    "mesh=cpu8",
    "trainer.batch_size=16",
    f"trainer.steps={STEPS}",
    "trainer.log_every=2",
    "trainer.eval_every=2",
    "trainer.eval_batches=1",
    "checkpoint=none",
    "optimizer.learning_rate=0.02",
)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("loggers")
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "MLFLOW_ALLOW_FILE_STORE": "true"}
    run_train(
        *RUN,
        "logger=[tensorboard,csv,wandb,mlflow]",
        f"logger.mlflow.tracking_uri=file:{root / 'mlruns'}",
        "logger.mlflow.experiment=loggers_test",
        f"hydra.run.dir={root / 'run'}",
        cwd=root,
        env=env,
    )
    return root


def tb_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    from tests.cli import load_events

    events = load_events(run_dir / "tb")
    return {tag: scalars(run_dir / "tb", tag) for tag in events.Tags()["scalars"]}


def csv_scalars(path: Path) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = defaultdict(dict)
    with path.open() as f:
        for row in csv.DictReader(f):
            out[row["name"]][int(row["step"])] = float(row["value"])
    return dict(out)


def wandb_records(run_dir: Path):
    """The records of the W&B offline run's ``.wandb`` file (a LevelDB-style log of
    `wandb_internal_pb2.Record`s after a 7-byte ``:W&B`` header)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    data, pos, block, chunk = path.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            break
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


def item_key(item) -> str:
    return item.key or "/".join(item.nested_key)


def test_every_logger_gets_the_same_scalars(run, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 deprecates the file store
    tb = tb_scalars(run / "run")
    csv_ = csv_scalars(run / "run" / "metrics.csv")
    assert tb["train/loss"] == csv_["train/loss"] and sorted(tb["train/loss"]) == [2, 4]
    assert tb["eval/loss"] == csv_["eval/loss"] and sorted(tb["eval/loss"]) == [2, 4]
    per_step = {t for t in tb if not t.startswith("hparams/")}
    assert per_step <= set(csv_)  # the timed perf/* values differ per logger, not their tags
    for tag in ("hparams/final_loss", "hparams/final_eval/loss", "hparams/last_step"):
        assert csv_[tag] == pytest.approx(tb[tag])

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"file:{run / 'mlruns'}")
    experiment = client.get_experiment_by_name("loggers_test")
    (ml_run,) = client.search_runs([experiment.experiment_id])
    assert ml_run.info.status == "FINISHED"
    history = client.get_metric_history(ml_run.info.run_id, "train/loss")
    assert {m.step: m.value for m in history} == pytest.approx(tb["train/loss"])
    assert ml_run.data.metrics["hparams/final_eval/loss"] == pytest.approx(
        tb["hparams/final_eval/loss"][STEPS]
    )
    assert ml_run.data.params["optimizer.learning_rate"] == "0.02"  # the hyperparameters
    text = client.download_artifacts(ml_run.info.run_id, "config.yaml", str(run / "dl"))
    assert yaml.safe_load(Path(text).read_text())["trainer"]["steps"] == STEPS  # resolved

    history_rows: dict[int, dict[str, float]] = defaultdict(dict)
    summary, config, exit_code = {}, {}, None
    for record in wandb_records(run / "run"):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config.update({item_key(i): json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            config.update({item_key(i): json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            row = {item_key(i): json.loads(i.value_json) for i in record.history.item}
            history_rows[int(row["_step"])].update(row)
        elif kind == "summary":
            summary.update({item_key(i): json.loads(i.value_json) for i in record.summary.update})
        elif kind == "exit":
            exit_code = record.exit.exit_code
    assert {s: r["train/loss"] for s, r in history_rows.items() if "train/loss" in r} == (
        pytest.approx(tb["train/loss"])
    )
    assert summary["hparams/final_loss"] == pytest.approx(tb["hparams/final_loss"][STEPS])
    assert exit_code == 0
    assert any("optimizer.learning_rate" in k for k in config), sorted(config)[:20]
    (files,) = (run / "run" / "wandb").glob("offline-run-*/files")
    assert yaml.safe_load((files / "xshard_config.yaml").read_text())["trainer"]["steps"] == STEPS


def test_csv_alone_writes_no_tensorboard_events(tmp_path):
    run_train(*RUN, "logger=csv", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert sorted(csv_scalars(tmp_path / "run" / "metrics.csv")["train/loss"]) == [2, 4]
    assert not list((tmp_path / "run").glob("tb/**/events.out.tfevents.*"))
    hparams = json.loads((tmp_path / "run" / "metrics.hparams.json").read_text())
    assert hparams["task"] == "mlp"


def test_a_missing_package_is_one_line_naming_the_extra(tmp_path):
    # A copy of the interpreter's path with wandb hidden: `import wandb` fails as uninstalled.
    hide = tmp_path / "hide" / "wandb"
    hide.mkdir(parents=True)
    (hide / "__init__.py").write_text("raise ImportError('not installed')\n")
    code = (
        "import importlib.util, sys; sys.modules['wandb'] = None; "
        "importlib.util.find_spec = (lambda f: lambda n, *a: None if n == 'wandb' else f(n, *a))"
        "(importlib.util.find_spec); sys.argv[0] = 'trainers.train'; import runpy; "
        "runpy.run_module('trainers.train', run_name='__main__')"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            *RUN,
            "logger=[tensorboard,wandb]",
            "trainer.progress=false",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
        env={**os.environ, "HYDRA_FULL_ERROR": "0"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    refused(result, "logger=wandb needs the wandb package", "pip install 'xshard[wandb]'")
