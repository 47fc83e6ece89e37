"""The README's runnable example keeps working."""

import re
import subprocess
import sys

import pytest

from tests import REPO


@pytest.mark.slow
def test_cross_shard_demo_trains_and_reports_adam_slots():
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "cross_shard_demo.py")],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", proc.stdout)]
    assert len(losses) == 6 and losses[-1] < 0.01 * losses[0], proc.stdout
    assert "slots: ['mu', 'nu']" in proc.stdout
