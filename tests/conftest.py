"""Every test runs on 8 simulated CPU devices; XLA reads the flags when JAX's backend starts."""

import os

from redcoast.simulate import simulate_cpu_devices

os.environ.setdefault("JAX_PLATFORMS", "cpu")
simulate_cpu_devices(8)
