"""`trainers.cluster.same_config`: what is compared between processes and how differences read.

The comparison itself, across real processes, is tested end to end in
tests/trainers/cluster/test_multihost_cli.py (``given different configs``).
"""

from __future__ import annotations

from trainers.cluster.multihost import Cluster
from trainers.cluster.same_config import _encode, check_same_config, differences_message, digest
from trainers.config.plain import PER_PROCESS, flat_config


def entries(flat: dict) -> dict:
    from xshard.config.nodes import shown

    return {k: [digest(_encode(v)), shown(v, 60)] for k, v in flat.items()}


def test_flat_config_is_resolved_and_leaves_out_the_per_process_keys(compose_config):
    flat = flat_config(
        compose_config(
            "trainer.steps=7",
            "distributed.process_id=1",
            "distributed.num_processes=2",
            "trainer.resume_from=/somewhere",
        )
    )
    assert flat["trainer.steps"] == 7
    assert flat["schedule.decay_steps"] == 7  # ${trainer.steps}, resolved
    assert flat["trainer.stop_signals"] == ["SIGTERM", "SIGINT", "SIGUSR2"]  # lists are values
    assert flat["distributed.num_processes"] == 2
    for key in flat:
        assert not any(key == k or key.startswith(f"{k}.") for k in PER_PROCESS), key
    assert flat_config(compose_config("distributed.process_id=0", "trainer.progress=true")) == (
        flat_config(compose_config("distributed.process_id=3", "trainer.progress=false"))
    )


def test_processes_of_an_elastic_group_may_advertise_their_own_hosts(compose_config):
    # A group of processes on several hosts: each manager and checkpoint server advertises
    # its own host; the rest of the elastic node is shared.
    group = ("mesh=cpu4_group", "reduction=diloco_elastic", "reduction.axes.slice.elastic.group=0")
    node = "reduction.axes.slice.elastic"
    one = flat_config(compose_config(*group, f"{node}.host=10.0.0.1"))
    assert one == flat_config(compose_config(*group, f"{node}.host=10.0.0.2"))
    assert f"{node}.timeout_s" in one and f"{node}.host" not in one
    other = flat_config(compose_config(*group, f"{node}.timeout_s=5"))
    assert other[f"{node}.timeout_s"] != one[f"{node}.timeout_s"]


def test_the_message_names_each_differing_key_and_who_has_which_value(compose_config):
    a = flat_config(compose_config("optimizer.learning_rate=0.001"))
    b = flat_config(compose_config("optimizer.learning_rate=0.002", "+extra=1"))
    message = differences_message([entries(a), entries(a), entries(b), entries(a)])
    assert "optimizer.learning_rate (0.001 on processes 0-1, 3, 0.002 on process 2)" in message
    assert "extra ((not set) on processes 0-1, 3, 1 on process 2)" in message
    assert "\n" not in message and "trainer.steps" not in message


def test_many_differing_keys_are_capped():
    first = {f"k{i}": ["a", "1"] for i in range(9)}
    second = {f"k{i}": ["b", "2"] for i in range(9)}
    message = differences_message([first, second])
    assert message.count(" on process 0") == 5 and "and 4 more keys" in message


def test_one_process_compares_nothing(compose_config):
    check_same_config(Cluster(), flat_config(compose_config()))
