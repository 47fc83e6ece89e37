"""What reaches the terminal: an error once, and log lines that do not land on the progress bar.

Hydra's default logging sends every record to the console (stdout) and to the run's log
file. An error the CLI also prints on stderr (``xshard: error: ...``, the one line scripts
read) would then show twice on the terminal; `log_to_files` records it in the log file only.
"""

from __future__ import annotations

import logging


def log_to_files(logger: logging.Logger, level: int, message: str) -> None:
    """Hands one record to the file handlers that `logger`'s records reach, and to no other.

    Args:
      logger: the logger the record is from (its name and level apply).
      level: the record's level.
      message: the message (already formatted).
    """
    if not logger.isEnabledFor(level):
        return
    record = logger.makeRecord(logger.name, level, "(unknown file)", 0, message, None, None)
    current: logging.Logger | None = logger
    while current is not None:
        for handler in current.handlers:
            if isinstance(handler, logging.FileHandler) and level >= handler.level:
                handler.handle(record)
        current = current.parent if current.propagate else None
