"""A hook for the multi-process CLI tests: steps slow enough to send a signal mid-run."""

import time

from trainers.core.trainer import Hook


class Pace(Hook):
    """Sleeps `seconds` after each step's metrics (the loop's pace, not the numbers)."""

    def __init__(self, seconds: float = 0.1):
        self.seconds = seconds

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        time.sleep(self.seconds)
