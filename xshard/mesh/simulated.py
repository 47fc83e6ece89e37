"""How many simulated CPU devices one process can have (``mesh.simulate_on_cpu=true``).

The count is a JAX setting fixed before JAX initialises (`xshard.mesh.build.configure_devices` sets
``jax_num_cpu_devices``), and a count the platform cannot give does not fail cleanly: XLA
aborts the process (SIGABRT, SIGSEGV) or the first program fails with a traceback. So the
count is checked here first, from what was measured with jaxlib 0.10 on Linux x86-64:

* XLA:CPU runs no program over more than `MAX_SIMULATED_CPU_DEVICES` (2048) devices of one
  process: with 2049 the first ``jit`` fails ("Multiprocess computations aren't implemented
  on the CPU backend"). Past that, start-up alone takes minutes (20,000 devices: 35 s to
  start, minutes to exit) and exhausts threads or memory (a SIGABRT from ``pthread_create``,
  a SIGSEGV at a million).
* Each simulated device starts XLA CPU-client threads: `THREADS_PER_DEVICE` (2) per device up
  to 256 devices and one past that, each reserving a thread stack (``RLIMIT_STACK``, 8 MiB by
  default) of address space, on top of about `BACKEND_ADDRESS_SPACE` (1 GiB: allocator arenas,
  code) for the backend itself. Under an address-space limit (``ulimit -v``, ``RLIMIT_AS``)
  ``pthread_create`` then fails and XLA aborts: with 8 GiB, at about 550 devices. The bound
  here counts 2 threads for every device, so it stays below that point.
"""

from __future__ import annotations

import resource
from typing import NamedTuple

#: The most simulated CPU devices one process may have: XLA:CPU runs no program over more.
MAX_SIMULATED_CPU_DEVICES = 2048
#: XLA CPU-client threads per simulated device (at most; measured, see the module docstring).
THREADS_PER_DEVICE = 2
#: Address space the CPU backend maps at start-up besides its threads' stacks (measured).
BACKEND_ADDRESS_SPACE = 1 << 30
_DEFAULT_STACK = 8 << 20  # glibc's thread stack when RLIMIT_STACK is unlimited: 8 MiB here


class DeviceBound(NamedTuple):
    """The most simulated CPU devices this process can have, and why."""

    limit: int
    reason: str


def _soft_limit(which: int) -> int | None:
    """A resource's soft limit in bytes, or None when unlimited."""
    soft = resource.getrlimit(which)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def address_space_in_use() -> int:
    """Bytes of address space this process has mapped (``VmSize``); 0 where unknown."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def simulated_device_bound() -> DeviceBound:
    """The most simulated CPU devices this process can have: `MAX_SIMULATED_CPU_DEVICES`, or
    fewer under an address-space limit (``RLIMIT_AS``), whose room left must hold
    `BACKEND_ADDRESS_SPACE` and `THREADS_PER_DEVICE` thread stacks per device."""
    bound = DeviceBound(MAX_SIMULATED_CPU_DEVICES, "XLA:CPU runs no program over more")
    cap = _soft_limit(resource.RLIMIT_AS)
    if cap is None:
        return bound
    stack = _soft_limit(resource.RLIMIT_STACK) or _DEFAULT_STACK
    room = cap - address_space_in_use() - BACKEND_ADDRESS_SPACE
    fits = max(room // (THREADS_PER_DEVICE * stack), 0)
    if fits >= bound.limit:
        return bound
    return DeviceBound(
        int(fits),
        f"this process's address-space limit (RLIMIT_AS, ulimit -v) of {cap / 2**30:.1f} GiB "
        f"holds the threads of at most {fits} (about {THREADS_PER_DEVICE} x "
        f"{stack >> 20} MiB of stack each)",
    )
