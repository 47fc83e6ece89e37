"""Elastic replica groups (reduction.axes.<axis>.elastic): the keys' one-line errors, the
trust rule on the lighthouse, and a run without the optional extra; a round's wait left on a
stop signal, and the config swap of groups of several processes through a real TCPStore
(torch imported in this module only). Cheap: no process, no torchft server (the end-to-end
runs are in test_elastic_groups_cli.py)."""

from __future__ import annotations

import os
import sys

import pytest
from omegaconf import OmegaConf

from trainers.app.trust import is_location
from xshard.config.axes import AxisReductionConf, check_axes
from xshard.config.elastic_groups import ElasticConf
from xshard.errors import ConfigError

DILOCO = {"_target_": "optax.sgd", "learning_rate": 0.7, "momentum": 0.9, "nesterov": True}


def axis(elastic: dict | None, **rule) -> dict:
    """A periodic ``slice`` node with `elastic`, read as the config reads it."""
    node = OmegaConf.structured(AxisReductionConf)
    merged = OmegaConf.merge(
        node, {"every_steps": 8, "outer_optimizer": DILOCO, "elastic": elastic, **rule}
    )
    return {"slice": OmegaConf.to_object(merged)}


@pytest.mark.parametrize(
    "elastic, rule, message",
    [
        ({}, {}, r"^reduction\.axes\.slice\.elastic\.group=None: expected this replica group"),
        ({"group": -1}, {}, r"^reduction\.axes\.slice\.elastic\.group=-1: expected"),
        ({"group": 0, "min_groups": 0}, {}, r"\.elastic\.min_groups=0: expected the fewest"),
        ({"group": 0, "timeout_s": 0}, {}, r"\.elastic\.timeout_s=0: expected"),
        ({"group": 0, "lighthouse": "nohost"}, {}, r"\.elastic\.lighthouse='nohost': expected"),
        ({"group": 0, "lighthouse": "h:70000"}, {}, r"\.lighthouse='h:70000': expected .* 65535"),
        ({"group": 0}, {"fragments": 2}, r"^reduction\.axes\.slice\.fragments=2: not supported"),
        ({"group": 0}, {"comm_dtype": "int8"}, r"\.comm_dtype='int8': not supported with"),
        ({"group": 0}, {"sync_delay": 1}, r"\.sync_delay=1: not supported with .*elastic"),
        ({"group": 0, "standby": "yes"}, {}, r"\.elastic\.standby='yes': expected true"),
        ({"group": 0}, {"outer_optimizer": None, "every_steps": 1}, r"is a periodic one"),
    ],
)
def test_a_bad_elastic_key_is_one_line_naming_it(elastic, rule, message):
    with pytest.raises(ConfigError, match=message) as caught:
        check_axes(axis(elastic, **rule))
    assert "\n" not in str(caught.value)


def test_a_good_node_passes_and_null_is_off():
    check_axes(axis({"group": 3, "lighthouse": "10.0.0.2:29510", "min_groups": 2}))
    check_axes(axis(None))
    assert ElasticConf().group is None  # no default id: two groups would claim one


def test_a_copied_config_may_not_choose_the_lighthouse_or_the_host():
    """Locations, as paths.* are: only the primary config or the command line sets them."""
    assert is_location("reduction.axes.slice.elastic.lighthouse")
    assert is_location("reduction.axes.dcn.elastic.host")
    assert is_location("reduction.axes.slice.elastic")  # the node that holds them
    assert not is_location("reduction.axes.slice.elastic.group")
    assert not is_location("reduction")  # sweeping reduction=mean,sum stays allowed
    assert not is_location("reduction.axes.slice.every_steps")


def test_without_the_extra_an_elastic_axis_is_one_line_naming_the_key(monkeypatch):
    from trainers.app.elastic_group import require_extra

    monkeypatch.setitem(sys.modules, "torch", None)  # what Python does for a missing module
    with pytest.raises(ConfigError) as caught:
        require_extra("reduction.axes.slice.elastic")
    line = str(caught.value)
    assert line.startswith("reduction.axes.slice.elastic: needs torch, not installed")
    assert "pip install 'xshard[elastic]'" in line and "\n" not in line


@pytest.mark.slow  # a fresh interpreter importing the app: ~5-10 s on loaded cores
def test_without_an_elastic_axis_nothing_imports_torch():
    """Installs without the extra are unchanged: the app, the trainer, the library and
    ``--help``'s text import no torch (a fresh interpreter: this one may hold it)."""
    import subprocess

    code = (
        "import sys, xshard, trainers.train, trainers.app.training, trainers.app.elastic_group;"
        'from trainers.app.help import help_text; print("xshard[elastic]" in help_text());'
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torchft')))"
    )
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert found.stdout.split() == ["True", "[]"]  # --help names the extra


