"""FP8 block-scaled weights (DeepSeek-V3 ``weight_scale_inv`` layout).

``w [*L, N, K]`` is cut into ``(b0 x b1)`` blocks (edge blocks partial); each block stores one
float32 ``scale_inv = block_amax / 448`` (an all-zero block gets 1.0) and its values as
``e4m3(clip(w / scale_inv, -448, 448))``. Dequantization is ``f32(q) * scale_inv``.

Two XLA facts every quantizer here relies on:

* ``float -> float8_e4m3fn`` rounds half to even but does NOT saturate: ``|x| > 464`` (past
  the midpoint above 448; 464 itself ties to 448) becomes NaN, as in ml_dtypes and torch.
  Always clip first (:func:`to_e4m3`).
* XLA's algebraic simplifier rewrites ``a / broadcast(b)`` (and ``a / constant``) into
  ``a * (1 / b)``, which is not correctly rounded. Reference quantizers divide, so the divisor
  is hidden behind an optimization barrier (:func:`div_rn`) to stay bit-exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

E4M3_MAX = 448.0


def div_rn(a: jax.Array, b) -> jax.Array:
    """``a / b`` correctly rounded, elementwise with broadcasting.

    Broadcasting ``b`` before an optimization barrier stops XLA from turning the division into
    a multiplication by a rounded reciprocal.
    """
    b = jnp.broadcast_to(b, jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b)))
    return a / lax.optimization_barrier(b)


def to_e4m3(x: jax.Array) -> jax.Array:
    """Float -> float8_e4m3fn, round half to even, saturating at +-448 (NaN stays NaN)."""
    return jnp.clip(x, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)


def num_blocks(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """``(ceil(N / b0), ceil(K / b1))`` for a logical ``[*L, N, K]`` shape."""
    return -(-shape[-2] // block[0]), -(-shape[-1] // block[1])


def quantize(w: jax.Array, block: tuple[int, int]) -> tuple[jax.Array, jax.Array]:
    """``w [*L, N, K]`` float -> ``(q [*L, N, K] e4m3, scale_inv [*L, nb0, nb1] f32)``."""
    *lead, n, k = w.shape
    b0, b1 = block
    nb0, nb1 = num_blocks(w.shape, block)
    pad = [(0, 0)] * len(lead) + [(0, nb0 * b0 - n), (0, nb1 * b1 - k)]
    wb = jnp.pad(w.astype(jnp.float32), pad).reshape(*lead, nb0, b0, nb1, b1)
    amax = jnp.max(jnp.abs(wb), axis=(-3, -1))  # [*L, nb0, nb1]
    scale_inv = div_rn(amax, E4M3_MAX)
    scale_inv = jnp.where(scale_inv == 0, 1.0, scale_inv)  # zero (or underflowing) block
    q = to_e4m3(div_rn(wb, scale_inv[..., :, None, :, None]))  # [*L, nb0, b0, nb1, b1]
    q = q.reshape(*lead, nb0 * b0, nb1 * b1)[..., :n, :k]
    return q, scale_inv


def dequantize(
    q: jax.Array,  # [*L, N, K] float8_e4m3fn
    scale_inv: jax.Array,  # [*L, nb0, nb1] float32
    block: tuple[int, int],
    dtype=jnp.float32,
) -> jax.Array:
    """``f32(q) * scale_inv`` broadcast over each block -> [*L, N, K] ``dtype``."""
    n, k = q.shape[-2:]
    s = jnp.repeat(jnp.repeat(scale_inv, block[0], axis=-2), block[1], axis=-1)
    return (q.astype(jnp.float32) * s[..., :n, :k]).astype(dtype)
