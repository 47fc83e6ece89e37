"""The pieces of a multi-process run that one process can test: the stop vote folded into
the step, the start-up agreement of a one-process cluster, per-process logs, the device split
and the configurable stop signals. The multi-process behaviour is in test_multihost_cli.py."""

import logging
import signal

import numpy as np
import optax
import pytest

import xshard
from trainers.cluster.multihost import Cluster
from trainers.cluster.preemption import stop_signals
from trainers.cluster.run_dirs import separate_log
from trainers.config import TrainerOptions
from trainers.core.stop_vote import STOP_VOTE_KEY, StopVote
from trainers.core.trainer import Hook, Trainer
from trainers.exits import PeerError
from trainers.tasks.mlp import MLPTask
from xshard.errors import ConfigError
from xshard.mesh.build import build_mesh, configure_devices
from xshard.mesh.spec import MeshConfigError

pytestmark = pytest.mark.multiprocess

BATCH = 32


class Recorder(Hook):
    def __init__(self, stop_from: int | None = None, via_hook: bool = False):
        self.metrics, self.saved, self.ended = {}, [], None
        self.stop_from, self.via_hook, self.dispatched = stop_from, via_hook, 0
        self.agreed = None

    def on_stop_agreed(self, vote):
        self.agreed = (vote, sorted(self.metrics))  # told once, before the run's last step

    def on_step(self, step, metrics):
        self.metrics[step] = dict(metrics)

    def wants_state(self, step):
        return False

    def on_state(self, step, state):
        self.saved.append(step)

    def wants_stop(self):
        return self.via_hook and self._due()

    def on_end(self, step, state, reason):
        self.ended = (step, reason)

    def _due(self) -> bool:
        # Polled once per dispatched step in agreed mode: the vote of step `dispatched`.
        self.dispatched += 1
        return self.stop_from is not None and self.dispatched >= self.stop_from


def fit(agree: bool, *, stop_from: int | None, via_hook: bool = False, steps: int = 10):
    task = MLPTask()
    mesh = build_mesh({"name": "cpu8", "num_devices": 8})
    tx = xshard.cross_shard(optax.sgd(1e-2), "mean")
    trainer = Trainer(task, tx, mesh, global_batch_size=BATCH, agree_stop=agree)
    state = trainer.init(trainer.init_params(next(iter(task.batches(BATCH, seed=0)))))
    rec = Recorder(stop_from, via_hook)
    should_stop = (lambda: False) if via_hook else rec._due
    result = trainer.fit(
        state,
        task.batches(BATCH, seed=0),
        num_steps=steps,
        hooks=[rec],
        should_stop=should_stop,
    )
    return result, rec, result.reason


def test_an_agreed_stop_voted_at_step_k_ends_the_run_after_step_k_plus_1():
    result, rec, reason = fit(True, stop_from=3)
    assert reason == "stopped" and rec.ended == (4, "stopped") and rec.saved == [4]
    assert result.agreed_stop == StopVote(step=3, process=0, signal=True, hook=False)
    assert rec.agreed == (result.agreed_stop, [1, 2, 3])  # the hooks heard it at step 3's metrics
    assert sorted(rec.metrics) == [1, 2, 3, 4]
    assert all(STOP_VOTE_KEY not in m for m in rec.metrics.values())  # hidden from hooks


def test_a_hook_vote_is_agreed_too_and_says_so():
    result, rec, reason = fit(True, stop_from=2, via_hook=True)
    assert reason == "stopped" and rec.ended == (3, "stopped")
    assert result.agreed_stop == StopVote(step=2, process=0, signal=False, hook=True)


def test_without_agreement_a_stop_ends_the_run_after_the_current_step():
    result, rec, reason = fit(False, stop_from=3)
    assert reason == "stopped" and rec.ended[1] == "stopped" and result.agreed_stop is None
    assert rec.agreed is None


def test_no_vote_trains_every_step_and_the_same_numbers():
    _, voted, _ = fit(True, stop_from=None)
    _, plain, _ = fit(False, stop_from=None)
    assert voted.ended == (10, "done")
    np.testing.assert_array_equal(
        [voted.metrics[s]["train/loss"] for s in range(1, 11)],
        [plain.metrics[s]["train/loss"] for s in range(1, 11)],
    )


@pytest.mark.parametrize("process", [0, 1, 7, 1000])
def test_votes_encode_the_process_and_the_reasons(process):
    for sig, hook in [(True, False), (False, True), (True, True)]:
        code = StopVote.encode(process, sig, hook)
        assert StopVote.decode(5, float(code)) == StopVote(5, process, sig, hook)
    assert StopVote.encode(process, False, False) == 0 and StopVote.decode(5, 0.0) is None


def test_a_cluster_of_one_gathers_its_own_values_and_raises_its_own_errors():
    one = Cluster()
    assert one.all_gather("x", {"a": 1}) == [{"a": 1}] and one.broadcast("y", 3) == 3
    with pytest.raises(ValueError, match="boom"), one.agreed("z"):
        raise ValueError("boom")
    with pytest.raises(PeerError, match=r"process 1 \(h:2\) failed at loading: it broke"):
        Cluster(hosts=["h:1", "h:2"], count=2).raise_for([None, "it broke"], "loading")


def test_a_process_other_than_0_logs_to_its_own_file(tmp_path):
    root = logging.getLogger()
    shared = logging.FileHandler(tmp_path / "train.log")
    shared.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
    root.addHandler(shared)
    try:
        separate_log(1)
        logging.getLogger("t").warning("from process 1")
        for h in root.handlers:
            h.flush()
    finally:
        for h in list(root.handlers):
            if isinstance(h, logging.FileHandler) and str(tmp_path) in h.baseFilename:
                root.removeHandler(h)
                h.close()
    assert "from process 1" not in (tmp_path / "train.log").read_text()
    assert "[t] from process 1" in (tmp_path / "train.process-1.log").read_text()


def test_simulated_devices_must_split_evenly_over_the_processes():
    with pytest.raises(MeshConfigError, match="do not split evenly over 3 processes"):
        configure_devices({"name": "cpu8", "num_devices": 8, "simulate_on_cpu": True}, 3)


def test_stop_signals_come_from_the_config():
    options = TrainerOptions(stop_signals=["SIGTERM", "SIGUSR2"])
    assert stop_signals(options.stop_signals) == (signal.SIGTERM, signal.SIGUSR2)
    with pytest.raises(ConfigError, match=r"trainer.stop_signals=\['SIGKILL'\]: expected a list"):
        TrainerOptions(stop_signals=["SIGKILL"])


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("heartbeat_timeout_s", 0, "distributed.heartbeat_timeout_s=0.0: expected seconds"),
        ("initialization_timeout_s", "soon", "distributed.initialization_timeout_s"),
    ],
)
def test_bad_distributed_timeouts_name_the_key(key, value, message):
    from trainers.config import DistributedOptions
    from xshard.config import read_node

    with pytest.raises(ConfigError, match=message):
        read_node(DistributedOptions, {key: value}, "distributed")
