"""Rotary position embeddings: neox (rotate-half), GPT-J (interleaved pairs), Qwen3-VL
interleaved mrope over 3-D positions; partial rotary; linear and YaRN frequency scaling.

Frequencies follow transformers' ``modeling_rope_utils`` (``_compute_default_rope_parameters``,
``_compute_linear_scaling_rope_parameters``, ``_compute_yarn_parameters``) step by step in
float32 numpy, at trace time: they depend only on the static config. Only the first
``R = rope.rotary_dim(head_dim)`` dims of a head rotate; the rest pass through.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from atlas_jax.config import RopeConfig, RopeScaling, RopeStyle


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_correction_range(rope: RopeConfig, dim: int) -> tuple[float, float]:
    """Dims ``[low, high]`` of YaRN's ramp between beta_fast and beta_slow rotations."""
    base, orig = rope.theta, rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_attention_factor(rope: RopeConfig) -> float:
    """The cos/sin multiplier: the override, else mscale ratio (DeepSeek), else 0.1 ln(f) + 1."""
    if rope.attention_factor is not None:
        return float(rope.attention_factor)
    if rope.mscale and rope.mscale_all_dim:
        return float(yarn_get_mscale(rope.factor, rope.mscale)
                     / yarn_get_mscale(rope.factor, rope.mscale_all_dim))
    return yarn_get_mscale(rope.factor)


def inv_freq(rope: RopeConfig, head_dim: int) -> tuple[np.ndarray, float]:
    """``([R/2] float32 inverse frequencies, cos/sin multiplier)`` of ``rope``."""
    dim = rope.rotary_dim(head_dim)
    pos_freqs = rope.theta ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    match rope.scaling:
        case RopeScaling.NONE:
            return (1.0 / pos_freqs).astype(np.float32), 1.0
        case RopeScaling.LINEAR:
            return (1.0 / pos_freqs / np.float32(rope.factor)).astype(np.float32), 1.0
        case RopeScaling.YARN:
            extrapolation = 1.0 / pos_freqs
            interpolation = 1.0 / (np.float32(rope.factor) * pos_freqs)
            low, high = yarn_correction_range(rope, dim)
            if low == high:
                high += 0.001  # transformers: prevent a singular ramp
            ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low))
                           / np.float32(high - low), 0, 1)
            extrapolation_factor = 1 - ramp
            inv = (interpolation * (1 - extrapolation_factor)
                   + extrapolation * extrapolation_factor)
            return inv.astype(np.float32), yarn_attention_factor(rope)


def mrope_axes(section: tuple[int, int, int], half: int) -> np.ndarray:
    """Qwen3-VL interleaved mrope: which position axis (0 t, 1 h, 2 w) drives each of the R/2
    frequencies: h at 1, 4, 7, ... (section[1] of them), w at 2, 5, 8, ..., the rest t."""
    axis = np.zeros(half, np.int32)
    for a in (1, 2):
        axis[a: 3 * section[a]: 3] = a
    return axis


def rope_cos_sin(rope: RopeConfig, head_dim: int,
                 positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin ``[B, S, R/2]`` float32, the attention factor multiplied in.

    ``positions``: ``[B, S]`` int, or ``[3, B, S]`` (t, h, w) for mrope; text-only mrope may pass
    ``[B, S]`` (all three axes equal).
    """
    inv, factor = inv_freq(rope, head_dim)
    freqs = positions[..., None].astype(jnp.float32) * inv  # [(3,) B, S, R/2]
    if rope.style is RopeStyle.MROPE and positions.ndim == 3:
        axes = jnp.asarray(mrope_axes(rope.mrope_section, inv.shape[0]))
        freqs = jnp.take_along_axis(freqs, axes[None, None, None, :], axis=0)[0]  # [B, S, R/2]
    elif positions.ndim != 2:
        raise ValueError(f"positions: expected [B, S] (or [3, B, S] for mrope), "
                         f"got {positions.shape}")
    return jnp.cos(freqs) * factor, jnp.sin(freqs) * factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, style: RopeStyle) -> jax.Array:
    """Rotate the first R dims of every head: ``x [B, S, N, D]``, cos/sin ``[B, S, R/2]``.

    neox / mrope rotate ``(x[i], x[i + R/2])``, GPT-J rotates ``(x[2i], x[2i + 1])``, each by
    frequency i: ``(a, b) -> (a cos - b sin, b cos + a sin)``. Computed in float32.
    """
    r = 2 * cos.shape[-1]
    xf = x.astype(jnp.float32)
    xr, xp = xf[..., :r], xf[..., r:]
    c, s = cos[..., None, :], sin[..., None, :]  # [B, S, 1, R/2]
    match style:
        case RopeStyle.NEOX | RopeStyle.MROPE:
            a, b = xr[..., : r // 2], xr[..., r // 2:]
            out = jnp.concatenate([a * c - b * s, b * c + a * s], axis=-1)
        case RopeStyle.GPTJ:
            a, b = xr[..., 0::2], xr[..., 1::2]
            out = jnp.stack([a * c - b * s, b * c + a * s], axis=-1).reshape(xr.shape)
    return jnp.concatenate([out, xp], axis=-1).astype(x.dtype)
