"""Joining a multi-process run: ``jax.distributed.initialize`` waited for in bounded time.

`init_distributed` runs JAX's join in a thread and waits at most
``distributed.initialization_timeout_s`` for it, so that a process that cannot reach the
coordinator, or a cluster that does not form, fails with one line naming
``distributed.coordinator_address`` (exit status 2) before JAX's own deadline would abort the
process with a C++ stack trace. A join abandoned that way is still running inside JAX:
`abandoned` tells `trainers.cluster.multihost.exit_process` to end the process at once.

A launch by hand (coordinator_address, num_processes and process_id all given) first answers
process 0's roll call (`trainers.cluster.roll_call`), within the same wait: a process_id given
twice or a num_processes that differs fails every process at once with one line naming the key,
where JAX would abort processes in C++ or let them wait for the whole timeout.
"""

from __future__ import annotations

import atexit
import threading
import time
from typing import TYPE_CHECKING, Any

from trainers.cluster.leaving import EXIT_GRACE_S, flush_and_exit
from trainers.cluster.roll_call import PROBE_EVERY_S, CoordinatorProbe, answer_roll
from xshard.config.nodes import shown
from xshard.errors import ConfigError

if TYPE_CHECKING:
    from trainers.config import DistributedOptions

#: Seconds JAX's own join deadline lies beyond ``distributed.initialization_timeout_s``: when
#: it passes, JAX ends the process (SIGABRT and a C++ stack trace), so xshard's wait, which
#: ends with one line naming the key, must end first (`init_distributed`).
JAX_JOIN_MARGIN_S = 30

# Process state: a JAX join left running in its thread stays in the process until it ends, so
# any later exit (`trainers.cluster.multihost.exit_process`) must not wait for it.
_abandoned = False


def abandoned() -> bool:
    """Whether a join timed out while JAX's join still runs (`exit_process` exits at once)."""
    return _abandoned


def detected_cluster() -> str:
    """The cluster JAX's auto-detection would use here ("slurm", "gcetpu", ...), or "none"."""
    from jax._src import clusters

    for env in clusters.ClusterEnv._cluster_types:
        if not env.opt_in_only_method and env.is_env_present():
            return env.name or env.__name__
    return "none (set distributed.coordinator_address, num_processes and process_id)"


def jax_heartbeat_timeout_s(heartbeat_timeout_s: float) -> int:
    """JAX's own heartbeat timeout: a backstop well after xshard's watchdog has reported."""
    return int(2 * heartbeat_timeout_s + 5)


def init_distributed(opts: DistributedOptions) -> None:
    """``jax.distributed.initialize`` for multi-process runs (``distributed.enabled=true``).

    One process per host (or per accelerator, as SLURM's detection does); on TPU pods and
    SLURM the arguments can stay null (JAX detects them). ``distributed.cpu_collectives=gloo``
    joins CPU-only processes, as the tests do.

    The join runs in a thread, and this process waits for it at most
    ``distributed.initialization_timeout_s`` (process 0, which hosts the coordinator,
    `EXIT_GRACE_S` longer, so that the processes connected to it fail first). JAX's own join
    deadline lies `JAX_JOIN_MARGIN_S` beyond: when it passes, JAX ends the process itself
    (SIGABRT, exit 134, a C++ stack trace). Meanwhile a process other than 0 tries to reach the
    coordinator's port, so that the error can say whether anything answered there. Launched by
    hand, the processes first answer process 0's roll call on that port, in the same wait
    (`_roll_call`).

    Raises:
      ConfigError: if JAX cannot form the cluster from these settings (e.g. nothing to
        detect it from), or not every process joined within the initialisation timeout:
        naming ``distributed.coordinator_address`` and its value. A join still running in
        JAX is abandoned: `exit_process` then ends the process at once. At the roll call: a
        ``distributed.process_id`` given twice, a ``distributed.num_processes`` that differs.
    """
    if not opts.enabled:
        return
    import jax

    if opts.cpu_collectives:
        jax.config.update("jax_cpu_collectives_implementation", opts.cpu_collectives)
    # JAX's preemption service would take SIGTERM over (a C++ handler replacing
    # `StopOnSignal`'s) and agree on SIGTERM only; the trainer agrees on every stop signal
    # within its steps instead (`trainers.core.trainer.StopVote`).
    jax.config.update("jax_enable_preemption_service", False)
    start, probe = time.monotonic(), CoordinatorProbe()
    _roll_call(opts, start, probe)
    error = _join(
        opts,
        start,
        probe,
        coordinator_address=opts.coordinator_address,
        num_processes=opts.num_processes,
        process_id=opts.process_id,
        initialization_timeout=int(opts.initialization_timeout_s) + JAX_JOIN_MARGIN_S,
        heartbeat_timeout_seconds=jax_heartbeat_timeout_s(opts.heartbeat_timeout_s),
    )
    if error is None:
        return
    if isinstance(error, ValueError | TypeError):  # "coordinator_address should be defined."
        raise ConfigError(
            f"distributed.enabled=true: JAX could not set up the cluster ({error}). Outside a "
            "cluster JAX detects (TPU pod, SLURM), set distributed.coordinator_address, "
            "distributed.num_processes and distributed.process_id."
        ) from error
    # jax.errors.JaxRuntimeError: a peer or the coordinator missing (when JAX raises it
    # rather than ending the process)
    raise ConfigError(
        f"distributed.enabled=true: the cluster did not form within "
        f"distributed.initialization_timeout_s={opts.initialization_timeout_s:g} s "
        f"({first_line(error)}). Start every process (distributed.num_processes of them) "
        "with the same distributed.coordinator_address, reachable from all."
    ) from error


