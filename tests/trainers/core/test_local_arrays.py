"""A process's parts of its arrays and the arrays rebuilt from them
(`trainers.core.periodic.local_arrays`), on the 8 simulated devices of one process: every part
is addressable here, so a round trip must give back the same arrays, placed as asked."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trainers.core.periodic.local_arrays import (
    from_local_parts,
    global_vector,
    layout,
    local_parts,
    local_vector,
    padded_size,
    vector_sharding,
)


def mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("slice", "data"))


def test_parts_of_sharded_and_replicated_arrays_rebuild_them_bitwise():
    m = mesh()
    x = np.arange(8 * 3, dtype=np.float32).reshape(8, 3) / 7
    shardings = {
        "rows": NamedSharding(m, P("data")),  # each row block twice: over `slice`
        "both": NamedSharding(m, P(("slice", "data"))),
        "replicated": NamedSharding(m, P()),
    }
    tree = {k: jax.device_put(x, s) for k, s in shardings.items()}
    parts = local_parts(tree)
    assert len(parts["rows"].parts) == 4 and len(parts["both"].parts) == 8
    assert len(parts["replicated"].parts) == 1  # each distinct index once
    rebuilt = from_local_parts(parts, shardings)
    for k, s in shardings.items():
        np.testing.assert_array_equal(np.asarray(rebuilt[k]), x)
        assert rebuilt[k].sharding == s
    assert layout(parts) == layout(rebuilt) == layout(local_parts(rebuilt))
    assert layout(parts) != layout({**tree, "rows": tree["both"]})


def test_a_vector_split_over_every_device_comes_back_from_its_local_piece():
    m = mesh()
    size = padded_size(21, m)
    assert size == 24
    v = jax.device_put(np.arange(size, dtype=np.float32), vector_sharding(m))
    local = local_vector(v)
    np.testing.assert_array_equal(local, np.arange(size, dtype=np.float32))
    back = global_vector(local * 2, m, size)
    np.testing.assert_array_equal(np.asarray(back), 2 * np.arange(size, dtype=np.float32))
    assert back.sharding == vector_sharding(m)
