"""A periodic axis across processes (slow, multiprocess): 2 processes x 4 CPU devices over gloo
with mesh=cpu2x4_slices, each process holding one slice (one replica) of reduction=diloco.
After every sync both processes hold the same outer params, bitwise, and each restarted its
replica from them."""

from __future__ import annotations

import numpy as np
import pytest

from tests.cli import scalars
from tests.multihost_cli import run

pytestmark = pytest.mark.multiprocess

EVERY, STEPS = 3, 9


@pytest.mark.slow
def test_after_every_sync_both_processes_hold_the_same_outer_params(tmp_path):
    dumps = tmp_path / "dumps"
    run(
        tmp_path / "run",
        "mesh=cpu2x4_slices",  # after SMALL's mesh=cpu8: this one wins
        "trainer.batch_size=16",
        "reduction=diloco",
        f"reduction.axes.slice.every_steps={EVERY}",
        f"trainer.steps={STEPS}",
        "checkpoint.enabled=false",
        "+allowed_targets=[tests.]",
        f"trainer.hooks=[{{_target_:tests.multihost_hooks.DumpOuter,dir:'{dumps}',every:{EVERY}}}]",
        tmp=tmp_path,
        name="diloco",
    )
    assert sorted(scalars(tmp_path / "run" / "tb", "sync/slice/replica_drift")) == [3, 6, 9]
    before = None
    for step in range(EVERY, STEPS + 1, EVERY):
        p0, p1 = (np.load(dumps / f"step{step}.process{i}.npz") for i in (0, 1))
        outer = sorted(k for k in p0.files if k.startswith("outer_"))
        assert outer and sorted(p1.files) == sorted(p0.files)
        for k in outer:
            np.testing.assert_array_equal(p0[k], p1[k], err_msg=f"step {step} {k}")
            j = k.split("_")[1]
            for p in (p0, p1):  # each process's replica restarted from the outer params
                np.testing.assert_array_equal(p[f"replica_{j}"][0], p[k])
        if before is not None:  # the outer params moved at this sync
            assert not np.array_equal(before, p0["outer_0"])
        before = p0["outer_0"]
