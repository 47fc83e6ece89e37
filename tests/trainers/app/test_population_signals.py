"""`trainers.app.population_run.run_population` hears a stop signal while its trials run,
whichever thread the kernel delivered it to (docs/sweeps.md: a population stopped by a
signal)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from omegaconf import OmegaConf

from trainers.app.population_run import run_population

RUNS_S = 3.0  # each job's run after the signal: long against the handler's expected delay


def test_a_signal_that_interrupts_another_thread_is_handled_while_the_trials_run(caplog):
    config = OmegaConf.create({"trainer": {"stop_signals": ["SIGTERM"]}})
    go = threading.Event()
    # A thread started before the main thread blocks SIGTERM sends it, once the trials run;
    # the trials' threads inherit the main thread's mask, so the kernel delivers the signal
    # to the sender's thread (as it may deliver any process-directed signal to another
    # thread than the main one), and Python runs the handler in the main thread.
    # (0.5 s after the first trial started: the main thread waits for the trials by then.)
    send = lambda: go.wait() and (time.sleep(0.5), os.kill(os.getpid(), signal.SIGTERM))
    sender = threading.Thread(target=send)
    sender.start()
    sent: list[float] = []

    def run_job(cfg, first, before_task):
        if first:
            sent.append(time.time())
            go.set()
        time.sleep(RUNS_S)
        return "done"

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        with caplog.at_level(logging.WARNING, "trainers.cluster.preemption"):
            assert run_population([config, config], run_job) == ["done", "done"]
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        go.set()
        sender.join()
    [heard] = [r for r in caplog.records if r.getMessage().startswith("Received SIGTERM")]
    assert heard.created - sent[0] < RUNS_S / 2  # while the trials ran, not after them
