"""The compiled plain step of the trainer, read from its optimized HLO (XLA:CPU): what the
default step must not carry. Structure only, never time."""

import re

import jax
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh

from benchmarks.hlo import _entry_body, _source_stacks
from trainers.core.trainer import Trainer
from trainers.tasks.mlp import MLPTask
from xshard import cross_shard

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's program")

BATCH = 32


@pytest.fixture(scope="module")
def plain_step():
    """The entry computation of the CLI's default plain step on mlp, and its stacks."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",), axis_types=(AxisType.Auto,))
    task = MLPTask()
    tx = cross_shard(optax.adam(1e-3), "mean", axis_name="data", skip_nonfinite=True)
    trainer = Trainer(task, tx, mesh, global_batch_size=BATCH)
    batch = next(iter(task.batches(BATCH, seed=0)))
    state = trainer.init(trainer.init_params(batch))
    trainer.step(state, batch, with_stats=False)
    text = trainer.executable_for(0).as_text()
    size = sum(x.size for x in jax.tree.leaves(state.params))
    return _entry_body(text), _source_stacks(text), size


def test_the_donated_state_is_not_copied(plain_step):
    entry, _, _ = plain_step
    # Copying a parameter of the entry computation keeps the old value of a donated buffer
    # alive: the guard's counters read after its branch did that, every step. (Where XLA
    # places the copy of a scalar that the step returns twice, such as Adam's count, is its
    # own choice: scalars are not checked. The statistics and the guard's counters are
    # vectors, `CrossShardState.stats`.)
    names = dict(re.findall(r"%(param[.\d]*) = .*? parameter\(.*?op_name=\"([^\"]*)\"", entry))
    shapes = dict(re.findall(r"%(param[.\d]*) = \w+\[([\d,]*)\]", entry))
    copied = re.findall(r"copy\(%(param[.\d]*)\)", entry)
    assert len(names) == len(shapes) > 20  # the state's leaves and the batch were read
    assert any(n.startswith("state.opt_state.stats") for n in names.values())
    assert [names[p] for p in copied if shapes[p]] == []


def test_the_gradient_is_sliced_out_of_the_packed_sum_inside_the_guards_branch(plain_step):
    entry, stack, size = plain_step
    (reduced,) = re.findall(r"= \(?f32\[(\d+)\][^=]*? all-reduce\(", entry)
    assert int(reduced) == size  # one packed buffer of every parameter
    frames = [int(f) for f in re.findall(r"stack_frame_id=(\d+)", entry)]
    functions = {fn for f in frames for _, fn in stack(f)}
    # Slicing the leaves out before the branch: a kernel per leaf outside it, and the leaves
    # as the branch's operands; inside, the slices fuse with the inner update.
    assert "psum_tree.<locals>.unpack" not in functions
    assert "CrossShardUpdate.apply" in functions  # the stacks are read at all
