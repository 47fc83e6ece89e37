"""Data sources in epochs (`trainers.data`): `ArrayData` (NumPy) and `GrainData` (a real Grain
`MapDataset`) shuffle and batch per (seed, epoch), split each global batch across processes
without overlap, and are a pure function of the step (so resume needs no iterator state)."""

from __future__ import annotations

import grain
import numpy as np
import pytest

from trainers.data import ArrayData, DataSource
from trainers.data.arrays import TokenWindows
from trainers.data.grain_source import GrainData, shuffle_seed
from xshard.errors import ConfigError

N, B = 50, 8  # 6 steps per epoch, 2 examples of each epoch's order left out


class Source:
    """A random-access source as Grain's are: __len__ and __getitem__ of per-example dicts."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {"id": np.int64(i), "x": np.full((3,), i, np.float32)}


def make(kind: str, **kwargs):
    if kind == "grain":
        return GrainData(grain.MapDataset.source(Source()), **kwargs)
    ids = np.arange(N)
    return ArrayData({"id": ids, "x": np.repeat(ids[:, None], 3, 1).astype(np.float32)}, **kwargs)


KINDS = ["arrays", "grain"]


def ids(data, steps: int, **kwargs) -> list[list[int]]:
    it = data.batches(B, **{"seed": 0, **kwargs})
    return [next(it)["id"].tolist() for _ in range(steps)]


@pytest.mark.parametrize("kind", KINDS)
def test_each_epoch_is_a_new_shuffle_of_distinct_examples(kind):
    data = make(kind)
    assert isinstance(data, DataSource)
    first, second = ids(data, 6), ids(data, 12)[6:]
    for epoch in (first, second):
        flat = [i for batch in epoch for i in batch]
        assert len(set(flat)) == len(flat) == 6 * B and set(flat) <= set(range(N))
    assert first != second  # reshuffled per epoch
    assert first != [list(range(j * B, (j + 1) * B)) for j in range(6)]  # shuffled at all


@pytest.mark.parametrize("kind", KINDS)
def test_batches_are_a_pure_function_of_seed_and_step(kind):
    data = make(kind)
    assert ids(data, 15) == ids(make(kind), 15)
    assert ids(data, 15, seed=1) != ids(data, 15)
    # Resume mid-epoch (step 9 of epoch 1) and across an epoch boundary: the same batches.
    for start in (9, 5, 12):
        assert ids(data, 15 - start, start_step=start) == ids(data, 15)[start:]


@pytest.mark.parametrize("kind", KINDS)
def test_shuffle_false_reads_in_order(kind):
    got = ids(make(kind, shuffle=False), 7)
    assert got[:6] == [list(range(j * B, (j + 1) * B)) for j in range(6)]
    assert got[6] == list(range(B))  # epoch 1 starts again


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("processes", [2, 4, 8])
def test_processes_split_the_global_batch_without_overlap(kind, processes):
    data = make(kind)
    whole = data.batches(B, seed=3)
    parts = [
        data.batches(B, seed=3, process_index=p, process_count=processes) for p in range(processes)
    ]
    for _ in range(14):  # past two epoch boundaries
        batch = next(whole)
        shares = [next(it) for it in parts]
        assert all(len(s["id"]) == B // processes for s in shares)
        for key in ("id", "x"):
            np.testing.assert_array_equal(np.concatenate([s[key] for s in shares]), batch[key])


@pytest.mark.parametrize("kind", KINDS)
def test_num_epochs_ends_the_data(kind):
    data = make(kind, num_epochs=2)
    assert data.num_data_steps(B) == 12
    assert len(list(data.batches(B, seed=0))) == 12
    assert len(list(data.batches(B, seed=0, start_step=10))) == 2
    assert make(kind).num_data_steps(B) is None


@pytest.mark.parametrize("kind", KINDS)
def test_fewer_examples_than_a_batch_is_a_config_error(kind):
    with pytest.raises(ConfigError, match="has 50 examples, fewer than one global batch of 64"):
        make(kind, name="my data").batches(64, seed=0)


def test_bad_splits_raise_at_the_call():
    data = make("arrays")
    with pytest.raises(ValueError, match="not divisible"):
        data.batches(B, seed=0, process_count=3)
    with pytest.raises(ValueError, match="process_index 2"):
        data.batches(B, seed=0, process_index=2, process_count=2)


def test_grain_uses_the_datasets_own_shuffle_per_epoch():
    """Epoch e's order is Grain's: ``dataset.shuffle(shuffle_seed(seed))`` at ``e * n + i``."""
    dataset = grain.MapDataset.source(Source())
    expected = dataset.shuffle(seed=shuffle_seed(5)).repeat()
    got = ids(GrainData(dataset), 8, seed=5)
    assert got[0] == [int(expected[i]["id"]) for i in range(B)]
    assert got[7] == [int(expected[N + B + i]["id"]) for i in range(B)]  # epoch 1, batch 1


def test_grain_orders_of_neighbouring_seeds_are_unrelated():
    """Run seed 0's second epoch is not run seed 1's first (Grain shuffles from seed + epoch)."""
    dataset = grain.MapDataset.source(Source())
    assert (
        ids(GrainData(dataset), N // B + 1, seed=0)[N // B] != ids(GrainData(dataset), 1, seed=1)[0]
    )


def test_grain_maps_run_per_element():
    dataset = grain.MapDataset.source(Source()).map(lambda e: {**e, "x": e["x"] * 2})
    batch = next(GrainData(dataset, shuffle=False).batches(B, seed=0))
    np.testing.assert_array_equal(batch["x"][:, 0], 2 * np.arange(B))


def test_grain_refuses_what_it_cannot_read_by_position():
    source = grain.MapDataset.source(Source())
    with pytest.raises(ValueError, match="infinite"):
        GrainData(source.repeat())
    with pytest.raises(TypeError, match="dicts of arrays"):
        GrainData(grain.MapDataset.range(10))
    with pytest.raises(TypeError, match="random-access source"):
        GrainData(iter(range(3)))
    with pytest.raises(ValueError, match="element 0 is missing"):
        GrainData(source.filter(lambda e: e["id"] % 2))
    with pytest.raises(ValueError, match="can not follow `MapDataset.filter`"):
        GrainData(source.filter(lambda e: e["id"] % 2 == 0))


def test_token_windows_overlap_by_one_token():
    data = TokenWindows(np.arange(41), seq_len=8, shuffle=False)
    assert data.num_examples == 5
    batch = next(data.batches(2, seed=0, start_step=1))
    np.testing.assert_array_equal(batch["inputs"], [np.arange(16, 24), np.arange(24, 32)])
    np.testing.assert_array_equal(batch["targets"], batch["inputs"] + 1)
    assert batch["inputs"].dtype == np.int32
