"""MXFP4 (OCP Microscaling): E2M1 values, one E8M0 scale per 32 along K (gpt-oss).

A scale byte ``s`` is a raw E8M0 exponent: value ``2^(s - 127)``, ``255`` = NaN, no zero. The
smallest, ``s = 0`` = 2^-127, is a float32 subnormal: a kernel that flushes denormals reads it as
0. Dequantization is ``e2m1 * 2^(s - 127)``, exact in float32.

``quantize`` follows the OCP MX spec v1.0 (section 6.3): shared exponent
``floor(log2(block_amax)) - emax(E2M1)`` with ``emax = 2``, clamped to [-127, 127] (an all-zero
block gets the smallest, -127), then ``e2m1(w / 2^e)`` rounding half to even, saturating at +-6.
So ``|w| / 2^e`` lies in [4, 8) for the block max, and values in (6, 8) saturate. (ModelOpt's
``MXFP4QTensor`` instead uses ``ceil(log2(block_amax / 6))``, which never saturates but
sometimes picks the coarser scale; checkpoints store only the bytes, so loading is unaffected.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from atlas_jax.quant import _fp4

BLOCK = 32
E8M0_BIAS = 127
_E2M1_EMAX = 2


def shared_exponent(block_amax: jax.Array) -> jax.Array:
    """float32 block amax -> E8M0 byte ``clip(floor(log2 amax) - 2, -127, 127) + 127`` (uint8).

    ``floor(log2 amax)`` is read exactly from the float32 exponent field; zero and subnormal
    amax read as -127, so they land on the smallest scale.
    """
    biased = (lax.bitcast_convert_type(block_amax.astype(jnp.float32), jnp.uint32) >> 23) & 0xFF
    return jnp.clip(biased.astype(jnp.int32) - _E2M1_EMAX, 0, 2 * E8M0_BIAS).astype(jnp.uint8)


def e8m0_to_float(scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Raw E8M0 bytes -> ``2^(s - 127)`` (255 -> NaN) via ``float8_e8m0fnu``."""
    return lax.bitcast_convert_type(scale, jnp.float8_e8m0fnu).astype(dtype)


def _inv_pow2(scale: jax.Array) -> jax.Array:
    """E8M0 byte ``s`` -> float32 ``2^(127 - s)``, built from exponent bits (normal for s <= 252,
    which covers every finite float32 amax)."""
    bits = (2 * E8M0_BIAS - scale.astype(jnp.uint32)) << 23
    return lax.bitcast_convert_type(bits, jnp.float32)


def quantize(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``w [*L, N, K]`` -> ``(data [*L, N, K//2] u8, scale [*L, N, K//32] u8 E8M0)``.

    K must be a multiple of 32 (checked by the caller). Multiplying by the exact power of two
    ``2^-e`` equals dividing by ``2^e`` and avoids dividing by the subnormal 2^-127.
    """
    *lead, n, k = w.shape
    wb = w.astype(jnp.float32).reshape(*lead, n, k // BLOCK, BLOCK)
    scale = shared_exponent(jnp.max(jnp.abs(wb), axis=-1))  # [*L, N, K//32]
    codes = _fp4.encode(wb * _inv_pow2(scale)[..., None])  # [*L, N, K//32, 32]
    return _fp4.pack(codes.reshape(*lead, n, k)), scale


def dequantize(
    data: jax.Array,  # [*L, N, K//2] uint8
    scale: jax.Array,  # [*L, N, K//32] uint8 E8M0
    dtype=jnp.float32,
) -> jax.Array:
    """``e2m1 * 2^(s - 127)`` -> [*L, N, K] ``dtype``."""
    *lead, n, half_k = data.shape
    vals = _fp4.decode(_fp4.unpack(data)).reshape(*lead, n, -1, BLOCK)  # [*L, N, K//32, 32]
    w = vals * e8m0_to_float(scale)[..., None]
    return w.reshape(*lead, n, 2 * half_k).astype(dtype)
