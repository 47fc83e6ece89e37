"""Test setup: every test process sees 8 simulated CPU devices.

The device count must be fixed before JAX initialises its backends, so it is set here, at
import time, before any test module imports JAX. Subprocesses inherit it via XLA_FLAGS.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

NUM_DEVICES = 8
