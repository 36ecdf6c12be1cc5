"""Choosing an op's implementation from a KernelConfig field."""

from __future__ import annotations

import logging

import jax

from atlas_jax.config import Backend

log = logging.getLogger("atlas_jax")
_said: set[tuple[str, str]] = set()


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def interpret_mode() -> bool:
    """Pallas kernels run in interpret mode where no GPU is present (how CPU tests run them)."""
    return not on_gpu()


def resolve_backend(op: str, backend: Backend, *, pallas_available: bool = True,
                    unsupported: str | None = None) -> Backend:
    """Turn AUTO into PALLAS (on GPU, when the kernel exists and supports the call: no
    ``unsupported`` reason) or XLA, saying so once per op and reason."""
    if backend is not Backend.AUTO:
        return backend
    if on_gpu() and pallas_available and unsupported is None:
        chosen, why = Backend.PALLAS, "GPU present"
    else:
        chosen = Backend.XLA
        if not pallas_available:
            why = "no Pallas kernel for this op yet"
        elif not on_gpu():
            why = "no GPU"
        else:
            why = unsupported
    if (op, why) not in _said:
        _said.add((op, why))
        log.info("atlas_jax: %s 'auto' uses the %s implementation (%s)", op, chosen.value, why)
    return chosen
