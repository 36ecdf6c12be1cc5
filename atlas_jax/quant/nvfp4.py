"""NVFP4: E2M1 values, one E4M3 scale per 16 along K, one float32 global per row segment.

Dequantization is ``e2m1 * f32(scale) * g``. The e2m1 * scale product is exact in float32 (2
and 4 significant bits), so the only rounding is the final ``* g``. ModelOpt's own
``NVFP4QTensor.dequantize`` computes ``e2m1 * (f32(scale) * g)`` instead, which rounds twice
and may differ from ours by one float32 ulp; the codes and scales are what is bit-exact.

``quantize`` reproduces NVIDIA ModelOpt bit for bit. From
``modelopt/torch/quantization/qtensor/nvfp4_tensor.py`` (``NVFP4QTensor``):

* ``get_weights_scaling_factor_2``: ``g = reduce_amax(w).float() / (6.0 * 448.0)``, float32,
  one per linear (here: one per leading index, i.e. per expert).
* ``get_weights_scaling_factor``: ``r = block_amax.float() / (6.0 * g)``, then
  ``r[r == 0] = 1.0`` (the zero-block rule, BEFORE the cast), then ``r.to(float8_e4m3fn)``.
* ``quantize``: ``x = w / (f32(s) * g)`` (the product first, then one division), then
  ``_cast_fp4``: ``searchsorted`` over the midpoints ``[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5]``
  plus one at the odd midpoints ``0.75, 1.75, 3.5``; that is round half to even, saturating at
  6. The sign bit is ``x < 0``, so ``x == -0.0`` gives code 0x0 (a cast gives 0x8) while a
  small negative that rounds to zero gives 0x8 (as the cast does).
* Packing: ``(q[..., 1::2] << 4) | q[..., 0::2]``: low nibble = even k.

Where ModelOpt produces NaN we do not: an all-zero tensor (``g == 0``) gets scales 1 and codes
0 (ModelOpt divides 0 by 0 into NaN scales), and a zero element of a block whose E4M3 scale
underflows to 0 gets code 0 (ModelOpt: whatever ``searchsorted`` makes of NaN). Both dequantize
to 0 in those blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from atlas_jax.quant import _fp4
from atlas_jax.quant.fp8 import E4M3_MAX, div_rn, to_e4m3

BLOCK = 16


def global_scale(w: jax.Array) -> jax.Array:
    """``amax(|w|) / (6 * 448)`` over the last two dims: ``[*L, N, K] -> [*L]`` float32."""
    amax = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=(-2, -1))
    return div_rn(amax, _fp4.E2M1_MAX * E4M3_MAX)


def quantize(w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``w [*L, N, K]`` -> ``(data [*L, N, K//2] u8, scale [*L, N, K//16] e4m3, g [*L, 1] f32)``.

    K must be a multiple of 16 (checked by the caller).
    """
    *lead, n, k = w.shape
    g = global_scale(w)[..., None, None]  # [*L, 1, 1]
    wb = w.astype(jnp.float32).reshape(*lead, n, k // BLOCK, BLOCK)
    block_amax = jnp.max(jnp.abs(wb), axis=-1)  # [*L, N, K//16]
    r = div_rn(block_amax, _fp4.E2M1_MAX * g)
    r = jnp.where((r == 0) | (block_amax == 0), 1.0, r)
    scale = to_e4m3(r)  # [*L, N, K//16]
    x = div_rn(wb, (scale.astype(jnp.float32) * g)[..., None])  # [*L, N, K//16, 16]
    x = jnp.where((x == 0) | jnp.isnan(x), 0.0, x)  # -0.0 -> +0 as ModelOpt; 0/0 -> 0
    data = _fp4.pack(_fp4.encode(x).reshape(*lead, n, k))
    return data, scale, g[..., 0]


def dequantize(
    data: jax.Array,  # [*L, N, K//2] uint8
    scale: jax.Array,  # [*L, N, K//16] float8_e4m3fn
    global_scale: jax.Array,  # [*L, R] float32, R divides N
    dtype=jnp.float32,
) -> jax.Array:
    """``e2m1 * f32(scale) * g[row segment]`` -> [*L, N, K] ``dtype``."""
    *lead, n, half_k = data.shape
    vals = _fp4.decode(_fp4.unpack(data)).reshape(*lead, n, -1, BLOCK)  # [*L, N, K//16, 16]
    g_rows = jnp.repeat(global_scale, n // global_scale.shape[-1], axis=-1)  # [*L, N]
    w = (vals * scale.astype(jnp.float32)[..., None]) * g_rows[..., None, None]
    return w.reshape(*lead, n, 2 * half_k).astype(dtype)
