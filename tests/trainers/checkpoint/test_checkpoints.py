"""Checkpoints in-process on a small synthetic state: save, restore onto another mesh,
corruption, compatibility; the signal handler and the non-finite monitor."""

from __future__ import annotations

import json
import math
import shutil
import signal
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests.reliability_helpers import assert_bitwise_equal, snapshot, truncate_data
from trainers.checkpoint.compat import check_compatible
from trainers.checkpoint.io import read_damage
from trainers.checkpoint.resume import (
    RestoreSource,
    complete_steps,
    find_resume_source,
    restore_checkpoint,
)
from trainers.checkpoint.save import CheckpointHook
from trainers.cluster.preemption import StopOnSignal
from trainers.config import CheckpointOptions
from trainers.core.step import TrainState
from trainers.exits import CheckpointError, NonFiniteError
from trainers.hooks.monitor import NonFiniteMonitor
from trainers.tasks.mlp import MLPTask
from xshard.errors import ConfigError

# --------------------------------------------------------------------------------------------
# In-process: checkpoints of a small synthetic state
# --------------------------------------------------------------------------------------------

CONFIG = {
    "task": {"_target_": "trainers.tasks.mlp.MLPTask", "hidden": [32]},
    "optimizer": {"_target_": "optax.adam", "learning_rate": 0.1},
}


def synthetic_state(
    mesh_shape: tuple[int, ...], step: int, *, rows: int = 256, seed: int = 0
) -> TrainState:
    """Params, adam state and step, with `w` sharded over the first mesh axis."""
    names = ("data", "model")[: len(mesh_shape)]
    mesh = jax.make_mesh(mesh_shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))
    w = jax.random.normal(jax.random.key(seed), (rows, 32), jnp.float32)
    params = {
        "w": jax.device_put(w, NamedSharding(mesh, P("data"))),
        "b": jax.device_put(jnp.arange(32, dtype=jnp.float32), NamedSharding(mesh, P())),
    }
    opt_state = jax.device_put(optax.adam(0.1).init(params), NamedSharding(mesh, P()))
    return TrainState(jax.device_put(jnp.int32(step), NamedSharding(mesh, P())), params, opt_state)


def save(directory: Path, *states: TrainState, config: dict = CONFIG) -> None:
    hook = CheckpointHook(directory, CheckpointOptions(async_save=False, keep=None), config)
    for state in states:
        hook.save(int(state.step), state)
    hook.close()


def host(state: TrainState) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(state))[0]
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves}


def test_restore_onto_another_mesh_is_exact_and_uses_the_target_shardings(tmp_path):
    saved = synthetic_state((8,), step=7, seed=1)
    save(tmp_path / "ckpt", saved)
    target = synthetic_state((4, 2), step=0, seed=2)
    restored = restore_checkpoint(RestoreSource(tmp_path / "ckpt"), target, CONFIG)
    assert_bitwise_equal(host(restored), host(saved))
    assert jax.tree.map(lambda x: x.sharding, restored) == jax.tree.map(
        lambda x: x.sharding, target
    )


def test_a_state_with_non_finite_params_is_never_written(tmp_path):
    state = synthetic_state((8,), step=3)
    bad = state._replace(params={**state.params, "b": state.params["b"].at[0].set(jnp.inf)})
    hook = CheckpointHook(tmp_path / "ckpt", CheckpointOptions(async_save=False), CONFIG)
    with pytest.raises(NonFiniteError, match="not finite at step 3"):
        hook.save(3, bad)
    hook.close()
    assert complete_steps(tmp_path / "ckpt") == []


def _delete_manifest(step_dir: Path) -> None:
    for f in (step_dir / "state").rglob("manifest.ocdbt"):
        f.unlink()


def _garble_metadata(step_dir: Path) -> None:
    (step_dir / "metadata" / "metadata").write_text("{not json")


def _other_format_metadata(step_dir: Path) -> None:
    (step_dir / "metadata" / "metadata").write_text('{"format": "someone.else/2", "step": 2}')


def _list_metadata(step_dir: Path) -> None:
    (step_dir / "metadata" / "metadata").write_text("[1, 2, 3]")


def _malformed_metadata(step_dir: Path) -> None:
    path = step_dir / "metadata" / "metadata"
    metadata = json.loads(path.read_text())
    metadata["signature"]["['params']['b']"] = 32  # not [shape, dtype]
    path.write_text(json.dumps(metadata))


def _delete_array_metadata(step_dir: Path) -> None:
    (step_dir / "state" / "_METADATA").unlink()  # Orbax then reads another array tree


def _delete_process_folder(step_dir: Path) -> None:
    shutil.rmtree(step_dir / "state" / "ocdbt.process_0")  # TensorStore: FAILED_PRECONDITION


def _swap_data(step_dir: Path) -> None:
    """Replaces the step's arrays by step 1's: valid files holding other values, which is how
    silently changed array bytes look to Orbax (it keeps no checksum of array data)."""
    shutil.rmtree(step_dir / "state")
    shutil.copytree(step_dir.parent / "1" / "state", step_dir / "state")


