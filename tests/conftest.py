"""Shared test configuration.

JAX runs on the CPU in tests. 8 simulated host devices are requested before JAX is imported so
that the sharding tests can build meshes; single-device code is unaffected (arrays default to
device 0).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
