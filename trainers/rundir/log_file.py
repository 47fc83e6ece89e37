"""What reaches the terminal: an error once, log lines that do not land on the progress bar,
and a log file that never takes the run down nor writes outside the run dir.

Hydra's default logging sends every record to the console (stdout) and to the run's log
file. An error the CLI also prints on stderr (``xshard: error: ...``, the one line scripts
read) would then show twice on the terminal; `log_to_files` records it in the log file only.

xshard's job logging (``conf/hydra/job_logging/xshard.yaml``, selected by ``xshard_train``)
writes the log file with `RunLogFile`: it never writes through a link (a run dir copied from
elsewhere is not trusted, `trainers.rundir.links`), and a write that fails (a full disk) is
reported once, in one line on stderr, instead of a traceback per record.
"""

from __future__ import annotations

import logging
import os
import sys

from trainers.exits import LinkOutOfRunDirError
from trainers.rundir.outputs import open_appended


def log_to_files(logger: logging.Logger, level: int, message: str) -> None:
    """Hands one record to the file handlers that `logger`'s records reach, and to no other.

    Args:
      logger: the logger the record is from (its name and level apply).
      level: the record's level.
      message: the message (already formatted).
    """
    if not logger.isEnabledFor(level):
        return
    record = logger.makeRecord(logger.name, level, "(unknown file)", 0, message, (), None)
    current: logging.Logger | None = logger
    while current is not None:
        for handler in current.handlers:
            if isinstance(handler, logging.FileHandler) and level >= handler.level:
                handler.handle(record)
        current = current.parent if current.propagate else None


class RunLogFile(logging.FileHandler):
    """The run's log file (``train.log``): a `logging.FileHandler` that

    - opens the file when the first record comes, never through a link
      (`trainers.rundir.outputs.open_appended`): at a symbolic link, or at a file with another
      name (a hard link), it writes nothing (the run's start-up check refuses the run, naming
      the link);
    - on the first failed write (no space left, an I/O error) prints one line on stderr,
      closes the file and writes nothing more to it: the run goes on, logging to the console.

    Attributes:
      problem: why nothing more is written to the file (None while it is written).
    """

    _closed: bool  # logging.Handler's (set by its __init__ and close), not in typeshed

    def __init__(
        self,
        filename: str | os.PathLike,
        mode: str = "a",
        encoding: str | None = None,
        delay: bool = True,
        errors: str | None = None,
    ) -> None:
        super().__init__(filename, mode, encoding=encoding, delay=True, errors=errors)
        self.problem: str | None = None

    def _open(self):  # a text stream, as FileHandler._open
        fd = open_appended(self.baseFilename, truncate="w" in self.mode)
        try:
            return os.fdopen(fd, "a", encoding=self.encoding, errors=self.errors)
        except BaseException:
            os.close(fd)
            raise

    def emit(self, record: logging.LogRecord) -> None:
        if self.problem is not None:
            return
        if self.stream is None:
            if self.mode == "w" and self._closed:  # as FileHandler: never truncate twice
                return
            try:
                self.stream = self._open()
            except LinkOutOfRunDirError:  # the start-up check names it and refuses the run
                self._stop(None)
                return
            except OSError as e:
                self._stop(e)
                return
        logging.StreamHandler.emit(self, record)  # a failure calls handleError

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            self._stop(error)
        else:  # a bad message or format string: logging's own report
            super().handleError(record)

    def move_to(self, folder: str | os.PathLike[str]) -> None:
        """Writes the next records to the file of the same name in `folder` (appended, opened
        at the next record): a group's warm standby taking over its run dir
        (`trainers.cluster.standby`)."""
        self.acquire()
        try:
            stream, self.stream = self.stream, None
            if stream is not None:
                stream.close()
            name = os.path.basename(self.baseFilename)
            self.baseFilename = os.path.join(os.path.abspath(folder), name)
        finally:
            self.release()

    def _stop(self, error: OSError | None) -> None:
        """Stops writing the file; says why in one line unless it is a link (None: refused
        by the start-up check)."""
        link = error is None
        self.problem = (
            "a link (not written through)"
            if error is None
            else (error.strerror or type(error).__name__)
        )
        stream, self.stream = self.stream, None
        if stream is not None:
            try:
                stream.close()  # its unwritten buffer is dropped with it
            except OSError:
                pass
        if not link and logging.raiseExceptions:
            try:
                print(
                    f"xshard: warning: the log file {self.baseFilename} cannot be written "
                    f"({self.problem}); the run goes on, logging to the console only.",
                    file=sys.stderr,
                    flush=True,
                )
            except (OSError, ValueError):  # stderr closed too
                pass
