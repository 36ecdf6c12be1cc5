"""RMSNorm in float32: ``x * w`` (Qwen3, Llama) and zero-centred ``x * (1 + w)`` (Qwen3-Next),
and the fused residual-add + norm of a decoder layer."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from atlas_jax.config import NormStyle


def rms_norm(x: jax.Array, w: jax.Array, eps: float,
             style: NormStyle = NormStyle.SCALE) -> jax.Array:
    """``x / sqrt(mean(x^2) + eps) * w`` (or ``* (1 + w)``) over the last dim, computed in
    float32, returned in ``x.dtype``.  # [..., D], [D] -> [..., D]

    For float32 inputs this is transformers' Qwen3RMSNorm / Qwen3NextRMSNorm exactly; for
    bf16 it rounds once at the end (Qwen3RMSNorm rounds the normalized x before ``* w``).
    """
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    match style:
        case NormStyle.SCALE:
            y = y * w.astype(jnp.float32)
        case NormStyle.OFFSET:
            y = y * (1.0 + w.astype(jnp.float32))
    return y.astype(x.dtype)


def add_rms_norm(x: jax.Array, residual: jax.Array, w: jax.Array, eps: float,
                 style: NormStyle = NormStyle.SCALE) -> tuple[jax.Array, jax.Array]:
    """Fused ``r = x + residual; (rms_norm(r), r)``: the sum is exact in float32 and rounded
    once to ``x.dtype`` (as a bf16 add), then normalized.  # [..., D] x2 -> [..., D] x2"""
    r = (x.astype(jnp.float32) + residual.astype(jnp.float32)).astype(x.dtype)
    return rms_norm(r, w, eps, style), r