def test_the_supervisor_gives_each_group_its_id_the_lighthouse_and_its_own_run_dir(tmp_path):
    from trainers.cluster.elastic_launch import GroupLaunch, LighthouseOptions

    launch = GroupLaunch(2, tmp_path, ("task=mlp", "reduction=diloco_elastic"), axis="dcn")
    command = launch.command(1, LighthouseOptions(bind="127.0.0.1:1234", min_groups=2))
    assert command[1:] == [
        "-m",
        "trainers.train",
        "task=mlp",
        "reduction=diloco_elastic",
        "reduction.axes.dcn.elastic.group=1",
        "reduction.axes.dcn.elastic.lighthouse=127.0.0.1:1234",
        "reduction.axes.dcn.elastic.min_groups=2",
        f"hydra.run.dir={tmp_path / 'group_1'}",
    ]


@pytest.mark.parametrize("flag", ["--groups", "--processes"])
def test_a_count_below_one_is_refused_naming_the_flag(flag, tmp_path, capsys):
    from trainers.elastic import main

    counts = {"--groups": "2", "--processes": "1", flag: "0"}
    argv = ["run", "--out", str(tmp_path), *[x for kv in counts.items() for x in kv]]
    with pytest.raises(SystemExit) as caught:
        main([*argv, "--", "task=mlp"])
    assert caught.value.code == 2
    assert f"argument {flag}: expected a whole number >= 1, got '0'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing started, nothing written


def test_standby_and_several_processes_are_refused_together(tmp_path, capsys):
    from trainers.elastic import main

    argv = ["run", "--out", str(tmp_path), "--groups", "2", "--processes", "2", "--standby"]
    assert main([*argv, "--", "task=mlp"]) == 2
    assert "--standby with --processes 2: a standby is one process" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_a_standby_whose_stdin_is_not_its_supervisors_pipe_is_one_line_naming_the_flag():
    from trainers.cluster.standby import check_standby_stdin

    key = "reduction.axes.slice.elastic"
    read, write = os.pipe()
    with os.fdopen(read) as pipe:
        check_standby_stdin(key, pipe)  # the supervisor's pipe: accepted
    os.close(write)
    leader, follower = os.openpty()
    with os.fdopen(follower) as terminal, pytest.raises(ConfigError) as e:
        check_standby_stdin(key, terminal)
    os.close(leader)
    line = str(e.value)
    assert line.startswith(f"{key}.standby=true: a standby takes over when its supervisor")
    assert "python -m trainers.elastic run --standby" in line and "\n" not in line


def test_a_wait_for_peers_is_left_on_a_stop_signal_and_its_own_error_comes_through():
    """`wait_unless_stopped`, what a round waits through (torchft's quorum, its collective):
    a wait that would block for good (peers that never come) is left once a real stop signal
    reached this process's `StopOnSignal`; a stop already requested does not start it; the
    wait's own error is raised in the caller, and a wait that returns returns."""
    import signal
    import threading

    from trainers.cluster.preemption import StopOnSignal
    from trainers.cluster.torchft_group import RoundLeft, wait_unless_stopped

    def fails() -> None:
        raise TimeoutError("quorum timed out")

    never = threading.Event()
    with StopOnSignal([signal.SIGUSR2]) as stop:
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR2)).start()
        with pytest.raises(RoundLeft):
            wait_unless_stopped(never.wait, stop)
        with pytest.raises(RoundLeft):
            wait_unless_stopped(fails, stop)
    with pytest.raises(TimeoutError, match="quorum timed out"):
        wait_unless_stopped(fails, lambda: False)
    wait_unless_stopped(lambda: None, lambda: False)


def test_elastic_groups_of_several_processes_all_read_before_the_config_swap_ends():
    """2 groups of 2 processes, one group at the quorum's highest step: all 4 processes read
    its store (torchft gives every rank the same one). The store's host returns only once the
    2 processes started late have read too (it counted 2 readers, one a group, before)."""
    import threading
    from datetime import timedelta

    from torch.distributed import TCPStore

    from trainers.cluster.same_config import ConfigEntry, StoreSeat, swap_configs

    host = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=60)
    entries = {"a": ConfigEntry(2, {"seed": [0, 0]}), "b": ConfigEntry(2, {"seed": [1, 1]})}
    read: list[list[ConfigEntry]] = []

    def process(me: str, rank: int) -> None:
        store = TCPStore("127.0.0.1", host.port, is_master=False, timeout=timeout)
        seat = StoreSeat(rank, stores=1)
        read.append(swap_configs(store, "q/", me, entries[me], ["a", "b"], seat, timeout))

    early = [threading.Thread(target=process, args=(g, 0)) for g in ("a", "b")]
    late = [threading.Thread(target=process, args=(g, 1)) for g in ("a", "b")]
    for thread in early:
        thread.start()
    early[0].join(timeout=0.5)  # the early ones wait for the late ones: they are not done
    assert all(thread.is_alive() for thread in early)
    for thread in late:
        thread.start()
    for thread in early + late:
        thread.join(timeout=60)
    assert host.add("q/read", 0) == 4
    assert read == [list(entries.values())] * 4
    assert StoreSeat(0, stores=2).readers(list(entries.values())) == 2  # one store a group


def test_elastic_groups_of_one_process_each_read_the_store_once():
    from trainers.cluster.same_config import ConfigEntry, StoreSeat

    assert StoreSeat(0, stores=1).readers([ConfigEntry(1, {})] * 3) == 3
