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


def resolve_backend(op: str, backend: Backend, *, pallas_available: bool = True) -> Backend:
    """Turn AUTO into PALLAS (on GPU, when the kernel exists) or XLA, saying so once per op."""
    if backend is not Backend.AUTO:
        return backend
    if on_gpu() and pallas_available:
        chosen, why = Backend.PALLAS, "GPU present"
    else:
        chosen = Backend.XLA
        why = "no GPU" if pallas_available else "no Pallas kernel for this op yet"
    if (op, why) not in _said:
        _said.add((op, why))
        log.info("atlas_jax: %s 'auto' uses the %s implementation (%s)", op, chosen.value, why)
    return chosen
