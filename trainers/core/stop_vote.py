"""The stop vote: how the processes of a run agree to stop, inside the step.

Each process encodes its stop request (`StopVote.encode`) and passes it, on each of its
devices, into the step it dispatches (`trainers.core.trainer.Trainer` with ``agree_stop``); the step
takes the highest vote over all devices and returns it as the hidden metric `STOP_VOTE_KEY`,
which every process reads with the step's other metrics (`StopVote.decode`).
"""

from __future__ import annotations

import dataclasses

#: The hidden metric holding the step's agreed stop vote (`StopVote.decode`).
STOP_VOTE_KEY = "_stop_vote"


@dataclasses.dataclass(frozen=True)
class StopVote:
    """The stop request the processes agreed on: the highest vote over all devices.

    Attributes:
      step: the step whose dispatch carried the vote (the run ends after the next one).
      process: the process whose vote won (the highest index among those that voted).
      signal: whether that process was asked to stop by a signal (`should_stop`).
      hook: whether one of that process's hooks asked to stop (`Hook.wants_stop`).
    """

    step: int
    process: int
    signal: bool
    hook: bool

    @staticmethod
    def encode(process: int, signal: bool, hook: bool) -> int:
        """One process's vote: 0 for none, else its index and the reasons in an integer."""
        return 0 if not (signal or hook) else (process << 2) | int(signal) | int(hook) << 1

    @classmethod
    def decode(cls, step: int, vote: float) -> StopVote | None:
        """The agreed vote of `step` (a metric value), or None if nobody voted to stop."""
        code = int(vote)
        if code == 0:
            return None
        return cls(step, code >> 2, bool(code & 1), bool(code & 2))
