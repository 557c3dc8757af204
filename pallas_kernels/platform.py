"""Which platform a jitted call lands on, for picking a kernel."""

from __future__ import annotations

import jax

GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def current_platform() -> str:
    """The default device's platform if one is set (as when compiling ahead of time under
    `jax.default_device(tpu_device)` on a CPU host), else JAX's default backend."""
    dev = jax.config.jax_default_device
    if dev is None:
        return jax.default_backend()
    return dev if isinstance(dev, str) else dev.platform
