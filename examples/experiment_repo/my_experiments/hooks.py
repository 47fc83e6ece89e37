"""A custom `trainers.Hook`: appends the run's losses and its end to a JSON-lines file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trainers


class LossLog(trainers.Hook):
    """Writes ``{"step": k, "loss": ...}`` every `every` steps and ``{"end": reason, "step": k}``
    when the run ends, appending to `path` (a resumed run continues the same file).

    Args:
      path: the file (conf/train.yaml puts it in the run's output dir).
      every: period in steps.
    """

    def __init__(self, path: str, every: int = 1):
        self.path, self.every = Path(path), int(every)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def _write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        """Logs the step's training loss every `every` steps."""
        if step % self.every == 0 and "train/loss" in metrics:
            self._write({"step": step, "loss": metrics["train/loss"]})

    def on_end(self, step: int, state: Any, reason: str) -> None:
        """Logs how the run ended ("done", "stopped", ...)."""
        self._write({"end": reason, "step": step})