# Orbax leaves a callback to its closed event loop after a failed read: harmless, reported.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize(
    "corrupt, message",
    [
        (truncate_data, "corrupted or truncated"),
        (_delete_manifest, "corrupted or truncated"),
        (_delete_array_metadata, "corrupted or truncated"),
        (_delete_process_folder, "corrupted or truncated"),
        (_garble_metadata, "metadata cannot be read"),
        (_other_format_metadata, "metadata is not .* \\(found format 'someone.else/2'\\)"),
        (_list_metadata, "metadata is not .* \\(found a JSON list, not an object\\)"),
        (_malformed_metadata, "with a malformed signature entry"),
        (_swap_data, "does not match the checksums saved with it"),
    ],
    ids=[
        "truncated",
        "deleted-file",
        "deleted-array-metadata",
        "deleted-process-folder",
        "garbled-metadata",
        "other-format-metadata",
        "list-metadata",
        "malformed-metadata",
        "changed-data",
    ],
)
def test_corrupted_checkpoint_is_an_error_or_falls_back_to_the_previous_step(
    tmp_path, corrupt, message
):
    ckpt = tmp_path / "checkpoints"
    first, second = synthetic_state((8,), step=1, seed=1), synthetic_state((8,), step=2, seed=2)
    save(ckpt, first, second)
    corrupt(ckpt / "2")
    before = snapshot(tmp_path)
    target = synthetic_state((8,), step=0, seed=3)

    with pytest.raises(CheckpointError, match=message) as err:
        restore_checkpoint(RestoreSource(ckpt, own=True), target, CONFIG)
    assert "checkpoint.fallback_to_previous=true to resume from step 1" in str(err.value)
    assert snapshot(tmp_path) == before  # nothing moved, nothing deleted

    restored = restore_checkpoint(
        RestoreSource(ckpt, own=True), target, CONFIG, fallback_to_previous=True
    )
    assert_bitwise_equal(host(restored), host(first))
    assert complete_steps(ckpt) == [1] and (tmp_path / "checkpoints.corrupt" / "2").is_dir()


def test_an_error_that_is_not_damaged_data_is_not_called_corruption(tmp_path, monkeypatch):
    """Orbax's own refusal of a relative path (what ``trainers.evaluate runs/a`` met), and a
    file the OS refuses to read, are not corruption: no advice to fall back follows them."""
    save(tmp_path / "ckpt", synthetic_state((8,), step=2))
    monkeypatch.chdir(tmp_path)
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        with pytest.raises(ValueError, match="should be absolute") as err:
            checkpointer.restore(
                Path("ckpt/2"), args=ocp.args.Composite(state=ocp.args.StandardRestore())
            )
    assert not read_damage(err.value)
    assert not read_damage(PermissionError(13, "Permission denied", "ckpt/2/state/d/x"))
    truncate_data(tmp_path / "ckpt" / "2")
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        with pytest.raises(ValueError, match="OUT_OF_RANGE") as err:
            checkpointer.restore(
                tmp_path / "ckpt" / "2", args=ocp.args.Composite(state=ocp.args.StandardRestore())
            )
    assert read_damage(err.value)


def test_a_relative_source_restores_from_the_working_directory(tmp_path, monkeypatch):
    saved = synthetic_state((8,), step=3, seed=1)
    save(tmp_path / "runs" / "a" / "checkpoints", saved)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    target = synthetic_state((8,), step=0, seed=2)
    source = find_resume_source(tmp_path / "own", "../runs/a")
    assert source == RestoreSource(tmp_path / "runs" / "a" / "checkpoints")
    relative = RestoreSource(Path("../runs/a/checkpoints"))
    for where in (source, relative):
        assert_bitwise_equal(host(restore_checkpoint(where, target, CONFIG)), host(saved))


def test_incompatible_checkpoint_names_what_differs(tmp_path):
    save(tmp_path / "ckpt", synthetic_state((8,), step=4))
    target = synthetic_state((8,), step=0, rows=128)
    other = {**CONFIG, "task": {**CONFIG["task"], "hidden": [16]}}
    with pytest.raises(CheckpointError) as err:
        restore_checkpoint(RestoreSource(tmp_path / "ckpt"), target, other)
    text = str(err.value)
    assert "task.hidden: [32] in the checkpoint, [16] now" in text
    assert "(256, 32) float32 in the checkpoint, (128, 32) float32 now" in text

    sgd = {**CONFIG, "optimizer": {"_target_": "optax.sgd", "learning_rate": 0.1}}
    with pytest.raises(CheckpointError, match='optimizer._target_: "optax.adam" in the checkpoint'):
        restore_checkpoint(RestoreSource(tmp_path / "ckpt"), synthetic_state((8,), 0), sgd)


