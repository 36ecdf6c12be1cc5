"""Host-side checks of array values (not shapes): raised eagerly on concrete arrays, and from a
host callback under ``jax.jit``, where the ValueError surfaces as a runtime error carrying the
same message."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import numpy as np


def host_check(check: Callable[..., None], *arrays: jax.Array) -> None:
    """Run ``check(*numpy arrays)`` now when the arrays are concrete, or at run time from
    ``jax.debug.callback`` when any is a tracer. ``check`` raises ValueError."""
    if any(isinstance(a, jax.core.Tracer) for a in arrays):
        jax.debug.callback(lambda *a: check(*map(np.asarray, a)), *arrays)
    else:
        check(*map(np.asarray, arrays))


def check_in_range(values: jax.Array, hi: int, name: str, what: str) -> None:
    """Raise ValueError if any of ``values`` (argument ``name``) is outside ``[0, hi)``;
    ``what`` says what bounds them."""
    host_check(functools.partial(_in_range, hi=hi, name=name, what=what), values)


def _in_range(v: np.ndarray, *, hi: int, name: str, what: str) -> None:
    bad = (v < 0) | (v >= hi)
    if bad.any():
        raise ValueError(f"{name}: {int(bad.sum())} value(s) outside [0, {hi}) ({what}); "
                         f"first bad value {int(v[bad].reshape(-1)[0])}")