def _wait_s(opts: DistributedOptions, pid: int | None) -> float:
    """How long process `pid` waits for the cluster to form (see `init_distributed`)."""
    return opts.initialization_timeout_s + (EXIT_GRACE_S if pid in (0, None) else 0.0)


def _roll_call(opts: DistributedOptions, start: float, probe: CoordinatorProbe) -> None:
    """Answers process 0's roll call (`trainers.cluster.roll_call`) before JAX's join, when
    the launch is by hand (coordinator_address, num_processes and process_id all given).

    Raises:
      ConfigError: for a launch mistake (a process_id given twice, num_processes differing),
        or if the roll call did not complete within the wait (`_join_timeout_message`).
    """
    from jax._src import distributed

    explicit = (opts.coordinator_address, opts.num_processes, opts.process_id)
    if None in explicit or distributed.global_state.client is not None:
        return  # a cluster JAX detects numbers its processes; a second join: JAX refuses it
    if not answer_roll(opts, start + _wait_s(opts, opts.process_id), probe):
        raise ConfigError(
            _join_timeout_message(
                opts, opts.process_id, opts.num_processes, opts.coordinator_address, probe
            )
        )


def _join(
    opts: DistributedOptions, start: float, probe: CoordinatorProbe, **kwargs: Any
) -> BaseException | None:
    """``jax.distributed.initialize(**kwargs)`` in a thread, waited for in bounded time
    (from `start`, when this process began to join).

    Returns:
      The error ``initialize`` raised, or None once it returned.

    Raises:
      ConfigError: if it is still running after the wait (see `init_distributed`).
    """
    global _abandoned
    import jax
    from jax._src import distributed

    outcome: list[BaseException | None] = []

    def join() -> None:
        try:
            jax.distributed.initialize(**kwargs)
        except BaseException as e:  # handed to the main thread
            outcome.append(e)
        else:
            outcome.append(None)

    thread = threading.Thread(target=join, name="xshard-join", daemon=True)
    thread.start()
    state = distributed.global_state
    while True:
        # Explicit values, else the ones JAX detected (set before it creates its client).
        detected = state.client is not None
        pid = (
            opts.process_id
            if opts.process_id is not None
            else (state.process_id if detected else None)
        )
        address = opts.coordinator_address or (state.coordinator_address if detected else None)
        left = start + _wait_s(opts, pid) - time.monotonic()
        if left <= 0:
            break
        if pid not in (0, None) and address:
            probe.poke(address)
        thread.join(min(PROBE_EVERY_S, left))
        if not thread.is_alive():
            return outcome[0] if outcome else None
    _abandoned = True
    # JAX's exit-time shutdown would wait on the join (or end the process with its own abort):
    # a process that does not end through `exit_process` (a multirun's job) ends here.
    from trainers.exits import EXIT_CONFIG_ERROR

    atexit.register(flush_and_exit, EXIT_CONFIG_ERROR)
    count = opts.num_processes or (state.num_processes if detected else None)
    raise ConfigError(_join_timeout_message(opts, pid, count, address, probe))


def _join_timeout_message(
    opts: DistributedOptions,
    pid: int | None,
    count: int | None,
    address: str | None,
    probe: CoordinatorProbe,
) -> str:
    """The one line of a join that did not complete in time (`_join`)."""
    within = f"within distributed.initialization_timeout_s={opts.initialization_timeout_s:g} s"
    if opts.num_processes:
        processes = f"all distributed.num_processes={count} processes"
    else:
        processes = f"all {count} processes" if count else "all the processes"
    if address is None or pid is None:
        return (
            f"distributed.enabled=true: the cluster did not form {within}: JAX was still "
            f"detecting it ({detected_cluster()}). Set distributed.coordinator_address, "
            "distributed.num_processes and distributed.process_id outside a cluster JAX detects."
        )
    key = (
        f"distributed.coordinator_address={shown(address)}"
        if opts.coordinator_address
        else f"the coordinator JAX detected ({address}; distributed.coordinator_address=null)"
    )
    if pid != 0 and not probe.answered:
        return (
            f"{key}: nothing answered there {within} ({probe.error or 'no answer'}): process "
            f"{pid} could not reach process 0's coordinator. It must be process 0's host:port, "
            "the same on every process and reachable from this host: check it, and that "
            "process 0 is running."
        )
    if pid != 0:
        return (
            f"{key}: the cluster did not form {within}: process {pid} reached that address, but "
            f"not {processes} joined there. Start every process with the same "
            "distributed.coordinator_address (process 0's host:port) and num_processes, and a "
            "distinct distributed.process_id."
        )
    return (
        f"{key}: the cluster did not form {within}: not {processes} joined "
        "process 0's coordinator there. Start every process with this "
        "distributed.coordinator_address (process 0's host:port, reachable from every host) "
        "and a distinct distributed.process_id."
    )


def first_line(error: BaseException) -> str:
    """The first line of `error`'s message, at most 300 characters."""
    text = (str(error).strip().splitlines() or [""])[0]
    return text[:300]
