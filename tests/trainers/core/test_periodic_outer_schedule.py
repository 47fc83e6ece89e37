"""An outer optimizer's learning-rate schedule from the config (a ``_target_`` node inside
``outer_optimizer``, built under the allowlist), in the real Trainer on 8 simulated CPU devices:
it counts outer steps, one per sync of the fragment."""

import jax
import numpy as np
import pytest

from tests.trainers.core.test_periodic import make, outer_tree, run
from xshard.config.axes import AxisRule
from xshard.config.targets import allowed_prefixes
from xshard.errors import ConfigError
from xshard.optim.axis_factory import outer_optimizer

KEY = "reduction.axes.slice.outer_optimizer"
#: Averaging at the first outer step, half of it at the second, nothing from the third on.
NODE = {
    "_target_": "optax.sgd",
    "learning_rate": {
        "_target_": "optax.linear_schedule",
        "init_value": 1.0,
        "end_value": 0.0,
        "transition_steps": 2,
    },
}


@pytest.fixture(scope="module")
def task():
    from trainers.tasks.mlp import MLPTask

    return MLPTask(hidden=(32,))


@pytest.fixture(scope="module")
def mesh():
    from jax.sharding import AxisType, Mesh

    devices = np.array(jax.devices()[:8]).reshape(2, 4)
    return Mesh(devices, ("slice", "data"), axis_types=(AxisType.Auto,) * 2)


def test_outer_schedule_counts_outer_steps(task, mesh):
    import optax

    built = outer_optimizer(NODE, KEY, allowed_prefixes())({})  # with the config's values
    rule = AxisRule(every_steps=2, outer_optimizer=built)
    trainer, state = make(task, mesh, optax.sgd(0.05), periodic=("slice", rule))
    seen = {}

    def record(step, state, metrics):
        if step % 2 == 0:
            seen[step] = (outer_tree(trainer, state), metrics["sync/slice/outer_update_norm"])

    state = run(trainer, state, 8, record)
    # Rates 1.0, 0.5, 0, 0 at the syncs after steps 2, 4, 6, 8: outer steps 0, 1, 2, 3.
    assert {s: bool(norm > 0) for s, (_, norm) in seen.items()} == {
        2: True,
        4: True,
        6: False,
        8: False,
    }
    for a, b, c in zip(*(jax.tree.leaves(seen[s][0]) for s in (4, 6, 8)), strict=True):
        np.testing.assert_array_equal(a, b)  # the rate reached 0 at the third outer step
        np.testing.assert_array_equal(a, c)
    assert int(optax.tree_utils.tree_get(state.outer.opt_state, "count")) == 4


def test_outer_schedule_node_must_build_a_schedule_under_the_allowlist():
    allowed = allowed_prefixes()
    bad = {**NODE, "learning_rate": {"_target_": "os.getcwd"}}
    with pytest.raises(ConfigError, match=rf"^{KEY}.learning_rate._target_='os.getcwd' is not"):
        outer_optimizer(bad, KEY, allowed)
    bad = {**NODE, "learning_rate": {"_target_": "optax.adam", "learning_rate": 0.1}}
    with pytest.raises(ConfigError, match="did not build a schedule"):
        outer_optimizer(bad, KEY, allowed)
