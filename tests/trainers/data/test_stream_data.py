"""`StreamData` and the data iterator's state in checkpoints, in-process: shards per process,
Grain's iterator state round trip, the skip without a saved state, and a real Orbax checkpoint
written by `CheckpointHook` read back by `restore_data_state`."""

from __future__ import annotations

import functools

import grain
import jax
import numpy as np
import optax
import pytest

import xshard
from trainers.checkpoint.data_state import has_data_state, is_checkpointable, restore_data_state
from trainers.checkpoint.save import CheckpointHook
from trainers.config import CheckpointOptions
from trainers.core.trainer import Trainer
from trainers.data.stream import StreamData
from trainers.exits import CheckpointError
from trainers.tasks.mlp import MLPTask


class Numbers:
    def __len__(self):
        return 100

    def __getitem__(self, i):
        return {"i": np.int32(i), "x": np.full((3,), i, np.float32)}


def odd_stream(seed, shard_index, shard_count):
    """A stream with a filter: its position is not a function of the batches read."""
    source = grain.MapDataset.source(Numbers())[shard_index::shard_count]
    return source.shuffle(seed=seed).repeat().to_iter_dataset().filter(lambda e: e["i"] % 3)


def ids(iterator, n):
    return [next(iterator)["i"].tolist() for _ in range(n)]


@pytest.mark.parametrize("processes", [2, 4])
def test_each_process_reads_its_own_shard(processes):
    data = StreamData(grain.MapDataset.source(Numbers()))  # sliced [p::P] per process
    seen = [
        sum(ids(data.batches(8, seed=0, process_index=p, process_count=processes), 100 // 8), [])
        for p in range(processes)
    ]
    assert all(len(rows) == (100 // 8) * (8 // processes) for rows in seen)
    for p, rows in enumerate(seen):
        assert {i % processes for i in rows} == {p}  # shard p: indices p, p + P, ...
    factory = StreamData(odd_stream)
    first = [next(factory.batches(8, seed=0, process_index=p, process_count=2)) for p in (0, 1)]
    assert not set(first[0]["i"].tolist()) & set(first[1]["i"].tolist())


def test_an_iter_dataset_is_for_one_process_only():
    stream = grain.MapDataset.source(Numbers()).to_iter_dataset()
    assert len(ids(StreamData(stream).batches(4, seed=0), 3)) == 3
    with pytest.raises(ValueError, match="cannot be split over 2 processes"):
        StreamData(stream).batches(4, seed=0, process_count=2)
    with pytest.raises(TypeError, match="expected a factory"):
        StreamData([1, 2, 3])


def test_state_round_trip_and_skip_without_state():
    data = StreamData(odd_stream)
    it = data.batches(8, seed=1)
    assert is_checkpointable(it)
    ids(it, 3)
    state = it.get_state()
    want = ids(it, 4)
    again = data.batches(8, seed=1, start_step=99)  # the restore wins over the skip
    again.set_state(state)
    assert ids(again, 4) == want
    assert ids(data.batches(8, seed=1, start_step=3), 4) == want  # no saved state: skip 3


def test_checkpoint_hook_saves_the_iterator_state_and_restore_reads_it(tmp_path):
    task = MLPTask()
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    trainer = Trainer(task, xshard.cross_shard(optax.sgd(0.1), "mean"), mesh, global_batch_size=8)
    state = trainer.init(trainer.init_params(next(task.batches(8, seed=0))))
    data = StreamData(functools.partial(odd_stream)).batches(8, seed=2)
    ids(data, 5)
    hook = CheckpointHook(tmp_path, CheckpointOptions(async_save=True), {}, data)
    hook.save(5, state)
    want = ids(data, 3)  # read after the save: not in the checkpoint
    hook.close()
    assert has_data_state(tmp_path / "5")
    fresh = StreamData(odd_stream).batches(8, seed=2)
    assert restore_data_state(tmp_path / "5", fresh)
    assert ids(fresh, 3) == want
    # A checkpoint of another number of processes has no file of this process: one error.
    (tmp_path / "5" / "data" / "process_0-of-1.json").rename(
        tmp_path / "5" / "data" / "process_0-of-2.json"
    )
    with pytest.raises(CheckpointError, match="same data and number of processes"):
        restore_data_state(tmp_path / "5", StreamData(odd_stream).batches(8, seed=2))
