"""Every way a run ends: the exit statuses, their table, and the error classes.

The CLI (``python -m trainers.train``, ``trainers.doctor``, `trainers.run`) maps each error class
here to one exit status (`EXIT_STATUSES`, which ``--help`` prints and docs/reliability.md
explains). `xshard.errors.ConfigError` is the library's: a bad config value, exit status 2.
Nothing here imports JAX, Hydra or another wing: every wing may import it.
"""

from __future__ import annotations

from typing import NamedTuple

from xshard.errors import ConfigError

#: Finished: all ``trainer.steps`` done, or the data ran out.
EXIT_OK = 0
#: A Hydra composition error, or an unexpected error (a bug: its traceback is printed).
EXIT_UNEXPECTED = 1
#: Bad config or input, an unusable or unwritable checkpoint, unwritable TensorBoard events.
EXIT_CONFIG_ERROR = 2
#: Training went non-finite and was stopped.
EXIT_NONFINITE = 3
#: Multi-process runs: another process was lost.
EXIT_PEER_LOST = 4
#: Stopped by a signal after saving (BSD EX_TEMPFAIL, "try again"): rerun to resume.
EXIT_PREEMPTED = 75


class ExitStatus(NamedTuple):
    """One row of the exit table."""

    code: int
    meaning: str


#: The exit statuses of a single run, as ``--help`` prints them (one fact, one place).
EXIT_STATUSES = (
    ExitStatus(
        EXIT_OK,
        "finished: all trainer.steps done, or the data ran out (final checkpoint saved)",
    ),
    ExitStatus(
        EXIT_UNEXPECTED,
        "a Hydra composition error (Hydra's message), or an unexpected error (traceback)",
    ),
    ExitStatus(
        EXIT_CONFIG_ERROR,
        "bad config or input (ConfigError; a config group given no option name, such as "
        "schedule=null, and a copied config file setting what it may not, too), an unusable or "
        "unwritable checkpoint (CheckpointError: disk full too; a step folder whose name is not "
        "its step), TensorBoard events or a logger's files unwritable (LoggerError)",
    ),
    ExitStatus(
        EXIT_NONFINITE,
        "training went non-finite and was stopped (NonFiniteError); checkpoints written before "
        "stay valid (the run summary names the latest one, or says there is none)",
    ),
    ExitStatus(
        EXIT_PEER_LOST,
        "multi-process runs: another process was lost (killed, crashed, unreachable, or failed "
        "on its own); the last complete checkpoint is valid: restart every process to resume. "
        "An elastic replica group: its syncs stopped committing or it fell behind its peers; "
        "restart that group alone, it rejoins from a live peer",
    ),
    ExitStatus(
        EXIT_PREEMPTED,
        "stopped by a signal of trainer.stop_signals (SIGTERM, SIGINT, SIGUSR2) after saving a "
        "checkpoint, or during start-up before any step (nothing written): rerun the command "
        "to resume. With several processes, a signal to any one stops all after the same step.",
    ),
)


class CheckpointError(Exception):
    """A checkpoint cannot be used: missing, incompatible with the run, or corrupted."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (disk full, I/O error); earlier ones are intact."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's files cannot be read, or its arrays do not match their checksums."""


class CheckpointDirInUseError(CheckpointError):
    """Another live process holds the checkpoint directory's lock."""


class ForeignCheckpointDirError(CheckpointError):
    """The checkpoint directory belongs to another run."""


class NonFiniteError(RuntimeError):
    """Training produced non-finite values it cannot skip; the run must stop."""


class LoggerError(Exception):
    """TensorBoard events or a logger's files could not be written and ``logger.on_error=stop``
    (or a logger could not start)."""


class Preempted(Exception):
    """The run stopped on a signal after saving its state; rerunning the command resumes it."""


class PeerError(ConfigError):
    """Another process could not do what this one did (start-up checks, a restore).

    A `ConfigError` (exit status 2): it is raised on the processes that did not fail
    themselves, in place of the error the failing process raises.
    """


class GroupLost(RuntimeError):
    """An elastic replica group lost its peers (its syncs stopped committing) or fell behind
    them (exit status 4): restarted, it rejoins from a live peer (docs/reductions.md)."""


class TrialFailed(RuntimeError):
    """A multirun job failed or diverged: an optimizing sweeper counts it as a failed trial."""


class UntrustedConfigError(ConfigError):
    """A composed config file sets a key that only trusted sources may set."""


class LinkOutOfRunDirError(ConfigError):
    """A path the run writes resolves, through a symbolic link, outside the run dir; or a file
    it appends to is a link (symbolic, or hard: another name that may lie outside)."""
