"""E2M1 (FP4) codes and their nibble packing, shared by NVFP4 and MXFP4.

A code is the 4-bit E2M1 pattern ``s ee m`` held in a uint8 (0..15): 0..7 are
``0, 0.5, 1, 1.5, 2, 3, 4, 6`` and 8..15 the same values negated. Two codes share a byte, the
LOW nibble holding the even (lower) k index: ``byte = code[2j] | code[2j + 1] << 4``, the layout
of ModelOpt, compressed-tensors and gpt-oss checkpoints.

Conversions go through ``jnp.float4_e2m1fn`` (ml_dtypes), never through a value table: a code
becomes a value by ``uint8 -> uint4 -> bitcast float4_e2m1fn``, and back the same way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

E2M1_MAX = 6.0


def encode(x: jax.Array) -> jax.Array:
    """Float -> E2M1 codes, round half to even, saturating at +-6.

    The cast alone also saturates (ml_dtypes and XLA agree), but it maps NaN to 0x8 (-0)
    silently; the explicit clip documents the saturation and keeps kernels honest.
    """
    q = jnp.clip(x, -E2M1_MAX, E2M1_MAX).astype(jnp.float4_e2m1fn)
    return lax.bitcast_convert_type(q, jnp.uint4).astype(jnp.uint8)


def decode(codes: jax.Array, dtype=jnp.float32) -> jax.Array:
    """E2M1 codes (uint8 in 0..15) -> values in ``dtype``."""
    e2m1 = lax.bitcast_convert_type(codes.astype(jnp.uint4), jnp.float4_e2m1fn)
    return e2m1.astype(dtype)


def pack(codes: jax.Array) -> jax.Array:
    """[..., K] codes -> [..., K//2] bytes, low nibble = even k."""
    pairs = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], -1, 2)  # [..., K//2, 2]
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack(packed: jax.Array) -> jax.Array:
    """[..., K//2] bytes -> [..., K] codes, inverse of :func:`pack`."""
    pairs = jnp.stack([packed & 0xF, packed >> 4], axis=-1)  # [..., K//2, 2]
    return pairs.reshape(*packed.shape[:-1], -1)