def test_resume_source_prefers_own_checkpoints_and_ignores_unfinished_saves(tmp_path):
    run = tmp_path / "run"
    save(run / "checkpoints", synthetic_state((8,), step=5))
    unfinished = run / "checkpoints" / "6.orbax-checkpoint-tmp"  # what kill -9 mid-save leaves
    (unfinished / "state").mkdir(parents=True)

    assert find_resume_source(run / "checkpoints", None) == RestoreSource(
        run / "checkpoints", own=True
    )
    own = tmp_path / "own" / "checkpoints"
    assert find_resume_source(own, str(run)) == RestoreSource(run / "checkpoints")
    assert find_resume_source(own, str(run / "checkpoints" / "5")) == RestoreSource(
        run / "checkpoints", 5
    )
    assert find_resume_source(own, None) is None
    for bad in (str(tmp_path / "nowhere"), str(unfinished)):
        with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
            find_resume_source(own, bad)

    save(run / "checkpoints", synthetic_state((8,), step=6))  # the step the killed run was saving
    assert not unfinished.exists() and complete_steps(run / "checkpoints") == [5, 6]


@pytest.mark.parametrize(
    "node, message",
    [
        ({"every_steps": -1}, "checkpoint.every_steps=-1"),
        ({"keep": 0}, "checkpoint.keep=0"),
        ({"async_save": "maybe"}, "checkpoint.async_save='maybe'"),
        ({"every": 5}, "checkpoint.every: unknown key"),
    ],
)
def test_checkpoint_options_are_validated(node, message):
    with pytest.raises(ConfigError, match=message):
        CheckpointOptions.from_config(node)


# --------------------------------------------------------------------------------------------
# In-process: signals, the non-finite monitor, the NaN task option
# --------------------------------------------------------------------------------------------


def test_first_signal_requests_a_stop_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    with StopOnSignal() as stop:
        assert not stop()
        signal.raise_signal(signal.SIGTERM)
        assert stop() and stop.signal_name == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before


def test_second_signal_acts_as_if_no_handler_was_installed():
    # SIGINT as in a foreground process (a shell's background job starts with it ignored).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt), StopOnSignal() as stop:
            signal.raise_signal(signal.SIGINT)
            assert stop()
            signal.raise_signal(signal.SIGINT)  # the default SIGINT handler raises
    finally:
        signal.signal(signal.SIGINT, previous)


def test_ignored_signals_stay_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopOnSignal() as stop:
            signal.raise_signal(signal.SIGINT)
            assert not stop()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_monitor_limits():
    skipping = NonFiniteMonitor(skip_nonfinite=True, max_consecutive=2)
    skipping.on_step(1, {"train/loss": math.nan, "train/consecutive_skipped": 2.0})
    with pytest.raises(NonFiniteError, match="3 consecutive .*trainer.max_consecutive_nonfinite=2"):
        skipping.on_step(2, {"train/loss": math.nan, "train/consecutive_skipped": 3.0})

    strict = NonFiniteMonitor(skip_nonfinite=False, max_consecutive=2)
    strict.on_step(1, {"train/loss": 1.0, "grad/nonfinite": 0.0})
    with pytest.raises(NonFiniteError, match="loss nan at step 2"):
        strict.on_step(2, {"train/loss": math.nan, "grad/nonfinite": 3.0})
    with pytest.raises(NonFiniteError, match="3 gradient values at step 3"):
        strict.on_step(3, {"train/loss": 1.0, "grad/nonfinite": 3.0})


def test_mlp_nan_at_step_accepts_a_list():
    task = MLPTask(nan_at_step=[1, 3])
    bad = [step for step, b in zip(range(5), task.batches(8, seed=0)) if np.isnan(b["x"]).any()]
    assert bad == [1, 3]
    with pytest.raises(ValueError, match="task.nan_at_step='3'"):
        MLPTask(nan_at_step="3")


@pytest.mark.parametrize(("now", "reported"), [("auto", False), ("gspmd", True)])
def test_a_path_auto_resolved_is_no_config_change_but_another_path_is(caplog, now, reported):
    saved = {"config": {"trainer": {"grad_impl": "manual"}}, "signature": {}}
    with caplog.at_level("WARNING", logger="trainers.checkpoint.compat"):
        check_compatible(saved, {}, {"trainer": {"grad_impl": now}}, where="ckpt")
    assert ("trainer.grad_impl" in caplog.text) is reported


@pytest.mark.parametrize(
    ("key", "reported"),
    [
        ("standby", False),  # a group's warm standby wrote it (or resumes it): the same run
        ("lighthouse", False),  # a location (`LOCATION_KEYS`), its axis matched by `*`
        ("min_groups", True),  # a change of what the run does is still reported
    ],
)
def test_an_elastic_groups_standby_flag_and_locations_are_no_config_change(caplog, key, reported):
    def config(value):
        return {"reduction": {"axes": {"slice": {"elastic": {"group": 1, key: value}}}}}

    saved = {"config": config(True), "signature": {}}
    with caplog.at_level("WARNING", logger="trainers.checkpoint.compat"):
        check_compatible(saved, {}, config(False), where="ckpt")
    line = f"with a changed config: reduction.axes.slice.elastic.{key}: true in the checkpoint"
    assert (line in caplog.text) is reported
