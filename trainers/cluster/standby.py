"""A replica group's warm standby: a process prepared ahead that takes over when its group dies.

``python -m trainers.elastic run --standby`` starts, next to each group, the same
``python -m trainers.train`` command with ``reduction.axes.<axis>.elastic.standby=true``, the
group's run dir as ``paths.output_dir`` and a scratch dir of its own as ``hydra.run.dir``
(Hydra's config dump and log file). The standby builds the task, optimizer and trainer, its
state and evaluator, and compiles its step programs (from the persistent cache), writing
nothing to the group's run dir and holding no port; then `take_over` blocks on its stdin, a
pipe from the supervisor:

- the supervisor's `go_line` (its group died): the standby's stdout and stderr continue in the
  group's log (named in the line), its log file moves to the group's run dir, and the run goes
  on as a restarted group's would: it claims the run dir, starts its torchft manager, joins
  (heals from a live peer);
- end of file (the supervisor is gone, killed too, or it stopped the standby): the process
  exits at once, status 0, having written nothing to the group's run dir.

A standby that fails before its go exits too (`exit_before_go`: one line, status 2 for a bad
config, else 1), without the run's ``result.json``, which would land in the group's run dir.

`JOINING` is the line a group logs when it joins its peers: the supervisor starts a group's
standby once the group logged it (compiled: the standby's tracing then does not slow the
group's first start). Used by `trainers.app.training` and `trainers.cluster.elastic_launch`.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import IO, NoReturn

from trainers.rundir.log_file import RunLogFile

log = logging.getLogger(__name__)

#: The first word of the supervisor's line that tells a standby to take over.
GO = "go"
#: What a group logs when it joins its peers (compiled, in its first round).
JOINING = "joining its peers"


def go_line(group_log: Path) -> bytes:
    """The line the supervisor writes to a standby's stdin: take over, logging to `group_log`."""
    return f"{GO} {group_log}\n".encode()


def check_standby_stdin(key: str, stdin: IO[str] | None = None) -> None:
    """Refuses a standby whose stdin is a terminal or closed: only its supervisor's pipe says
    when to take over.

    Raises:
      ConfigError: one line naming ``<key>.standby`` and the supervisor's flag.
    """
    from xshard.errors import ConfigError

    stream = sys.stdin if stdin is None else stdin
    if stream is None or stream.closed or stream.isatty():
        raise ConfigError(
            f"{key}.standby=true: a standby takes over when its supervisor writes 'go' to its "
            "stdin, a pipe; start it with python -m trainers.elastic run --standby, or set "
            f"{key}.standby=false."
        )


def take_over(group: int, output_dir: str, stdin: IO[str] | None = None) -> None:
    """Waits for the supervisor's go (module docstring), then makes this process the group:
    stdout and stderr appended to the group's log, the run log file in `output_dir`. Exits
    the process (status 0, nothing written) at end of file: the supervisor is gone."""
    stream = sys.stdin if stdin is None else stdin
    log.info("Standby of group %d ready (built and compiled); waiting for its go.", group)
    line = stream.readline()
    if not line.startswith(GO):
        log.info("Standby of group %d: its supervisor is gone or stopped it; exiting.", group)
        logging.shutdown()
        os._exit(0)  # no result.json, no summary: nothing of the group's is touched
    group_log = line[len(GO) :].strip()
    if group_log:
        _append_output_to(group_log)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, RunLogFile):
            handler.move_to(output_dir)
    log.info("Standby of group %d taking over its group (pid %d).", group, os.getpid())


def exit_before_go(group: int, error: BaseException, code: int) -> NoReturn:
    """A standby that failed before its go exits with `code` and one line (`error`), writing
    nothing to its group's run dir (no ``result.json``: the group may be alive)."""
    log.error("Standby of group %d failed before its go; nothing of the group's written.", group)
    print(f"xshard: error: {error}", file=sys.stderr, flush=True)
    logging.shutdown()
    os._exit(code)


def _append_output_to(path: str) -> None:
    """Points this process's stdout and stderr (file descriptors 1 and 2) at `path`, appended."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)
