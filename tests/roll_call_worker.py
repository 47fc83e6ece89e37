"""One process answering a roll call: `python -m tests.roll_call_worker ADDRESS PID COUNT WAIT`.

Calls `trainers.cluster.roll_call.answer_roll` as process PID of COUNT at ADDRESS (host:port),
waiting at most WAIT seconds, and prints one line: ``ok``, ``timeout``, or ``error: <the
ConfigError's line>``; exits 0, 3 or 2 alike. No JAX: the roll call comes before it.
"""

import sys
import time

from trainers.cluster.roll_call import CoordinatorProbe, answer_roll
from trainers.config import DistributedOptions
from xshard.errors import ConfigError


def main(address: str, pid: int, count: int, wait_s: float) -> int:
    opts = DistributedOptions(
        enabled=True,
        coordinator_address=address,
        num_processes=count,
        process_id=pid,
        initialization_timeout_s=wait_s,
    )
    try:
        done = answer_roll(opts, time.monotonic() + wait_s, CoordinatorProbe())
    except ConfigError as e:
        print(f"error: {e}", flush=True)
        return 2
    print("ok" if done else "timeout", flush=True)
    return 0 if done else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])))
